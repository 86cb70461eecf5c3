"""`benchmarks/run.py` runs end to end on a one-shape grid: on this CPU, and in
its GPU configuration with the handler model (`handler_model.py`) standing in
for cuDNN, so that its GPU code (the cuDNN contender, the peers that need a GPU,
the table against `ours-cudnn`) first runs here and not on a lent GPU.

The timings mean nothing here. What is checked: every contender that can run
is timed in both phases, one that cannot is reported and left out (not
fatal), and the markdown table's ratios are the JSON's medians divided.
"""

import importlib.util
import json
import os
import pathlib
import re
import sys
import time

import jax
import numpy as np
import pytest

from handler_model import HandlerModel
from helpers import assert_usage_error, has_torch, load_benchmark, on_a_cpu_host

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _cudnn

ROOT = pathlib.Path(__file__).parent.parent
TINY = dict(mode="lstm", batch=2, seq_len=3, input_size=4, hidden=5, layers=2,
            bidirectional=True, dtype="float32")


def cudnn_contenders(shape) -> set:
  """Our cuDNN contenders on a GPU: both layouts, and, where the default is cuDNN's
  persistent small-h algorithm (`_cudnn.choose_algorithms`), the standard one beside it
  and the persistent one given batch-major data transposed around every call."""
  small_h = _cudnn.choose_algorithms(shape.spec(), has_seq_lengths=False) != (0, 0)
  return {"ours-cudnn", "ours-cudnn-time-major"} | (
      {"ours-cudnn-standard", "ours-cudnn-transposed"} if small_h else set())


