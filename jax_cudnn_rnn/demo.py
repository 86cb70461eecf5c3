"""The main job: a character-level language model trained end to end.

    python -m jax_cudnn_rnn.demo            # ~1-2 minutes on a 2-core CPU
    python -m jax_cudnn_rnn.demo --help

It reads real text available offline (the Python standard library's own
sources), trains an embedding -> multi-layer LSTM (`jax_cudnn_rnn.linen.LSTM`,
cuDNN on a GPU, pure JAX elsewhere) -> softmax model with optax, printing a
progress bar with loss and throughput; saves a checkpoint with Orbax (the LSTM
in the portable canonical format beside the other parameters); restores it into
plain `flax.linen.OptimizedLSTMCell`s and shows both give the same predictions;
and prints a sample.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

import numpy as np
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jax_cudnn_rnn import _requirements

nn = _requirements.optional_import("flax.linen", "the demo (jax_cudnn_rnn.demo)")
optax = _requirements.optional_import("optax", "the demo (jax_cudnn_rnn.demo)")

from jax_cudnn_rnn import _cudnn, checkpoint, interop, linen  # noqa: E402  (linen needs Flax)

VOCAB = 256  # bytes
MIN_CORPUS_BYTES = 10_000


def load_corpus(max_bytes: int) -> np.ndarray:
  """Bytes of the standard library's top-level modules, in a fixed order."""
  root = pathlib.Path(os.__file__).parent
  chunks, total = [], 0
  for path in sorted(root.glob("*.py")):
    data = path.read_bytes()
    chunks.append(data)
    total += len(data)
    if total >= max_bytes:
      break
  corpus = np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)
  if corpus.size < MIN_CORPUS_BYTES:
    raise RuntimeError(f"found only {corpus.size} bytes of text under {root}")
  return corpus


class CharLM(nn.Module):
  hidden: int
  layers: int
  dropout: float

  def setup(self):
    self.embed = nn.Embed(VOCAB, 64)
    self.rnn = linen.LSTM(self.hidden, num_layers=self.layers, dropout_rate=self.dropout,
                          return_carry=True)
    self.head = nn.Dense(VOCAB)

  def __call__(self, tokens, carry=None, *, deterministic=True):
    carry, h = self.rnn(self.embed(tokens), carry, deterministic=deterministic)
    return self.head(h), carry


def batches(corpus: np.ndarray, batch: int, seq_len: int, seed: int):
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, corpus.size - seq_len - 1, batch)
    window = np.stack([corpus[s:s + seq_len + 1] for s in starts]).astype(np.int32)
    yield window[:, :-1], window[:, 1:]


def progress(step: int, total: int, loss: float, rate: float) -> None:
  width = 30
  done = int(width * step / total)
  sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] step {step:4d}/{total} "
                   f"loss {loss:6.3f}  {rate / 1e3:6.1f}k chars/s")
  sys.stdout.flush()


def flax_cell_logits(model_params, rnn_canonical_params, spec, tokens):
  """The same model run with plain Flax cells, from the restored canonical weights."""
  cells = interop.to_flax_linen_cells(spec, rnn_canonical_params)
  x = nn.Embed(VOCAB, 64).apply({"params": model_params["embed"]}, tokens)
  for layer in range(spec.num_layers):
    rnn = nn.RNN(interop.flax_linen_cell(spec, "OptimizedLSTMCell"))
    x = rnn.apply({"params": {"cell": cells[layer][0]}}, x)
  return nn.Dense(VOCAB).apply({"params": model_params["head"]}, x)


def sample(model, params, prompt: bytes, length: int, temperature: float, seed: int) -> str:
  @jax.jit
  def step(tokens, carry, key):
    logits, carry = model.apply({"params": params}, tokens, carry)
    nxt = jax.random.categorical(key, logits[:, -1] / temperature)
    return nxt, carry

  tokens = jnp.asarray(np.frombuffer(prompt, np.uint8).astype(np.int32))[None]
  logits, carry = model.apply({"params": params}, tokens[:, :-1])
  out = list(prompt)
  token = tokens[:, -1:]
  key = jax.random.key(seed)
  for _ in range(length):
    key, sub = jax.random.split(key)
    nxt, carry = step(token, carry, sub)
    out.append(int(nxt[0]))
    token = nxt[:, None].astype(jnp.int32)
  return bytes(out).decode("utf-8", errors="replace")


