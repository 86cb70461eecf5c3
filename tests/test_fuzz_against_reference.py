"""`fuzz_against_reference.py`, the by-hand fuzz: its draws stay within their
bounds, a small case of each check passes, and a broken call is caught."""

import collections
import dataclasses
import random

import jax
import pytest

import fuzz_against_reference as fuzz
from helpers import assert_usage_error, call, on_a_cpu_host

SMALL = fuzz.Case(mode="lstm", layers=2, direction="bidirectional", input_mode="linear_input",
                  inputs=5, hidden=6, steps=4, batch=3, dtype="float32", time_major=True,
                  lengths=True, dropout=0.0, check="grad")


def test_draws_stay_within_bounds():
  for implementation in ("xla", "cudnn"):
    rng = random.Random(0)
    cases = [fuzz.draw(rng, implementation) for _ in range(400)]
    checks = collections.Counter(c.check for c in cases)
    want = {"grad", "vmap", "decode"} | ({"jvp", "hvp"} if implementation == "xla" else set())
    assert set(checks) == want, checks
    assert {c.dtype for c in cases} == set(fuzz.DTYPES), collections.Counter(
        c.dtype for c in cases)
    for c in cases:
      c.spec()  # a valid configuration
      assert 1 <= c.steps <= 100 and 1 <= c.batch <= 64
      work = c.hidden * max(c.inputs, c.hidden) * c.batch * c.steps
      assert c.steps == 1 or work <= (4e6 if c.check == "hvp" else 3e7), c
      if c.check == "decode":
        assert c.steps == 1 and c.time_major and c.dropout == 0, c
      assert c.dropout == 0 or c.layers > 1, c


def test_one_step_draws():
  """`--one-step`: every call one step of one to three sequences, no
  decoder's loop, one sequence in about half of them; the rest drawn as
  before."""
  for implementation in ("xla", "cudnn"):
    rng = random.Random(1)
    cases = [fuzz.draw(rng, implementation, one_step=True) for _ in range(200)]
    assert {(c.steps, c.check == "decode") for c in cases} == {(1, False)}
    batches = collections.Counter(c.batch for c in cases)
    assert set(batches) == {1, 2, 3} and 70 <= batches[1] <= 130, batches
    assert {c.dtype for c in cases} == set(fuzz.DTYPES)
    for c in cases:
      c.spec()


@pytest.mark.parametrize("case", [
    SMALL,
    dataclasses.replace(SMALL, mode="gru", check="jvp", time_major=False),
    dataclasses.replace(SMALL, mode="rnn_tanh", check="hvp", dropout=0.3),
    dataclasses.replace(SMALL, mode="rnn_relu", check="vmap", direction="unidirectional"),
    dataclasses.replace(SMALL, mode="gru", check="decode", steps=1, lengths=False),
    dataclasses.replace(SMALL, check="decode", steps=1, dtype="bfloat16"),
    dataclasses.replace(SMALL, mode="gru", dtype="float16"),
    dataclasses.replace(SMALL, check="jvp", dtype="float16", time_major=False),
    dataclasses.replace(SMALL, dtype="float64", dropout=0.3),
    dataclasses.replace(SMALL, mode="rnn_tanh", check="jvp", dtype="float64"),
], ids=str)
def test_small_case_matches_reference(case):
  found = fuzz.errors(case, seed=1)
  assert set(found) >= {"out"} and len(found) >= 2, found
  assert fuzz.verdict(case, "xla", found) == "ok", found


def test_broken_values_and_gradients_are_caught():
  def scaled_output(spec, x, h0, c0, params, **options):
    y, h, c = call(spec, x, h0, c0, params, **options)
    return y * 1.001, h, c

  def no_state_gradient(spec, x, h0, c0, params, **options):
    return call(spec, x, jax.lax.stop_gradient(h0), c0, params, **options)

  case = dataclasses.replace(SMALL, layers=1, direction="unidirectional")
  found = fuzz.errors(case, seed=1, call=scaled_output)
  assert found["out"] > 1e-4 and fuzz.verdict(case, "xla", found) == "BAD", found
  # Out of tolerance, so judged against the float64 reference, which the
  # float32 one meets.
  assert found["out-f64"] > 1e-4 and found["ref-out-f64"] < 1e-5, found
  # With dropout too: the float64 reference drops the same units.
  dropped = dataclasses.replace(SMALL, dropout=0.3, direction="unidirectional")
  found = fuzz.errors(dropped, seed=1, call=scaled_output)
  assert found["out-f64"] > 1e-4 and found["ref-out-f64"] < 1e-5, found
  assert found["ref-grad-f64"] < 1e-5, found
  found = fuzz.errors(case, seed=1, call=no_state_gradient)
  assert found["out"] < 1e-6 and found["grad"] > 0.1, found
  assert fuzz.verdict(case, "xla", found) == "BAD"