@on_a_cpu_host
@pytest.mark.parametrize("as_gpu", [False, True], ids=["cpu", "gpu-with-handler-model"])
def test_benchmark_runs_end_to_end(as_gpu, tmp_path, monkeypatch, capsys):
  run = load_benchmark("run")
  shape = run.Shape(**TINY)
  monkeypatch.setattr(run, "grid", lambda quick, gpu: [shape])
  if as_gpu:
    model = HandlerModel().install(monkeypatch.setattr)
  assert run.main(["--quick", "--repeats", "2", "--warmup", "1",
                   "--out-dir", str(tmp_path), "--machine", "test-v0.1"]) == 0
  printed = capsys.readouterr().out
  if as_gpu:  # ours-cudnn-standard ran the standard algorithm, the others the persistent one
    assert all(algos == {0, 3} for algos in model.algorithms.values()), model.algorithms

  # A dot in the machine's name stays in the files' names (not taken for a suffix).
  written = sorted(p.name for p in tmp_path.iterdir())
  has_plot = importlib.util.find_spec("matplotlib") is not None
  stem = re.fullmatch(r"(test-v0\.1-\d{4}-\d\d-\d\d-quick)\.json", written[0])
  assert stem, written
  assert written == [f"{stem[1]}.{ext}" for ext in ("json", "md", "png")[:3 if has_plot else 2]]
  record = json.loads((tmp_path / written[0]).read_text())
  assert record["machine"] == "test-v0.1" and record["repeats"] == 2
  assert record["rounds"] == 2  # by default one timing per contender per round
  if importlib.util.find_spec("resource") is not None:  # each timed call's page faults
    assert all(len(r["minor_faults"]) == r["repeats"] for r in record["results"]), record
    assert "## page faults a call" in (tmp_path / f"{stem[1]}.md").read_text()
  if run.stolen_seconds() is not None:  # and the CPU time the hypervisor took meanwhile
    assert all(len(r["stolen_s"]) == r["repeats"] for r in record["results"]), record
  assert record["lead_in"] == 1  # each led in by an untimed call of its own
  # ... and by untimed calls for at least 30 ms on a CPU (PyTorch's threads spin on)
  assert record["lead_in_s"] == (0.0 if as_gpu else 0.03)
  assert {"jax", "numpy", "cudnn"} <= set(record["versions"])
  cpu = record["cpu"]  # which CPU: the lent machines differ (AVX2 on one, AVX-512 on another)
  assert isinstance(cpu["model"], str) and cpu["model"], cpu
  cpuinfo = pathlib.Path("/proc/cpuinfo")
  if cpuinfo.exists():
    flags = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags"))
    assert ("avx2" in cpu["isa"]) == (" avx2" in flags), (cpu, flags)
    assert ("avx512f" in cpu["isa"]) == (" avx512f" in flags), (cpu, flags)
    family = next((line.split(":")[1].strip() for line in cpuinfo.read_text().splitlines()
                   if line.startswith("cpu family")), None)
    assert cpu["family"] == family, (cpu, family)
  l2 = pathlib.Path("/sys/devices/system/cpu/cpu0/cache/index2/size")
  if l2.exists():
    assert cpu["l2_per_core"] == l2.read_text().strip(), cpu
  if not as_gpu:  # the table's heading names the CPU
    assert f"# RNN benchmarks on cpu:cpu ({cpu['model']}" in printed
    if cpu["family"]:  # "AMD EPYC" alone does not say which generation
      assert f"; family {cpu['family']}; model {cpu['model_number']}" in printed
  versions = record["versions"]
  if (ROOT / ".git").exists():  # provenance: the commit, and what differs from it
    assert re.fullmatch(r"[0-9a-f]{40}", versions["commit"]), versions
    assert isinstance(versions["uncommitted changes"], list), versions
  ours = "ours-cudnn" if as_gpu else "ours-xla"
  timed = {"ours-xla", "flax-scan"} | (cudnn_contenders(shape) if as_gpu else set())
  if has_torch() and not as_gpu:
    timed.add("torch")
  results = {(r["impl"], r["phase"]): r for r in record["results"]}
  assert set(results) == {(i, p) for i in timed for p in ("fwd", "fwd+bwd")}
  for (impl, _), r in results.items():
    assert r["median_s"] > 0 and r["repeats"] == 2 and r["shape"] == shape.name
    assert len(r["times_s"]) == 2 and r["median_s"] == pytest.approx(np.median(r["times_s"]))
    if impl != "torch":  # XLA's memory analysis, on any backend
      assert r["memory_bytes"] > 0, r
      assert 0 < r["compile_s"] < 600, r
    else:  # eager: nothing compiled ahead
      assert r["compile_s"] is None, r
  assert "compile" in record["compile_measure"]
  if as_gpu:  # this CPU has no CUDA: those peers are reported, and the run goes on
    assert re.search(r"jax\.experimental\.rnn\s+skipped:", printed), printed
    if has_torch():
      assert re.search(r"torch\s+skipped:", printed), printed

  # The table: against ours-cudnn on a GPU, where ours-xla is a column of its
  # own; against ours-xla elsewhere.
  table = (tmp_path / written[1]).read_text()
  peers = sorted(timed - {ours})
  for phase in ("fwd", "fwd+bwd"):
    section = table.split(f"## {phase}\n")[1].split("##")[0]
    header, _, row = [line for line in section.splitlines() if line.startswith("|")][:3]
    assert header == "| shape | ours (ms) | " + " | ".join(f"{p} (ms) | ratio" for p in peers) + " |"
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == shape.name
    mine = results[ours, phase]["median_s"]
    assert float(cells[1]) == pytest.approx(mine * 1e3, abs=0.006)
    for k, peer in enumerate(peers):
      ratio = results[peer, phase]["median_s"] / mine
      assert float(cells[3 + 2 * k].rstrip("x")) == pytest.approx(ratio, abs=0.006)

  # The ratios paired round by round: a column per peer and phase, each cell the
  # median of the peer's timings over ours' taken in the same round, and the quartiles.
  section = table.split("## each peer's time / ours, paired by round\n")[1].split("##")[0]
  header, _, row = [line for line in section.splitlines() if line.startswith("|")][:3]
  columns = [c.strip() for c in header.strip("|").split("|")][1:]
  assert columns == [f"{p} {phase}" for p in peers for phase in ("fwd", "fwd+bwd")], header
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[0] == shape.name
  for column, cell in zip(columns, cells[1:]):
    peer, phase = column.split(" ")
    ratios = (np.array(results[peer, phase]["times_s"])
              / np.array(results[ours, phase]["times_s"]))
    median, q1, q3 = (float(v) for v in re.fullmatch(r"(\S+)x \[(\S+)-(\S+)\]", cell).groups())
    assert median == pytest.approx(np.median(ratios), abs=0.006), (column, cell)
    assert (q1, q3) == pytest.approx(tuple(np.percentile(ratios, [25, 75])), abs=0.006)

  # The compile times: a column per JAX contender (not PyTorch), "fwd / fwd+bwd" seconds.
  section = table.split("## compile time, fwd / fwd+bwd (s)\n")[1].split("##")[0]
  header, _, row = [line for line in section.splitlines() if line.startswith("|")][:3]
  compiled = [c.strip() for c in header.strip("|").split("|")][1:]
  assert set(compiled) == timed - {"torch"}, header
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[0] == shape.name
  for impl, cell in zip(compiled, cells[1:]):
    fwd_s, bwd_s = (float(v) for v in cell.split(" / "))
    assert fwd_s == pytest.approx(results[impl, "fwd"]["compile_s"], abs=0.006)
    assert bwd_s == pytest.approx(results[impl, "fwd+bwd"]["compile_s"], abs=0.006)