def make_steps(model: CharLM, optimizer):
  """The jitted train step `(params, opt_state, x, y, key) -> (params, opt_state,
  loss)` and the jitted evaluation loss `(params, x, y) -> loss` of `model`."""

  def loss_fn(params, x, y, key, deterministic):
    rngs = None if key is None else {"dropout": key}
    logits, _ = model.apply({"params": params}, x, deterministic=deterministic, rngs=rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def train_step(params, opt_state, x, y, key):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y, key, False)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  eval_loss = jax.jit(lambda p, x, y: loss_fn(p, x, y, None, True))
  return train_step, eval_loss


def _int_at_least(minimum: int, below: int | None = None):
  """An argparse type: an int no smaller than `minimum` (and smaller than
  `below`, where given)."""
  def parse(text: str) -> int:
    value = int(text)
    if value < minimum or (below is not None and value >= below):
      bound = "" if below is None else f" and below {below}"
      raise argparse.ArgumentTypeError(f"must be at least {minimum}{bound}, got {value}")
    return value
  parse.__name__ = "int"  # argparse names the type in "invalid int value"
  return parse


def _float_in(low: float, high: float, *, low_open: bool = False):
  """An argparse type: a float in `[low, high)`, or `(low, high)` when `low_open`
  (not NaN: a NaN learning rate trained to a NaN loss without a word)."""
  def parse(text: str) -> float:
    value = float(text)
    if not low <= value < high or (low_open and value == low):
      raise argparse.ArgumentTypeError(
          f"must be in {'(' if low_open else '['}{low:g}, {high:g}), got {value:g}")
    return value
  parse.__name__ = "float"
  return parse


