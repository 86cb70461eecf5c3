"""The RNN's operations carry the spec's class name in XLA's programs.

`_ops._dispatch` runs every call, on either path, inside
`jax.named_scope(type(spec).__name__)`. So in a profile (`jax.profiler`,
TensorBoard, Perfetto) and in an HLO dump, the recurrence reads as
`jit(step)/jvp(CudnnLSTM)/while` and its derivative as
`jit(step)/transpose(jvp(CudnnLSTM))/...`, not as one more anonymous `while`
among the model's ops. These tests lower a training step and read the names
of its operations:
- the "xla" path's loops, on this CPU;
- the cuDNN calls, lowered for a CUDA device with the handler model's sizes
  (conftest's `sizes`);
- the caller's own operations after the call, which must not carry the name.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from helpers import SPEC_CLASSES, call


def _named_ops(lowered, opcodes) -> list[tuple[str, str, str]]:
  """`(opcode, op_name, line)` of each instruction of `opcodes` whose op_name
  starts at the `jit` (under jax 0.10, ops inside a loop's body name
  themselves relative to the loop; from 0.11 from the `jit` too)."""
  text = lowered.as_text(dialect="hlo", debug_info=True)
  found = []
  for line in text.splitlines():
    op = re.search(r" (%s)\(" % "|".join(map(re.escape, opcodes)), line)
    name = re.search(r'op_name="([^"]*)"', line)
    if op and name and name.group(1).startswith("jit("):
      found.append((op.group(1), name.group(1), line.strip()))
  return found


def _training_step(spec, implementation):
  def loss(params, x):
    y = call(spec, x, None, None, params, implementation=implementation)[0]
    with jax.named_scope("callers_own"):  # the caller's ops after the call
      return jnp.sum(jnp.exp(y))
  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _args(spec, steps=5, batch=2):
  x = jnp.ones((steps, batch, spec.input_size), spec.dtype)
  return spec.init_params(jax.random.key(0)), x


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_the_xla_paths_loops_are_named_for_the_spec(cls):
  spec = cls(2, 4, 3, direction="bidirectional", dtype=jnp.float32)
  name = cls.__name__
  lowered = _training_step(spec, "xla").lower(*_args(spec))
  ops = _named_ops(lowered, ("while", "exponential", "reduce"))
  loops = [n for op, n, _ in ops if op == "while"]
  assert loops, ops
  assert all(name in n for n in loops), loops
  # the forward's loops, and the derivative's (its transpose)
  assert any(f"jvp({name})" in n and "transpose" not in n for n in loops), loops
  assert any(f"transpose(jvp({name}))" in n for n in loops), loops
  # the scope ends with the call: the caller's later ops are not the RNN's
  mine = [n for _, n, _ in ops if "callers_own" in n]
  assert mine and not any(name in n for n in mine), mine


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_the_cudnn_calls_are_named_for_the_spec(sizes, cls):
  spec = cls(2, 4, 3, direction="bidirectional", dtype=jnp.float32)
  name = cls.__name__
  args = _args(spec)

  def cudnn_calls(f):
    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    ops = _named_ops(lowered, ("custom-call",))
    calls = {}
    for _, op_name, line in ops:
      target = re.search(r'custom_call_target="(jcr_\w+)"', line)
      if target:
        calls.setdefault(target.group(1), []).append(op_name)
    return calls

  train = cudnn_calls(jax.grad(lambda p, x: jnp.sum(jnp.tanh(
      call(spec, x, None, None, p, implementation="cudnn")[0])), argnums=(0, 1)))
  assert set(train) == {"jcr_rnn_forward_training", "jcr_rnn_backward_data",
                        "jcr_rnn_backward_weights"}, train
  assert all(f"jvp({name})" in n and "transpose" not in n
             for n in train["jcr_rnn_forward_training"]), train
  for target in ("jcr_rnn_backward_data", "jcr_rnn_backward_weights"):
    assert all(f"transpose(jvp({name}))" in n for n in train[target]), train
  infer = cudnn_calls(lambda p, x: call(spec, x, None, None, p, is_training=False,
                                        implementation="cudnn")[0])
  assert set(infer) == {"jcr_rnn_forward_inference"}, infer
  assert all(f"/{name}/" in n for n in infer["jcr_rnn_forward_inference"]), infer
