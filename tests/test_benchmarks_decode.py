"""`benchmarks/decode.py` runs end to end on one tiny shape per mode: on this CPU,
and in its GPU configuration with the handler model (`handler_model.py`)
standing in for cuDNN.

The timings mean nothing here. What is checked: every contender is timed in
each of its patterns (PyTorch, eager, has no jitted loop; its "step" and
"eager" are the same call), a peer that cannot
run is reported and left out, each contender decodes what ours decodes (the
same recurrence, so the same shapes through the loop), the table's
per-token figures and ratios are the JSON's, and `--sync-dispatch` sets JAX's
option (the suite's CPU client is kept) and says so in the files.
"""

import dataclasses
import json
import re

import jax
import jax.extend
import numpy as np
import pytest

from handler_model import HandlerModel
from helpers import assert_usage_error, has_torch, load_benchmark, on_a_cpu_host


@on_a_cpu_host
@pytest.mark.parametrize("as_gpu,sync,dtype,large", [(False, False, "float32", False),
                                                     (False, True, "float32", False),
                                                     (True, False, "float32", False),
                                                     (False, False, "bfloat16", False),
                                                     (True, False, "float32", True)],
                         ids=["cpu", "cpu-sync-dispatch", "gpu-with-handler-model",
                              "cpu-bfloat16", "gpu-with-handler-model-large"])