def _directory(text: str) -> str:
  """An argparse type: a path that is a directory or not there yet, under a
  directory (checked before training, rather than failing in Orbax after it)."""
  if os.path.exists(text) and not os.path.isdir(text):
    raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
  above = os.path.dirname(os.path.abspath(text))
  while not os.path.exists(above):  # the nearest that exists, where it would be made
    above = os.path.dirname(above)
  if not os.path.isdir(above):
    raise argparse.ArgumentTypeError(f"{text} cannot be made: {above} is not a directory")
  return text


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jax_cudnn_rnn.demo", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=_int_at_least(0), default=600, help="training steps (default 600)")
  parser.add_argument("--batch", type=_int_at_least(1), default=32, help="sequences per step (default 32)")
  parser.add_argument("--seq-len", type=_int_at_least(1), default=64, help="characters per sequence (default 64)")
  parser.add_argument("--hidden", type=_int_at_least(1), default=128, help="LSTM units (default 128)")
  parser.add_argument("--layers", type=_int_at_least(1), default=2, help="LSTM layers (default 2)")
  parser.add_argument("--dropout", type=_float_in(0.0, 1.0), default=0.1, help="inter-layer dropout (default 0.1)")
  parser.add_argument("--lr", type=_float_in(0.0, float("inf"), low_open=True), default=3e-3, help="Adam learning rate (default 3e-3)")
  parser.add_argument("--data-bytes", type=_int_at_least(MIN_CORPUS_BYTES), default=2_000_000, help="corpus size (default 2e6)")
  parser.add_argument("--sample-len", type=_int_at_least(0), default=300, help="sampled characters (default 300)")
  parser.add_argument("--checkpoint-dir", type=_directory, default=None,
                      help="where to save (default: a temp dir)")
  # numpy's generator takes no negative seed, and JAX's key no seed past 64 bits
  parser.add_argument("--seed", type=_int_at_least(0, below=2**32), default=0)
  parser.add_argument("--quick", action="store_true", help="a few tiny steps (for tests)")
  args = parser.parse_args(argv)
  if args.quick:  # small settings, except those given explicitly
    quick = dict(steps=8, batch=8, seq_len=32, hidden=32, data_bytes=200_000, sample_len=40)
    for name, value in quick.items():
      if getattr(args, name) == parser.get_default(name):
        setattr(args, name, value)
  # The checkpoint is saved as step `steps` of an Orbax CheckpointManager, which
  # refuses a step it already holds: said now, not by Orbax after the training.
  if args.checkpoint_dir and (pathlib.Path(args.checkpoint_dir) / str(args.steps)).exists():
    parser.error(f"argument --checkpoint-dir: {args.checkpoint_dir} already holds step "
                 f"{args.steps} (a checkpoint of an earlier run of {args.steps} steps): "
                 "choose another directory, or remove that step")

  device = jax.devices()[0]
  print(f"jax {jax.__version__} on {device.platform} ({device.device_kind})")
  corpus = load_corpus(args.data_bytes)
  split = int(corpus.size * 0.95)
  train, valid = corpus[:split], corpus[split:]
  print(f"corpus: {corpus.size:,} bytes of Python standard library source")
  if valid.size < args.seq_len + 2:  # a window and its next byte, from the smaller split
    parser.error(f"argument --seq-len: {args.seq_len} does not fit the validation text "
                 f"({valid.size:,} bytes, 5% of the corpus): pass a shorter --seq-len or a "
                 "larger --data-bytes")

  model = CharLM(args.hidden, args.layers, args.dropout)
  key = jax.random.key(args.seed)
  init_tokens = jnp.zeros((args.batch, args.seq_len), jnp.int32)
  params = model.init(key, init_tokens)["params"]
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(args.lr))
  opt_state = optimizer.init(params)

  train_step, eval_loss = make_steps(model, optimizer)
  vx, vy = next(batches(valid, 64, args.seq_len, args.seed + 1))
  first_eval = float(eval_loss(params, vx, vy))
  print(f"validation loss before training: {first_eval:.3f} (uniform would be {np.log(VOCAB):.3f})")

  data = batches(train, args.batch, args.seq_len, args.seed)
  x, y = next(data)
  # Compiled once, ahead of time, so the compiled step itself says which RNN runs.
  compiled_step = train_step.lower(params, opt_state, x, y, key).compile()
  if _cudnn.in_compiled(compiled_step):
    print("RNN: cuDNN's fused kernels (custom calls in the compiled train step)")
  else:
    available, why = _cudnn.availability()
    print("RNN: the pure-JAX 'xla' path" + ("" if available else f" ({why})"))
  start, seen, loss = time.perf_counter(), 0, float("nan")
  for step in range(1, args.steps + 1):
    if step > 1:
      x, y = next(data)
    key, sub = jax.random.split(key)
    params, opt_state, loss = compiled_step(params, opt_state, x, y, sub)
    seen += x.size
    if step == 1:
      loss.block_until_ready()
      start, seen = time.perf_counter(), 0  # compile time is not throughput
    if step % 10 == 0 or step == args.steps:
      progress(step, args.steps, float(loss), seen / max(time.perf_counter() - start, 1e-9))
  print()
  final_eval = float(eval_loss(params, vx, vy))
  print(f"validation loss after {args.steps} steps: {final_eval:.3f} (was {first_eval:.3f})")

  spec = model.bind({"params": params}).rnn.spec(64)
  with tempfile.TemporaryDirectory() as tmp:
    ckpt_dir = pathlib.Path(args.checkpoint_dir or tmp).absolute()
    others = {"embed": params["embed"], "head": params["head"]}
    with ocp.CheckpointManager(ckpt_dir) as manager:
      manager.save(args.steps, args=ocp.args.Composite(
          lstm=checkpoint.RNNParamsSave(spec, params["rnn"]["opaque_params"]),
          others=ocp.args.StandardSave(others)), force=True)
      manager.wait_until_finished()
      restored = manager.restore(args.steps, args=ocp.args.Composite(
          lstm=checkpoint.RNNParamsRestore(spec), others=ocp.args.StandardRestore(others)))
    print(f"checkpoint saved to {ckpt_dir} (LSTM in canonical format) and restored")

    # Both sides in full float32: on a GPU the default precision lets XLA's dots
    # and cuDNN use TF32, whose rounding differs between the two (1.4e-3 on an H100).
    with jax.default_matmul_precision("highest"):
      ours, _ = model.apply({"params": params}, vx[:4])
      theirs = flax_cell_logits(restored.others, restored.lstm, spec, vx[:4])
    diff = float(jnp.max(jnp.abs(ours - theirs)))
    same = bool(jnp.all(jnp.argmax(ours, -1) == jnp.argmax(theirs, -1)))
    print(f"restored into flax.linen.OptimizedLSTMCell: max |logit difference| = {diff:.2e}, "
          f"same predictions: {same}")
  text = sample(model, params, b"def ", args.sample_len, 0.8, args.seed)
  print("sample:\n" + "-" * 60 + "\n" + text + "\n" + "-" * 60)
  if not same or diff > 1e-3:
    print("ERROR: the Flax cells disagree with the fused RNN", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
