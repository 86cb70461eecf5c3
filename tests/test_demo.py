"""The main job runs end to end in its short mode, and its loss falls."""

import re

import pytest

from jax_cudnn_rnn import _cudnn, demo
from helpers import assert_usage_error


def test_demo_quick_mode(capsys, tmp_path):
  assert demo.main(["--quick", "--steps", "20", "--checkpoint-dir", str(tmp_path / "ckpt")]) == 0
  out = capsys.readouterr().out
  before = float(re.search(r"validation loss before training: ([\d.]+)", out).group(1))
  after = float(re.search(r"validation loss after 20 steps: ([\d.]+)", out).group(1))
  assert after < before - 0.5, out
  assert "same predictions: True" in out
  assert (tmp_path / "ckpt").exists()
  assert "sample:" in out
  # With no flag, the compiled train step calls cuDNN exactly where it can run.
  if _cudnn.availability()[0]:
    assert "RNN: cuDNN's fused kernels" in out, out
  else:
    assert "RNN: the pure-JAX 'xla' path" in out, out


def test_corpus_is_real_text():
  corpus = demo.load_corpus(50_000)
  assert corpus.size == 50_000
  assert b"def " in corpus.tobytes() and b"import" in corpus.tobytes()


@pytest.mark.parametrize("argv,message", [
    (["--batch", "0"], "argument --batch: must be at least 1, got 0"),
    (["--dropout", "1"], r"argument --dropout: must be in \[0, 1\), got 1"),
    (["--lr", "-0.1"], r"argument --lr: must be in \(0, inf\), got -0.1"),
    # NaN compares false with every bound: it trained to a NaN loss, silently
    (["--lr", "nan"], r"argument --lr: must be in \(0, inf\), got nan"),
    (["--dropout", "nan"], r"argument --dropout: must be in \[0, 1\), got nan"),
    # were a ValueError (numpy) and an OverflowError (JAX) once the corpus was read
    (["--seed", "-1"], r"argument --seed: must be at least 0 and below 4294967296, got -1"),
    (["--seed", str(2**70)], r"argument --seed: must be at least 0 and below 4294967296, got"),
    (["--data-bytes", "100"], "argument --data-bytes: must be at least 10000, got 100"),
    (["--layers", "two"], "argument --layers: invalid int value: 'two'"),
    # before training, not from Orbax after it
    (["--checkpoint-dir", __file__], r"argument --checkpoint-dir: \S+ exists and is not a directory"),
    (["--checkpoint-dir", f"{__file__}/a/b"],
     r"argument --checkpoint-dir: \S+/a/b cannot be made: \S+test_demo.py is not a directory"),
])
def test_bad_options_are_usage_errors(capsys, argv, message):
  assert_usage_error(demo.main, argv, message, capsys)


def test_a_sequence_longer_than_the_validation_text_is_a_usage_error(capsys):
  """Was numpy's "high <= 0" once the corpus was read."""
  assert_usage_error(demo.main, ["--quick", "--seq-len", "100000"],
                     r"argument --seq-len: 100000 does not fit the validation text \(10,000 "
                     r"bytes, 5% of the corpus\): pass a shorter --seq-len", capsys)


def test_a_checkpoint_directory_holding_the_step_is_a_usage_error(capsys, tmp_path):
  """An earlier run's checkpoint of as many steps: Orbax's StepAlreadyExistsError,
  after the training, before; now a usage error before it, and nothing removed."""
  (tmp_path / "8").mkdir()
  assert_usage_error(demo.main, ["--quick", "--checkpoint-dir", str(tmp_path)],
                     rf"argument --checkpoint-dir: {tmp_path} already holds step 8 \(a checkpoint "
                     r"of an earlier run of 8 steps\): choose another directory", capsys)
  # The step asked for, not quick mode's: a run of 5 steps into a directory holding 5.
  (tmp_path / "8" / "5").mkdir()
  assert_usage_error(demo.main, ["--steps", "5", "--checkpoint-dir", str(tmp_path / "8")],
                     r"argument --checkpoint-dir: \S+ already holds step 5", capsys)
  assert [p.relative_to(tmp_path).as_posix() for p in sorted(tmp_path.rglob("*"))] == ["8", "8/5"]