def test_decode_benchmark_runs_end_to_end(as_gpu, sync, dtype, large, tmp_path, monkeypatch,
                                          capsys):
  decode = load_benchmark("decode")
  tiny = [decode.Shape("lstm", 2, 3, 4, 2), decode.Shape("gru", 1, 3, 4, 1)]
  asked = []
  monkeypatch.setattr(decode, "shapes", lambda quick, large: asked.append(large) or tiny)
  # --sync-dispatch sets JAX's option and drops the clients made before; here
  # they are kept (the suite's arrays live on them), and the option restored.
  assert decode.async_dispatch() is jax.config.values[decode.ASYNC_DISPATCH] is True
  dropped = []
  monkeypatch.setattr(jax.extend.backend, "clear_backends", lambda: dropped.append(True))
  if as_gpu:
    model = HandlerModel().install(monkeypatch.setattr)
  try:
    assert decode.main(["--quick", "--repeats", "2", "--warmup", "1", "--steps", "3",
                        "--out-dir", str(tmp_path), "--machine", "test", "--dtype", dtype]
                       + (["--sync-dispatch"] if sync else []) + (["--large"] if large else [])
                       ) == 0
  finally:
    jax.config.update(decode.ASYNC_DISPATCH, True)
  assert dropped == ([True] if sync else [])
  printed = capsys.readouterr().out

  written = sorted(p.name for p in tmp_path.iterdir())
  assert len(written) == 2 and written[0].startswith("decode-test-"), written
  assert asked == [large]
  suffix = ("-quick" + ("-large" if large else "") + ("-sync" if sync else "")
            + ("-bfloat16" if dtype == "bfloat16" else ""))
  assert written[0].endswith(suffix + ".json") and written[1].endswith(suffix + ".md"), written
  record = json.loads((tmp_path / written[0]).read_text())
  assert record["steps"] == 3 and record["repeats"] == 2 and record["dtype"] == dtype
  assert record["large"] is large
  assert record["cpu_async_dispatch"] is (not sync)
  assert {"jax", "numpy", "cudnn", "commit"} <= set(record["versions"])
  patterns = ("loop", "step", "eager")
  timed = {(impl, pattern) for impl in ("ours-xla", "flax-cells") for pattern in patterns}
  if as_gpu:  # at these sizes "auto" gives a step the persistent algorithm: the standard beside
    timed |= {(impl, pattern) for impl in ("ours-cudnn", "ours-cudnn-standard")
              for pattern in patterns}
    assert model.algorithms == {"jcr_rnn_forward_inference": {0, 3}}, model.algorithms
  if has_torch() and not as_gpu:
    timed |= {("torch", "step"), ("torch", "eager")}
  if has_torch() and as_gpu:  # this CPU has no CUDA: reported, and the run goes on
    assert re.search(r"torch\s+skipped:", printed), printed
  tiny = [dataclasses.replace(shape, dtype=dtype) for shape in tiny]
  assert all(shape.name.endswith(" bfloat16") is (dtype == "bfloat16") for shape in tiny)
  for shape in tiny:
    results = {(r["impl"], r["pattern"]): r for r in record["results"]
               if r["shape"] == shape.name}
    assert set(results) == timed, sorted(results)
    for (impl, pattern), r in results.items():
      tokens = 3 if pattern == "loop" else 1
      assert r["tokens_per_call"] == tokens and r["repeats"] == 2
      assert r["per_token_s"] == pytest.approx(r["median_s"] / tokens)
      assert len(r["times_s"]) == 2 and min(r["times_s"]) <= r["median_s"] <= max(r["times_s"])

  # The table: per-token microseconds, ratios against ours-cudnn on a GPU, else ours-xla;
  # its lead-in says when the calls ran on the calling thread.
  table = (tmp_path / written[1]).read_text()
  assert ("--sync-dispatch" in table.split("## ")[0]) is sync
  ours = "ours-cudnn" if as_gpu else "ours-xla"
  for pattern in patterns:
    section = table.split(f"## {pattern}\n")[1].split("##")[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    peers = [c.strip()[:-len(" (us)")] for c in rows[0].strip("|").split("|")[2::2]]
    # On a GPU our "xla" path is a column of its own, compared with cuDNN.
    assert set(peers) == {i for i, p in timed if p == pattern} - {ours}
    for shape, row in zip(tiny, rows[2:]):
      cells = [c.strip() for c in row.strip("|").split("|")]
      assert cells[0] == shape.name
      results = {r["impl"]: r for r in record["results"]
                 if r["shape"] == shape.name and r["pattern"] == pattern}
      mine = results[ours]["per_token_s"]
      assert float(cells[1]) == pytest.approx(mine * 1e6, abs=0.06)
      for k, peer in enumerate(peers):
        ratio = results[peer]["per_token_s"] / mine
        assert float(cells[3 + 2 * k].rstrip("x")) == pytest.approx(ratio, abs=0.006)

  # The ratios paired round by round: a column per peer and pattern, each cell
  # opening with the median of the peer's timings over ours' of the same round.
  section = table.split("## each peer's time / ours, paired by round\n")[1].split("##")[0]
  rows = [line for line in section.splitlines() if line.startswith("|")]
  columns = [c.strip() for c in rows[0].strip("|").split("|")][1:]
  assert set(columns) == {f"{i} {p}" for i, p in timed if i != ours}, columns
  for shape, row in zip(tiny, rows[2:]):
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == shape.name
    for column, cell in zip(columns, cells[1:]):
      peer, pattern = column.split(" ")
      results = {r["impl"]: r for r in record["results"]
                 if r["shape"] == shape.name and r["pattern"] == pattern}
      ratios = np.array(results[peer]["times_s"]) / np.array(results[ours]["times_s"])
      assert cell.startswith(f"{np.median(ratios):.2f}x ["), (column, cell)


def test_large_shapes_lie_either_side_of_the_one_step_bound():
  """`--large` times models whose one-step calls `implementation=None` runs on
  either path (`_ops.one_step_on_xla`), so that a GPU run tests the bound."""
  from jax_cudnn_rnn import _ops
  decode = load_benchmark("decode")
  sides = [_ops.one_step_on_xla(shape.spec(), 1) for shape in decode.shapes(False, large=True)]
  assert True in sides and False in sides, sides
  assert not set(decode.shapes(False, large=True)) & set(decode.shapes(False))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_contenders_decode_the_same_recurrence_shapes(dtype):
  """Each JAX contender's loop returns the next input and the carried state with
  the shapes one step produces (a loop that dropped the state, or fed it back
  in the wrong shape, would not compile or would decode something else), and
  its eager step the values of its jitted one."""
  decode = load_benchmark("decode")
  shape = decode.Shape("lstm", 2, 3, 4, 2, dtype)
  for make in (lambda: decode.ours(shape, 3, "xla"), lambda: decode.flax_cells(shape, 3)):
    calls = make()
    x, state = calls["loop"]()
    assert x.shape == (2, 3) and x.dtype == dtype
    leaves = jax.tree.leaves(state)
    assert leaves and all(np.all(np.isfinite(leaf)) for leaf in leaves)
    assert {leaf.shape[-1] for leaf in leaves} == {4}
    assert {leaf.dtype for leaf in leaves} == {np.dtype(dtype)}
    # Without jit, one step is the jitted step.
    for got, want in zip(jax.tree.leaves(calls["eager"]()), jax.tree.leaves(calls["step"]())):
      np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                 rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], r"--steps must be at least 1, got 0"),  # was a ZeroDivisionError at the end
    (["--repeats", "-1"], r"--repeats must be at least 1, got -1"),  # was an IndexError
    (["--machine", "a/b"], r"--machine must be a name for the output files"),  # FileNotFoundError
])
def test_bad_arguments_are_usage_errors_before_anything_runs(capsys, argv, message):
  assert_usage_error(load_benchmark("decode").main, ["--quick"] + argv, message, capsys)