@pytest.mark.parametrize("rounds, lead_in, order", [
    (3, 0, ["a", "b", "a", "b", "a", "b"]),   # one call each a round: fully interleaved
    (1, 0, ["a", "a", "a", "b", "b", "b"]),
    (3, 1, ["a", "a", "b", "b"] * 3),        # each timed call led in by an untimed one
    (1, 2, ["a"] * 5 + ["b"] * 5),
])
def test_timing_rounds_interleave_the_contenders(rounds, lead_in, order):
  run = load_benchmark("run")
  calls = []
  fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
  timed = run._time_interleaved(fns, repeats=3, warmup=1, rounds=rounds, lead_in=lead_in,
                                lead_in_s=0)
  assert calls[:2] == ["a", "b"]  # the warm-up calls
  assert calls[2:] == order
  assert all(timed[name]["repeats"] == 3 for name in fns)


@pytest.mark.skipif(importlib.util.find_spec("resource") is None, reason="no getrusage")
def test_timings_count_each_calls_page_faults():
  """Each timed call's minor page faults are kept beside its time: a contender
  that writes 64 MiB of freshly mapped memory every call (as XLA:CPU's buffers
  over glibc's 32 MiB threshold are) faults on every page of it, one that
  reuses its buffer does not."""
  run = load_benchmark("run")
  pages = 64 * 2**20 // 4096
  kept = np.zeros(64 * 2**20, np.uint8)

  def fresh():
    np.ones(64 * 2**20, np.uint8)  # mmap-ed anew (over glibc's threshold), written, freed

  def reused():
    kept.fill(1)

  timed = run._time_interleaved({"fresh": fresh, "reused": reused}, repeats=4, warmup=1,
                                rounds=2, lead_in=0)
  assert len(timed["fresh"]["minor_faults"]) == 4
  # At least one a 2 MiB page: numpy asks for transparent huge pages (here: 544 faults).
  assert all(f >= pages // 512 for f in timed["fresh"]["minor_faults"]), timed["fresh"]
  assert all(f < pages // 1000 for f in timed["reused"]["minor_faults"]), timed["reused"]


def test_stolen_seconds_reads_the_steal_field_of_proc_stat(tmp_path):
  run = load_benchmark("run")
  stat = tmp_path / "stat"
  stat.write_text("cpu  70470 0 7240 131408 448 0 285 34826 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
  assert run.stolen_seconds(str(stat)) == pytest.approx(34826 / os.sysconf("SC_CLK_TCK"))
  stat.write_text("cpu  70470 0 7240 131408\n")  # a kernel without the field
  assert run.stolen_seconds(str(stat)) is None
  assert run.stolen_seconds(str(tmp_path / "missing")) is None
  if pathlib.Path("/proc/stat").exists():  # this machine's: a count that never goes back
    first = run.stolen_seconds()
    assert first is not None and 0 <= first <= run.stolen_seconds()


def test_timings_keep_the_cpu_time_stolen_during_each_call(monkeypatch):
  """Each timed call's steal time is the counter's rise over that call alone,
  and the tables show it as a share of the timed calls' CPU time."""
  run = load_benchmark("run")
  clock = {"stolen": 100.0}
  def stolen_seconds():  # the hypervisor takes 5 ms between any two readings
    clock["stolen"] += 0.005
    return clock["stolen"]
  monkeypatch.setattr(run, "stolen_seconds", stolen_seconds)
  timed = run._time_interleaved({"a": lambda: time.sleep(0.02), "b": lambda: None},
                                repeats=4, warmup=1, rounds=2, lead_in=0)
  assert timed["a"]["stolen_s"] == pytest.approx([0.005] * 4)
  a = dict(timed["a"], shape="s", impl="a", phase="fwd")
  expected = 100 * 0.02 / (sum(a["times_s"]) * 2)  # 4 calls of 5 ms, on 2 CPUs
  assert 8 < expected <= 12.5  # sleeps of at least 20 ms
  assert run.stolen_percent(a, 2) == pytest.approx(expected)
  table = "\n".join(run.stolen_table([a], cpus=2))
  assert "## CPU time stolen by the hypervisor, fwd / fwd+bwd (%)" in table
  assert f"| s | {expected:.1f} / — |" in table, table
  # Nothing stolen, or nothing recorded: no table.
  assert run.stolen_table([dict(a, stolen_s=[0.0] * 4)], cpus=2) == []
  assert run.stolen_table([dict(a, stolen_s=None)], cpus=2) == []


@pytest.mark.parametrize("lead_in", [0, 1])
def test_lead_in_keeps_a_predecessors_slowdown_out_of_the_timings(lead_in):
  # "a" is slow right after a call of "b" (as a JAX call is right after PyTorch's on a
  # small CPU); with a lead-in, only untimed calls of "a" pay for that.
  run = load_benchmark("run")
  last = {"name": None}
  def make(name, penalty_s):
    def call():
      if last["name"] not in (None, name):
        time.sleep(penalty_s)
      last["name"] = name
    return call
  timed = run._time_interleaved({"a": make("a", 0.03), "b": make("b", 0.0)},
                                repeats=5, warmup=1, rounds=5, lead_in=lead_in)
  if lead_in:
    assert timed["a"]["median_s"] < 0.01, timed
  else:
    assert timed["a"]["median_s"] >= 0.03, timed
  # Each timing is kept: here every one of "a"'s pays the penalty or none does.
  assert len(timed["a"]["times_s"]) == 5
  assert all((t >= 0.03) != bool(lead_in) for t in timed["a"]["times_s"]), timed


class FakeClock:
  """`time.perf_counter` for `run`, advanced only by the calls being timed: the
  lead-in tests below then run the same on a loaded machine as on an idle one."""

  def __init__(self):
    self.now = 0.0

  def perf_counter(self):
    return self.now


def test_lead_in_lasts_its_least_time(monkeypatch):
  # Untimed calls of 5 ms led in for at least 22 ms: five a round (the fifth ends
  # past 22 ms), whatever the count asked for below that; none with `lead_in` 0.
  run = load_benchmark("run")
  clock = FakeClock()
  monkeypatch.setattr(run, "time", clock)
  calls = []
  def call():
    calls.append(clock.now)
    clock.now += 0.005
  for lead_in, per_round in ((1, 5), (2, 5), (7, 7), (0, 0)):
    calls.clear()
    timed = run._time_interleaved({"a": call}, repeats=3, warmup=1, rounds=3, lead_in=lead_in,
                                  lead_in_s=0.022)
    assert len(calls) == 1 + 3 * (per_round + 1), (lead_in, len(calls))
    assert timed["a"]["times_s"] == pytest.approx([0.005] * 3)


def test_a_lead_in_of_some_time_outlasts_a_predecessors_spinning_threads(monkeypatch):
  # "a" takes 4 ms for 20 ms after a call of "b", else 0.1 ms (PyTorch's OpenMP threads
  # spin on after its call, session 44): led in by one call of its own, its timed call
  # is slow too; led in for 30 ms, it is not.
  run = load_benchmark("run")
  clock = FakeClock()
  monkeypatch.setattr(run, "time", clock)
  slow_until = {"t": -1.0}
  def a():
    clock.now += 0.004 if clock.now < slow_until["t"] else 0.0001
  def b():
    slow_until["t"] = clock.now + 0.02
    clock.now += 0.0001
  for lead_in_s, expected in ((0.0, 0.004), (0.03, 0.0001)):
    timed = run._time_interleaved({"a": a, "b": b}, repeats=5, warmup=1, rounds=5,
                                  lead_in=1, lead_in_s=lead_in_s)
    assert timed["a"]["times_s"] == pytest.approx([expected] * 5), (lead_in_s, timed)


def test_a_failing_contender_is_reported_and_the_others_timed():
  run = load_benchmark("run")
  def broken():
    raise RuntimeError("no such kernel")
  timed = run._time_interleaved({"ok": lambda: None, "broken": broken},
                                repeats=2, warmup=1, rounds=2)
  assert timed["broken"] == {"error": "RuntimeError: no such kernel"}
  assert timed["ok"]["repeats"] == 2 and timed["ok"]["median_s"] >= 0


def test_a_contender_failing_after_its_warm_up_is_reported_and_the_others_timed():
  run = load_benchmark("run")
  calls = {"n": 0}
  def fails_on_third_call():  # the warm-up and one timed call pass, then it fails
    calls["n"] += 1
    if calls["n"] == 3:
      raise MemoryError("out of device memory")
  timed = run._time_interleaved({"ok": lambda: None, "flaky": fails_on_third_call},
                                repeats=4, warmup=1, rounds=4)
  assert timed["flaky"] == {"error": "MemoryError: out of device memory"}
  assert calls["n"] == 3  # not called again once it failed
  assert timed["ok"]["repeats"] == 4


def test_each_shape_is_written_as_it_finishes_and_a_budget_stops_new_shapes(tmp_path, monkeypatch):
  # A lent GPU's command is stopped at its limit: what was measured before must be on disk.
  run = load_benchmark("run")
  first, second = run.Shape(**TINY), run.Shape(**dict(TINY, mode="gru"))
  monkeypatch.setattr(run, "grid", lambda quick, gpu: [first, second])
  timed = run._time_interleaved
  def stopped_on_the_second_shape(fns, *args, **kwargs):
    if stopped_on_the_second_shape.calls == 1:
      raise KeyboardInterrupt  # as a kill at the command's limit would stop it
    stopped_on_the_second_shape.calls += 1
    return timed(fns, *args, **kwargs)
  stopped_on_the_second_shape.calls = 0
  monkeypatch.setattr(run, "_time_interleaved", stopped_on_the_second_shape)
  args = ["--quick", "--repeats", "1", "--warmup", "1", "--only", "ours-xla",
          "--out-dir", str(tmp_path), "--machine", "m"]
  with pytest.raises(KeyboardInterrupt):
    run.main(args)
  record = json.loads(next(tmp_path.glob("m-*-quick.json")).read_text())
  assert {(r["shape"], r["phase"]) for r in record["results"]} == {
      (first.name, "fwd"), (first.name, "fwd+bwd")}
  assert first.name in next(tmp_path.glob("m-*-quick.md")).read_text()
  assert "cut_short" not in record

  # A budget already spent: no shape starts, the record says so.
  monkeypatch.setattr(run, "_time_interleaved", timed)
  assert run.main(args + ["--budget-s", "0"]) == 0
  record = json.loads(next(tmp_path.glob("m-*-quick.json")).read_text())
  assert record["results"] == [] and record["cut_short"] == "--budget-s 0: 2 shapes not run"
  # Nothing to plot: no figure (with matplotlib installed, this divided by zero).
  assert run.plot([], tmp_path / "empty.png", "cpu") is False
  assert not (tmp_path / "empty.png").exists()


def test_plot_draws_a_recorded_run_beside_its_record(tmp_path, monkeypatch, capsys):
  # Runs made without matplotlib (sessions 58-59's) wrote no PNG; `--plot` draws one
  # from the JSON alone, timing nothing.
  run = load_benchmark("run")
  monkeypatch.setattr(run, "_time_interleaved", lambda *a, **k: pytest.fail("timed"))
  results = [{"shape": s, "impl": i, "phase": p, "median_s": ms / 1e3}
             for s, ms0 in (("lstm B8", 1.0), ("gru B8", 2.0))
             for i, ms in (("ours-xla", ms0), ("flax-scan", 1.5 * ms0))
             for p in ("fwd", "fwd+bwd")]
  record = {"device": "cpu:cpu", "machine": "m", "cpu_count": 2, "cores": [0],
            "cpu": {"model": "Some CPU"}, "results": results}
  (tmp_path / "m-2026-11-29.json").write_text(json.dumps(record))
  assert run.main(["--plot", str(tmp_path / "m-2026-11-29.json")]) == 0
  assert (tmp_path / "m-2026-11-29.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert f"wrote {tmp_path / 'm-2026-11-29.png'}" in capsys.readouterr().out
  # The titles name the CPU, and the cores of a run on fewer than the machine has.
  assert run.plot_label(record) == "cpu:cpu (Some CPU, 1 of 2 cores)"
  assert run.plot_label(dict(record, cores=[0, 1])) == "cpu:cpu (Some CPU)"
  assert run.plot_label(dict(record, device="cuda:NVIDIA H200")) == "cuda:NVIDIA H200"

  # What is not a run's record is refused, by name, and nothing is drawn for it.
  decode_record = dict(record, results=[{"shape": "lstm B1", "impl": "ours-xla",
                                         "pattern": "step", "median_s": 1e-4}])
  (tmp_path / "decode.json").write_text(json.dumps(decode_record))
  (tmp_path / "empty.json").write_text(json.dumps(dict(record, results=[])))
  (tmp_path / "broken.json").write_text("{")
  (tmp_path / "table.md").write_text("|")
  for name, reason in (("decode.json", "decode.py's records have no phase"),
                       ("empty.json", "holds no results to plot"),
                       ("broken.json", "Expecting property name"),
                       ("table.md", "expected a run's .json record, got"),
                       ("absent.json", "No such file or directory")):
    assert run.main(["--plot", str(tmp_path / name)]) == 1, name
    assert reason in capsys.readouterr().err, name
    assert not (tmp_path / name).with_suffix(".png").exists(), name
  # One bad file among good ones: the good are drawn, the status says one failed.
  (tmp_path / "m-2026-11-29.png").unlink()
  assert run.main(["--plot", str(tmp_path / "decode.json"),
                   str(tmp_path / "m-2026-11-29.json")]) == 1
  assert (tmp_path / "m-2026-11-29.png").exists()

  # Without matplotlib: said, no file, a failing status.
  (tmp_path / "m-2026-11-29.png").unlink()
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
  assert run.main(["--plot", str(tmp_path / "m-2026-11-29.json")]) == 1
  assert "matplotlib is not installed" in capsys.readouterr().err
  assert not (tmp_path / "m-2026-11-29.png").exists()


def test_a_shape_names_a_cell_the_benchmarks_time():
  # Any mode but "lstm" once timed a GRU (ours and the peers alike), so an RNN-tanh
  # shape measured a GRU under the RNN-tanh's name.
  run, decode = load_benchmark("run"), load_benchmark("decode")
  assert type(run.Shape(**TINY).spec()) is jcr.CudnnLSTM
  assert type(run.Shape(**dict(TINY, mode="gru")).spec()) is jcr.CudnnGRU
  assert type(decode.Shape("gru", 1, 8, 16, 1).spec()) is jcr.CudnnGRU
  for make in (lambda: run.Shape(**dict(TINY, mode="rnn_tanh")),
               lambda: decode.Shape("rnn_tanh", 1, 8, 16, 1)):
    with pytest.raises(ValueError, match=r"mode: expected one of \['gru', 'lstm'\], got 'rnn_tanh'"):
      make()


def test_a_shape_where_ours_failed_shows_no_other_figure_as_ours():
  # On a GPU, a shape where ours-cudnn failed must not show ours-xla's time as ours
  # (it did once: every cuDNN call failed, and the table compared the "xla" path).
  run = load_benchmark("run")
  def result(shape, impl, ms):
    return {"shape": shape, "impl": impl, "phase": "fwd", "median_s": ms / 1e3}
  results = [result("a", "ours-xla", 1.0), result("a", "ours-cudnn", 2.0),
             result("a", "torch", 3.0), result("b", "ours-xla", 1.0), result("b", "torch", 4.0)]
  assert run.ours_of(results) == "ours-cudnn"
  assert run.ours_of([r for r in results if r["impl"] != "ours-cudnn"]) == "ours-xla"
  lines = run.ratio_table(results, "ours-cudnn", ["ours-xla", "torch"], "median_s", "ms", 1e3, 2)
  assert lines[0] == "| shape | ours (ms) | ours-xla (ms) | ratio | torch (ms) | ratio |"
  assert lines[2] == "| a | 2.00 | 1.00 | 0.50x | 3.00 | 1.50x |"
  assert lines[3] == "| b | — | 1.00 | — | 4.00 | — |"
  assert "Ours = `ours-cudnn`:" in run.markdown(results, "gpu:test")


def test_paired_ratios_divide_the_timings_of_one_round():
  # Hand-computed: a machine that slowed down in the second round slowed both sides
  # there, so each round's ratio is 2. Timings of unequal count (another run's, say)
  # pair nothing.
  run = load_benchmark("run")
  mine = {"times_s": [1.0, 4.0, 2.0]}
  assert run.paired_ratios(mine, {"times_s": [2.0, 8.0, 4.0]}).tolist() == [2.0, 2.0, 2.0]
  assert run.paired_ratios(mine, {"times_s": [3.0, 2.0, 1.0]}).tolist() == [3.0, 0.5, 0.5]
  assert run.paired_ratios(mine, {"times_s": [1.0, 2.0]}) is None
  assert run.paired_ratios(mine, {"median_s": 1.0}) is None
  assert run.paired_ratios(None, mine) is None

  def result(shape, impl, phase, times):
    return {"shape": shape, "impl": impl, "phase": phase, "times_s": times,
            "median_s": float(np.median(times))}
  results = [result("a", "ours-xla", "fwd", [1.0, 2.0, 4.0, 1.0]),
             result("a", "flax-scan", "fwd", [2.0, 1.0, 4.0, 3.0]),  # 2, 0.5, 1, 3
             result("a", "ours-xla", "fwd+bwd", [1.0, 1.0, 1.0, 1.0]),
             result("b", "ours-xla", "fwd", [1.0, 1.0]),
             result("b", "torch", "fwd", [1.5, 2.5])]  # 1.5, 2.5
  lines = run.paired_table(results, "ours-xla")
  assert lines[0] == "## each peer's time / ours, paired by round"
  # No pair has a fwd+bwd timing: no column for it; a shape without the peer: "—".
  assert lines[4] == "| shape | flax-scan fwd | torch fwd |"
  # Quartiles by linear interpolation (numpy's): of 0.5, 1, 2, 3 they are 0.875 and 2.25.
  assert lines[6] == "| a | 1.50x [0.88-2.25] | — |"
  assert lines[7] == "| b | — | 2.00x [1.75-2.25] |"
  assert run.paired_table([r for r in results if r["impl"] == "ours-xla"], "ours-xla") == []


@on_a_cpu_host
@pytest.mark.parametrize("mode", ["lstm", "gru"])
@pytest.mark.parametrize("as_gpu", [False, True], ids=["cpu", "gpu-with-handler-model"])
def test_profile_script_reports_every_contender(as_gpu, mode, tmp_path, monkeypatch, capsys):
  # benchmarks/profile_gpu.py is for a lent GPU; here it must run through, so that the
  # GPU's minutes go to its answers. No CUDA here: it records no kernels.
  pytest.importorskip("torch")
  profile = load_benchmark("profile_gpu")
  if as_gpu:
    HandlerModel().install(monkeypatch.setattr)
  # A GRU has no `jax.experimental.rnn` contender (it has only the LSTM): on a GPU,
  # session 45's profile of a GRU stopped there.
  shape = f"{mode},2,3,4,5,2,bi,float32"
  # The backend is up already: XLA_FLAGS set now only has to be recorded.
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  assert profile.main(["--shape", shape, "--calls", "2", "--out-dir", str(tmp_path),
                       "--machine", "m", "--tag", "t"]) == 0
  [written] = tmp_path.iterdir()
  assert re.fullmatch(rf"profile-m-{mode}-B2-T3-I4-H5-L2-bi-float32-t-\d{{4}}-\d\d-\d\d\.md",
                      written.name)
  text = written.read_text()
  assert "`XLA_FLAGS=--xla_gpu_enable_command_buffer=`" in text
  assert f"jax {jax.__version__}" in text and "commit " in text, text[:400]
  rows, failed = {}, set()
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if len(cells) == 5 and cells[1] in ("fwd", "fwd+bwd"):
      if cells[2].startswith("failed: "):
        failed.add(cells[0])
      else:
        rows[cells[0], cells[1]] = cells[2:]
  # In its GPU configuration, the peers that need CUDA cannot run on this CPU:
  # reported, not fatal.
  timed = {"ours-xla", "flax-scan"} | (
      cudnn_contenders(profile.parse_shape(shape)) if as_gpu
      else {"torch"})
  assert set(rows) == {(i, p) for i in timed for p in ("fwd", "fwd+bwd")}, rows
  assert failed == ({"torch"} | ({"jax.experimental.rnn"} if mode == "lstm" else set())
                    if as_gpu else set())
  for (impl, phase), (wall, kernel_us, kernels) in rows.items():
    assert float(wall) > 0 and float(kernel_us) == 0 and float(kernels) == 0, (impl, phase)
  with pytest.raises(SystemExit):
    profile.main(["--shape", "lstm,2,3"])
  assert "--shape: expected mode,batch,seq_len,input_size,hidden,layers,uni|bi,dtype" in (
      capsys.readouterr().err)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_a_run_on_fewer_cores_runs_in_a_process_confined_to_them(tmp_path):
  """`--cores 1`: the run goes on in a process of its own, confined to the first core
  this one may use from its start (so JAX's thread pools are sized for one core), whose
  record and default machine name say so; `--cores` is not passed on. The budget stops
  it before its first shape: its start-up (JAX's backend, a first compilation) is what
  is checked here, the timings elsewhere."""
  run = load_benchmark("run")
  first = sorted(os.sched_getaffinity(0))[0]
  before = sorted(os.sched_getaffinity(0))
  assert run.main(["--quick", "--cores=1", "--budget-s", "0", "--out-dir", str(tmp_path),
                   "--only", "ours-xla"]) == 0
  assert sorted(os.sched_getaffinity(0)) == before  # this process is left as it was
  (written,) = tmp_path.glob("*.json")
  record = json.loads(written.read_text())
  assert record["cores"] == [first], record["cores"]
  assert record["results"] == [] and "cut_short" in record, record
  if _cudnn.availability()[0]:  # a GPU run (as run.py tells one) is named for its GPU alone
    assert record["machine"].startswith("gpu-"), record["machine"]
    return
  assert record["machine"].startswith("cpu-1core"), record["machine"]
  (table,) = tmp_path.glob("*.md")  # its heading says on how many cores it ran
  heading = table.read_text().splitlines()[0]
  assert (f"; on 1 of its {os.cpu_count()} cores)" in heading) == (os.cpu_count() > 1), heading


def test_cores_out_of_range_is_refused():
  run = load_benchmark("run")
  usable = len(run.usable_cores())
  for bad in (0, usable + 1):
    with pytest.raises(ValueError, match=rf"--cores must be between 1 and {usable}.*got {bad}"):
      run.main(["--quick", "--cores", str(bad)])


def test_sweep_times_its_own_shapes_and_says_so(tmp_path, monkeypatch):
  """`--sweep` times `run.sweep()`'s shapes, not the grid's: one layer of each
  cell and dtype over `SWEEP_HIDDEN`, input size the hidden size, float32 first;
  its files end in -sweep and its record says so."""
  run = load_benchmark("run")
  shapes = run.sweep()
  assert [(s.mode, s.hidden, s.dtype) for s in shapes] == [
      (mode, hidden, dtype) for dtype in ("float32", "bfloat16") for mode in ("lstm", "gru")
      for hidden in run.SWEEP_HIDDEN]
  assert all(s.layers == 1 and not s.bidirectional and s.input_size == s.hidden
             for s in shapes)
  tiny = run.Shape(**dict(TINY, layers=1, bidirectional=False))
  monkeypatch.setattr(run, "sweep", lambda: [tiny])
  monkeypatch.setattr(run, "grid", lambda quick, gpu: pytest.fail("the grid was asked for"))
  assert run.main(["--sweep", "--repeats", "1", "--warmup", "1", "--only", "ours-xla",
                   "--out-dir", str(tmp_path), "--machine", "m"]) == 0
  record = json.loads(next(tmp_path.glob("m-*-sweep.json")).read_text())
  assert record["sweep"] is True
  assert {(r["shape"], r["impl"], r["phase"]) for r in record["results"]} == {
      (tiny.name, "ours-xla", "fwd"), (tiny.name, "ours-xla", "fwd+bwd")}


@pytest.mark.parametrize("argv,message", [
    (["--repeats", "0"], r"--repeats must be at least 1, got 0"),  # was the default (`or`)
    (["--repeats", "-1"], r"--repeats must be at least 1, got -1"),  # was an IndexError
    (["--rounds", "0"], r"--rounds must be at least 1, got 0"),
    (["--lead-in-ms", "inf"], r"--lead-in-ms must be a finite number of milliseconds, at least "
                              r"0, got inf"),  # was a round that never ended
    (["--lead-in-ms", "-1"], r"--lead-in-ms must be .*, got -1"),
    (["--lead-in-ms", "nan"], r"--lead-in-ms must be .*, got nan"),
    (["--only", "ours-xla,flaxscan"], r"--only names no contender \['flaxscan'\]: choose from "
                                      r"ours-xla, flax-scan,"),  # was a run timing nothing
    (["--out-dir", __file__], r"--out-dir \S+ exists and is not a directory"),
    (["--out-dir", f"{__file__}/a"], r"--out-dir \S+/a cannot be made: \S+test_benchmarks.py is not "
                                     r"a directory"),  # was a NotADirectoryError
    (["--machine", "a/b"], r"--machine must be a name for the output files"),
])
def test_bad_arguments_are_usage_errors_before_anything_runs(capsys, argv, message):
  assert_usage_error(load_benchmark("run").main, ["--quick"] + argv, message, capsys)


@pytest.mark.parametrize("argv,message", [
    (["--calls", "0"], "--calls must be at least 1, got 0"),
    # each of these failed on the GPU machine, after its start, or after the profiling
    (["--tag", "a/b"], r"--tag must be part of a file name, without '/', got 'a/b'"),
    (["--shape", "lstm,8,32,64,128,1,uni,float16"], r"argument --shape: expected mode,batch,"
     r".*dtype float32 or bfloat16\), got 'lstm,8,32,64,128,1,uni,float16'"),
    (["--shape", "gru,0,32,64,128,1,bi,float32"], r"argument --shape: .*sizes positive integers"),
    (["--shape", "gru,8,32,64,1.5,1,bi,float32"], r"argument --shape: .*sizes positive integers"),
    (["--shape", "rnn,8,32,64,128,1,bi,float32"], r"argument --shape: .*mode lstm or gru"),
])
def test_profile_gpu_checks_its_arguments_as_run_does(capsys, argv, message):
  assert_usage_error(load_benchmark("profile_gpu").main, argv, message, capsys)


def test_contender_names_are_those_only_accepts():
  run = load_benchmark("run")
  given = set()
  for gpu in (False, True):  # (the contenders are only named here: nothing runs)
    for shape in run.grid(quick=False, gpu=gpu) + run.sweep():
      given |= set(run.contenders(shape, gpu, have_torch=True))
  assert given == set(run.CONTENDER_NAMES)