@pytest.mark.parametrize("dtype,scale,caught", [
    ("float64", 1 + 1e-9, True),  # float32's tolerance would pass it
    ("float32", 1 + 1e-6, False),
    ("float16", 1 + 1e-3, False),  # float16's unit in the last place at 1
    ("float16", 1 + 1e-2, True),
])
def test_each_dtype_is_held_to_its_own_tolerance(dtype, scale, caught):
  def scaled_output(spec, x, h0, c0, params, **options):
    y, h, c = call(spec, x, h0, c0, params, **options)
    return y * jax.numpy.asarray(scale, y.dtype), h, c

  case = dataclasses.replace(SMALL, dtype=dtype, layers=1, direction="unidirectional")
  found = fuzz.errors(case, seed=1, call=scaled_output)
  assert (fuzz.verdict(case, "xla", found) == "BAD") == caught, found
  if dtype == "float64":  # its values were float64 ones, not float32's
    assert 0 < found["out"] < 1e-8, found


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_relu_derivatives_are_shown_not_compared(dtype):
  case = dataclasses.replace(SMALL, mode="rnn_relu", dtype=dtype)
  assert fuzz.verdict(case, "xla", {"out": 1e-3, "grad": 0.5}) == "ok-relu-half"
  assert fuzz.verdict(case, "xla", {"out": 0.5, "grad": 0.0}) == "BAD"
  assert fuzz.verdict(case, "xla", {"out": float("nan"), "grad": 0.0}) == "BAD"
  assert fuzz.verdict(dataclasses.replace(case, mode="gru"), "xla",
                      {"out": 1e-3, "grad": 0.5}) == "BAD"


@pytest.mark.parametrize("found,rc", [({"out": 1e-7, "grad": 1e-7}, 0),
                                      ({"out": 1e-7, "grad": 1e-2}, 1),
                                      (ValueError("cuDNN rejected the configuration"), 0),
                                      (TypeError("a bug"), 1)])
def test_main_counts_and_exit_status(monkeypatch, capsys, found, rc):
  def errors(case, seed, implementation):
    if isinstance(found, Exception):
      raise found
    return found

  one_step = []  # each draw's `one_step`

  def draw(rng, implementation, one_step_draw=False):
    one_step.append(one_step_draw)
    return SMALL

  monkeypatch.setattr(fuzz, "draw", draw)
  monkeypatch.setattr(fuzz, "errors", errors)
  want = {0: "ok=3", 1: "BAD=3"}[rc] if isinstance(found, dict) else (
      "rejected=3" if rc == 0 else "raised=3")
  for argv, drawn in [(["--cases", "3"], False), (["--cases", "3", "--one-step"], True)]:
    one_step.clear()
    assert fuzz.main(argv) == rc
    summary = capsys.readouterr().out.splitlines()[-1]
    assert want in summary, summary
    assert one_step == [drawn] * 3, (argv, one_step)


@on_a_cpu_host
@pytest.mark.parametrize("case", [
    dataclasses.replace(SMALL, mode="gru", dropout=0.3, direction="unidirectional"),
    dataclasses.replace(SMALL, check="vmap", time_major=False, layers=1),
    dataclasses.replace(SMALL, mode="rnn_relu", check="decode", steps=1, layers=1),
    dataclasses.replace(SMALL, dtype="float16", layers=1),
    dataclasses.replace(SMALL, mode="gru", dtype="float64", direction="unidirectional"),
], ids=str)
def test_cudnn_mode_runs_against_the_handler_model(sizes, monkeypatch, case):
  """The tool's cuDNN checks, against the model of the handlers (`handler_model.py`)
  standing in for cuDNN: what `gpu_session.sh fuzz-cudnn` will run, short of cuDNN."""
  sizes.install(monkeypatch.setattr)
  found = fuzz.errors(case, seed=2, implementation="cudnn")
  assert fuzz.verdict(case, "cudnn", found) == "ok", found
  assert len(found) >= 2, found


@pytest.mark.parametrize("argv,message", [
    # the first two ran no case and exited 0, as a run that checked them all; NaN set no limit
    (["--cases", "0"], "--cases must be at least 1, got 0"),
    (["--budget-s", "-15"], "--budget-s must be a finite number of seconds, at least 0, got -15"),
    (["--budget-s", "nan"], "--budget-s must be .*, got nan"),
])
def test_a_run_that_would_check_nothing_is_a_usage_error(capsys, argv, message):
  assert_usage_error(fuzz.main, argv, message, capsys)


@on_a_cpu_host
def test_main_stops_where_cudnn_cannot_run(capsys):
  assert fuzz.main(["--implementation", "cudnn"]) == 1
  assert "implementation='cudnn' cannot run here" in capsys.readouterr().out


def test_float64_reference_decides_a_float32_case():
  f32 = dataclasses.replace(SMALL, check="jvp")
  rescued = {"out": 1e-7, "jvp": 2e-2, "out-f64": 1e-7, "ref-out-f64": 1e-7,
             "jvp-f64": 2e-7, "ref-jvp-f64": 2e-2}
  assert fuzz.verdict(f32, "xla", rescued) == "ok-by-f64"
  assert fuzz.verdict(f32, "xla", {**rescued, "jvp-f64": 2e-2}) == "BAD"
  assert fuzz.verdict(f32, "xla", {**rescued, "out-f64": 1e-3}) == "BAD"
  assert fuzz.verdict(f32, "xla", {"out": 1e-7, "jvp": 2e-7}) == "ok"
