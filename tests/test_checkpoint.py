"""Canonical trees, save/restore, Orbax args, spec checks and damaged checkpoints."""

import gc
import json
import os
import shutil
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import checkpoint as ck
from helpers import SPEC_CLASSES


def test_canonical_tree_names_and_round_trip():
  spec = jcr.CudnnLSTM(2, 3, 3, input_mode="skip_input", direction="bidirectional",
                       dtype=jnp.float64)
  params = spec.init_params(jax.random.key(0))
  tree = ck.to_canonical_tree(spec, params)
  assert sorted(tree) == ["layer_0", "layer_1"]
  assert sorted(tree["layer_0"]) == ["backward", "forward"]
  # skip_input: layer 0 has recurrent matrices and both biases, no input matrices.
  assert sorted(tree["layer_0"]["forward"]) == sorted(
      [f"R_{g}" for g in "ifgo"] + [f"bW_{g}" for g in "ifgo"] + [f"bR_{g}" for g in "ifgo"])
  assert tree["layer_1"]["backward"]["W_g"].shape == (3, 6)
  weights, _ = spec.params_to_canonical(params)
  # layer 1 forward W_f is the 2nd input matrix of that direction (after 8 + 8 layer-0 R's).
  np.testing.assert_array_equal(tree["layer_1"]["forward"]["W_f"], weights[9])
  np.testing.assert_array_equal(ck.from_canonical_tree(spec, tree), params)
  del tree["layer_1"]["forward"]["bR_o"]
  with pytest.raises(ck.CheckpointError, match="layer_1/forward/bR_o"):
    ck.from_canonical_tree(spec, tree)
  tree = ck.to_canonical_tree(spec, params)
  tree["layer_1"]["backward"]["R_f"] = np.zeros((3, 4))
  with pytest.raises(ValueError, match=r"^canonical tree's layer_1/backward/R_f must have shape "
                                       r"\(3, 3\), got \(3, 4\)$"):
    ck.from_canonical_tree(spec, tree)
  # Not a tree at all: said so, rather than that its first leaf is missing.
  for tree, got in ((None, "NoneType"), ([tree["layer_0"]], "list"), (params, "ArrayImpl")):
    with pytest.raises(TypeError, match=r"^tree must be a canonical tree, a dict of layers "
                                        rf"\(to_canonical_tree's\), got {got}$"):
      ck.from_canonical_tree(spec, tree)
  # Any mapping will do (a Flax FrozenDict, say), not only a dict.
  read_only = types.MappingProxyType(ck.to_canonical_tree(spec, params))
  np.testing.assert_array_equal(ck.from_canonical_tree(spec, read_only), params)


def test_gru_and_rnn_gate_names():
  assert "W_z" in ck.to_canonical_tree(jcr.CudnnGRU(1, 2, 3), jcr.CudnnGRU(1, 2, 3).init_params(
      jax.random.key(0)))["layer_0"]["forward"]
  spec = jcr.CudnnRNNRelu(1, 2, 3)
  assert sorted(ck.to_canonical_tree(spec, spec.init_params(jax.random.key(0)))["layer_0"]["forward"]) == [
      "R_h", "W_h", "bR_h", "bW_h"]


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64])
def test_save_restore_exact(tmp_path, cls, dtype):
  spec = cls(2, 4, 3, direction="bidirectional", dtype=dtype)
  params = spec.init_params(jax.random.key(0))
  ck.save(tmp_path / "ckpt", spec, params)
  restored = ck.restore(tmp_path / "ckpt", spec)
  assert restored.dtype == dtype
  np.testing.assert_array_equal(np.asarray(restored, np.float64), np.asarray(params, np.float64))


def test_restore_into_another_dtype_casts(tmp_path):
  spec = jcr.CudnnGRU(1, 4, 3, dtype=jnp.float64)
  params = spec.init_params(jax.random.key(0))
  ck.save(tmp_path / "c", spec, params)
  spec32 = jcr.CudnnGRU(1, 4, 3, dtype=jnp.float32)
  restored = ck.restore(tmp_path / "c", spec32)
  assert restored.dtype == jnp.float32
  np.testing.assert_allclose(restored, params.astype(jnp.float32))
  as_bf16 = ck.restore(tmp_path / "c", spec, dtype=jnp.bfloat16)
  assert as_bf16.dtype == jnp.bfloat16


def test_restore_checks_its_dtype_before_reading(tmp_path):
  """`dtype` is checked where the arguments are made, as the spec checks its
  own: a missing directory is not what is reported, nothing is read."""
  spec = jcr.CudnnGRU(1, 4, 3)
  message = r"dtype must be one of \['float16', 'bfloat16', 'float32', 'float64'\], got "
  for dtype, got in (("foo", "'foo'"), (jnp.int32, "int32"), (np.complex64, "complex64"),
                     (3, "3")):
    for call in (lambda: ck.restore(tmp_path / "missing", spec, dtype),
                 lambda: ck.RNNParamsRestore(spec, dtype)):
      with pytest.raises(TypeError, match=message + got):
        call()
  # float64 only where JAX makes it: said for the dtype asked for, or the spec's.
  ck.save(tmp_path / "c", spec, spec.init_params(jax.random.key(0)))
  spec64 = jcr.CudnnGRU(1, 4, 3, dtype=jnp.float64)
  with jax.enable_x64(False):
    for call in (lambda: ck.restore(tmp_path / "c", spec, jnp.float64),
                 lambda: ck.restore(tmp_path / "c", spec64),
                 lambda: ck.RNNParamsRestore(spec, np.float64)):
      with pytest.raises(TypeError, match=r"dtype: restoring into float64 needs x64 \(JAX makes "
                         r"float64 arrays only with jax.config.update\('jax_enable_x64', True\)\)"):
        call()
    restored = ck.restore(tmp_path / "c", spec64, jnp.float32)
  assert restored.dtype == jnp.float32
  np.testing.assert_array_equal(restored, ck.restore(tmp_path / "c", spec))


def test_restore_into_different_spec_names_each_field(tmp_path):
  spec = jcr.CudnnLSTM(2, 4, 3)
  ck.save(tmp_path / "c", spec, spec.init_params(jax.random.key(0)))
  with pytest.raises(ck.CheckpointError) as info:
    ck.restore(tmp_path / "c", jcr.CudnnGRU(3, 4, 3, direction="bidirectional"))
  message = str(info.value)
  for field in ("class", "num_layers", "direction"):
    assert field in message
  assert "num_units" not in message


def test_overwrite_keeps_good_checkpoint_on_failure(tmp_path):
  spec = jcr.CudnnRNNTanh(1, 4, 3)
  params = spec.init_params(jax.random.key(0))
  ck.save(tmp_path / "c", spec, params)
  with pytest.raises(ValueError):
    ck.save(tmp_path / "c", spec, params[:-1])  # bad params: nothing written
  np.testing.assert_array_equal(ck.restore(tmp_path / "c", spec), params)
  ck.save(tmp_path / "c", spec, params * 2)  # a good overwrite replaces it
  np.testing.assert_array_equal(ck.restore(tmp_path / "c", spec), params * 2)
  assert sorted(os.listdir(tmp_path)) == ["c"]  # no staging left behind


def test_params_are_checked_before_anything_is_written(tmp_path):
  spec = jcr.CudnnGRU(1, 4, 3)
  params = spec.init_params(jax.random.key(0))
  traced = r"params must be a concrete array to be saved, got a traced float32\[\d+\]"
  with pytest.raises(TypeError, match=traced + r" \(saving writes files, so call it outside jit"):
    jax.jit(lambda p: ck.save(tmp_path / "c", spec, p))(params)
  with pytest.raises(TypeError, match=traced):
    jax.vmap(lambda p: ck.save(tmp_path / "c", spec, p))(jnp.stack([params, params]))
  with pytest.raises(TypeError, match=traced):
    jax.grad(lambda p: ck.save(tmp_path / "c", spec, p) or 0.0)(params)
  with pytest.raises(TypeError, match="params must be an array, got list"):
    ck.save(tmp_path / "c", spec, list(np.asarray(params)))
  with pytest.raises(TypeError, match="params must have dtype float32, got float64"):
    ck.save(tmp_path / "c", spec, np.asarray(params, np.float64))
  with pytest.raises(ValueError, match=r"params must have shape \(\d+,\)"):
    ck.save(tmp_path / "c", spec, params[None])
  with pytest.raises(TypeError, match=traced):  # Orbax's own entry point checks the same
    jax.jit(lambda p: ck.RNNParamsSave(spec, p) and 0.0)(params)
  assert os.listdir(tmp_path) == []  # no staging directory, no checkpoint
  ck.save(tmp_path / "c", spec, np.asarray(params))  # a numpy buffer is concrete
  np.testing.assert_array_equal(ck.restore(tmp_path / "c", spec), params)


def _damage(path, how):
  arrays = path / ck.ARRAYS_FILE
  if how == "missing_arrays":
    arrays.unlink()
  elif how == "missing_spec":
    (path / ck.SPEC_FILE).unlink()
  elif how == "truncated":
    data = arrays.read_bytes()
    arrays.write_bytes(data[:len(data) // 2])
  elif how == "bad_json":
    (path / ck.SPEC_FILE).write_text("{not json")
  elif how == "wrong_shape":
    with np.load(arrays) as d:
      content = dict(d)
    content["layer_0/forward/R_i"] = np.zeros((4, 5), np.float32)
    with open(arrays, "wb") as f:
      np.savez(f, **content)
  elif how == "missing_array":
    with np.load(arrays) as d:
      content = dict(d)
    del content["layer_0/forward/bW_g"]
    with open(arrays, "wb") as f:
      np.savez(f, **content)
  elif how == "version":
    record = json.loads((path / ck.SPEC_FILE).read_text())
    record["version"] = 99
    (path / ck.SPEC_FILE).write_text(json.dumps(record))
  elif how == "spec_not_a_record":
    record = json.loads((path / ck.SPEC_FILE).read_text())
    record["spec"] = 3
    (path / ck.SPEC_FILE).write_text(json.dumps(record))
  elif how == "json_not_a_record":
    (path / ck.SPEC_FILE).write_text("[1, 2]")


@pytest.mark.parametrize("how,message", [
    ("missing_arrays", "is missing"), ("missing_spec", "is missing"), ("truncated", "damaged"),
    ("bad_json", "damaged"), ("wrong_shape", r"R_i has shape \(4, 5\), expected \(4, 4\)"),
    ("missing_array", "has no array layer_0/forward/bW_g"), ("version", "format version 99"),
    ("spec_not_a_record", "has no spec record"),
    ("json_not_a_record", "is not a jax_cudnn_rnn.canonical checkpoint")])
def test_damaged_checkpoints_raise(tmp_path, how, message):
  spec = jcr.CudnnLSTM(1, 4, 3)
  ck.save(tmp_path / "c", spec, spec.init_params(jax.random.key(0)))
  _damage(tmp_path / "c", how)
  with pytest.raises(ck.CheckpointError, match=message):
    ck.restore(tmp_path / "c", spec)
  if how not in ("missing_arrays", "truncated", "wrong_shape", "missing_array"):  # spec.json's
    with pytest.raises(ck.CheckpointError, match=message):
      ck.saved_spec(tmp_path / "c")


@pytest.mark.parametrize("spec", [
    jcr.CudnnLSTM(2, 4, 3, direction="bidirectional", dtype=jnp.bfloat16, dropout=0.25, seed=7),
    jcr.CudnnGRU(1, 5, 5, input_mode="skip_input", dtype=jnp.float64),
    jcr.CudnnRNNRelu(3, 2, 6)])
def test_saved_spec_rebuilds_the_model_from_the_checkpoint_alone(tmp_path, spec):
  params = spec.init_params(jax.random.key(0))
  ck.save(tmp_path / "c", spec, params)
  saved = ck.saved_spec(str(tmp_path / "c"))
  assert saved == spec and type(saved) is type(spec)  # every field: dtype, dropout, seed too
  np.testing.assert_array_equal(ck.restore(tmp_path / "c", saved), params)


def test_a_checkpoint_managers_step_is_named_for_what_it_holds(tmp_path):
  """`restore` or `saved_spec` given a CheckpointManager's step directory,
  which holds the checkpoints (its items) rather than being one, names them."""
  encoder, decoder = jcr.CudnnLSTM(1, 4, 3), jcr.CudnnGRU(1, 5, 4)
  with ocp.CheckpointManager(tmp_path) as manager:
    manager.save(3, args=ocp.args.Composite(
        encoder=ck.RNNParamsSave(encoder, encoder.init_params(jax.random.key(0))),
        decoder=ck.RNNParamsSave(decoder, decoder.init_params(jax.random.key(1)))))
    manager.wait_until_finished()
  hint = r"holds the checkpoints decoder, encoder: an Orbax CheckpointManager's step"
  with pytest.raises(ck.CheckpointError, match=r"spec\.json is missing \(.*" + hint):
    ck.restore(tmp_path / "3", encoder)
  with pytest.raises(ck.CheckpointError, match=hint):
    ck.saved_spec(tmp_path / "3")
  assert ck.saved_spec(tmp_path / "3" / "decoder") == decoder
  with pytest.raises(ck.CheckpointError, match=r"spec\.json is missing$"):  # no items: no hint
    ck.saved_spec(tmp_path)
  with pytest.raises(ck.CheckpointError, match="does not exist"):
    ck.saved_spec(tmp_path / "nope")
  with pytest.raises(TypeError, match="directory must be a str or an os.PathLike, got int"):
    ck.saved_spec(3)


def test_damaged_arrays_file_is_closed(tmp_path):
  spec = jcr.CudnnLSTM(1, 4, 3)
  ck.save(tmp_path / "c", spec, spec.init_params(jax.random.key(0)))
  _damage(tmp_path / "c", "truncated")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with pytest.raises(ck.CheckpointError, match="damaged"):
      ck.restore(tmp_path / "c", spec)
    gc.collect()
  assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_missing_directory(tmp_path):
  with pytest.raises(ck.CheckpointError, match="does not exist"):
    ck.restore(tmp_path / "nope", jcr.CudnnLSTM(1, 4, 3))


def test_a_directory_that_is_no_path_is_a_type_error(tmp_path):
  spec = jcr.CudnnLSTM(1, 4, 3)
  with pytest.raises(TypeError, match=r"^directory must be a str or an os.PathLike, got NoneType$"):
    ck.save(None, spec, spec.init_params(jax.random.key(0)))
  with pytest.raises(TypeError, match=r"^directory must be a str or an os.PathLike, got int$"):
    ck.restore(3, spec)
  # An empty str was read as the working directory (an empty one would be replaced).
  for call in (lambda: ck.save("", spec, spec.init_params(jax.random.key(0))),
               lambda: ck.restore("", spec)):
    with pytest.raises(ValueError, match=r"^directory must name a directory, got ''$"):
      call()
  ck.save(str(tmp_path / "a"), spec, spec.init_params(jax.random.key(0)))  # a str is a path
  assert ck.restore(str(tmp_path / "a"), spec).shape == (spec.params_size(),)


def test_restoring_from_a_file_is_a_clear_error(tmp_path):
  (tmp_path / "f").write_text("not a checkpoint")
  with pytest.raises(ck.CheckpointError, match=r"f is a file, not a checkpoint directory"):
    ck.restore(tmp_path / "f", jcr.CudnnLSTM(1, 4, 3))


def test_composite_with_checkpoint_manager_several_rnns(tmp_path):
  encoder = jcr.CudnnLSTM(2, 4, 3, direction="bidirectional")
  decoder = jcr.CudnnGRU(1, 5, 8, dtype=jnp.float64)
  pe, pd = encoder.init_params(jax.random.key(0)), decoder.init_params(jax.random.key(1))
  other = {"w": jnp.arange(3.0)}
  with ocp.CheckpointManager(tmp_path) as manager:
    for step, scale in ((1, 1.0), (2, 2.0)):
      manager.save(step, args=ocp.args.Composite(
          encoder=ck.RNNParamsSave(encoder, pe * scale), decoder=ck.RNNParamsSave(decoder, pd),
          other=ocp.args.StandardSave(other)))
    manager.wait_until_finished()
    out = manager.restore(2, args=ocp.args.Composite(
        encoder=ck.RNNParamsRestore(encoder), decoder=ck.RNNParamsRestore(decoder),
        other=ocp.args.StandardRestore(other)))
  np.testing.assert_array_equal(out.encoder, pe * 2)
  np.testing.assert_array_equal(out.decoder, pd)
  np.testing.assert_array_equal(out.other["w"], other["w"])


def test_checkpoint_restores_on_another_backend_layout(tmp_path):
  # The stored arrays are the canonical ones, independent of the opaque layout:
  # a checkpoint is plain named arrays plus the spec.
  spec = jcr.CudnnGRU(1, 2, 3)
  params = spec.init_params(jax.random.key(0))
  ck.save(tmp_path / "c", spec, params)
  record = json.loads((tmp_path / "c" / ck.SPEC_FILE).read_text())
  assert record["spec"]["class"] == "CudnnGRU" and record["version"] == 1
  with np.load(tmp_path / "c" / ck.ARRAYS_FILE) as data:
    weights, _ = spec.params_to_canonical(params)
    np.testing.assert_array_equal(data["layer_0/forward/W_r"], weights[0])


def test_save_never_replaces_other_data(tmp_path):
  spec = jcr.CudnnGRU(1, 4, 3)
  params = spec.init_params(jax.random.key(0))
  (tmp_path / "notes.txt").write_text("mine")
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "train.csv").write_text("1,2")
  with pytest.raises(ck.CheckpointError, match="exists and is a file"):
    ck.save(tmp_path / "notes.txt", spec, params)
  with pytest.raises(ck.CheckpointError, match="is a directory that is not a jax_cudnn_rnn checkpoint"):
    ck.save(tmp_path / "data", spec, params)
  assert (tmp_path / "notes.txt").read_text() == "mine"
  assert os.listdir(tmp_path / "data") == ["train.csv"]
  assert sorted(os.listdir(tmp_path)) == ["data", "notes.txt"]  # no staging left behind
  (tmp_path / "empty").mkdir()
  ck.save(tmp_path / "empty", spec, params)  # an empty directory is fine
  np.testing.assert_array_equal(ck.restore(tmp_path / "empty", spec), params)


def test_save_through_a_link_replaces_what_it_points_to(tmp_path):
  """A link to a checkpoint directory (`ckpt -> /scratch/...`) stays a link: the
  rename replaced the link itself, so that the checkpoint landed beside it, on
  the link's file system, and the directory it pointed to kept the old one."""
  spec = jcr.CudnnGRU(1, 4, 3)
  params = spec.init_params(jax.random.key(0))
  (tmp_path / "scratch").mkdir()
  (tmp_path / "link").symlink_to(tmp_path / "scratch")
  (tmp_path / "dangling").symlink_to(tmp_path / "not_yet")
  for step in range(2):  # into an empty directory, then over the checkpoint there
    ck.save(tmp_path / "link", spec, params + step)
    assert (tmp_path / "link").is_symlink()
    np.testing.assert_array_equal(ck.restore(tmp_path / "scratch", spec), params + step)
  ck.save(tmp_path / "dangling", spec, params)  # made where the link points
  assert (tmp_path / "dangling").is_symlink()
  np.testing.assert_array_equal(ck.restore(tmp_path / "not_yet", spec), params)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "link", "not_yet", "scratch"]


def test_save_does_not_replace_the_working_directory(tmp_path, monkeypatch):
  """`save(".")` in an empty directory moved that directory away from under the
  process (its checkpoint landed at the path, and every relative path after it
  failed); so would an earlier checkpoint the process works in, or one above."""
  spec = jcr.CudnnGRU(1, 4, 3)
  params = spec.init_params(jax.random.key(0))
  message = r"is this process's working directory \(or holds it\).*nothing was written"
  (tmp_path / "empty").mkdir()
  monkeypatch.chdir(tmp_path / "empty")
  for directory in (".", tmp_path / "empty"):
    with pytest.raises(ck.CheckpointError, match=message):
      ck.save(directory, spec, params)
  assert os.getcwd() == str(tmp_path / "empty") and os.listdir(".") == []
  ck.save(tmp_path / "ckpt", spec, params)
  monkeypatch.chdir(tmp_path / "ckpt")  # an earlier checkpoint, to be replaced
  with pytest.raises(ck.CheckpointError, match=message):
    ck.save(".", spec, params + 1)
  monkeypatch.chdir(tmp_path / "empty")
  ck.save("inside", spec, params + 1)  # below the working directory, as ever
  np.testing.assert_array_equal(ck.restore("inside", spec), params + 1)
  np.testing.assert_array_equal(ck.restore(tmp_path / "ckpt", spec), params)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "empty"]  # nothing staged left


def test_save_does_not_replace_a_checkpoint_holding_other_data(tmp_path):
  """Replacing a checkpoint deleted whatever else it held: a checkpoint saved
  inside it, a file of the user's. Only Orbax's own kind of file (`_...`, as a
  newer Orbax may add) may be there besides ours."""
  spec = jcr.CudnnGRU(1, 4, 3)
  params = spec.init_params(jax.random.key(0))
  ck.save(tmp_path / "ckpt", spec, params)
  ck.save(tmp_path / "ckpt" / "inner", spec, params * 2)
  (tmp_path / "ckpt" / "notes.txt").write_text("mine")
  with pytest.raises(ck.CheckpointError, match=r"ckpt exists and is a checkpoint that also holds "
                                               r"inner, notes.txt, which replacing it would "
                                               r"delete; .*nothing was written"):
    ck.save(tmp_path / "ckpt", spec, params + 1)
  np.testing.assert_array_equal(ck.restore(tmp_path / "ckpt", spec), params)
  np.testing.assert_array_equal(ck.restore(tmp_path / "ckpt" / "inner", spec), params * 2)
  assert (tmp_path / "ckpt" / "notes.txt").read_text() == "mine"
  (tmp_path / "ckpt" / "notes.txt").unlink()
  (tmp_path / "ckpt" / "_METADATA_OF_A_NEWER_ORBAX").write_text("{}")
  with pytest.raises(ck.CheckpointError, match="also holds inner,"):
    ck.save(tmp_path / "ckpt", spec, params + 1)
  shutil.rmtree(tmp_path / "ckpt" / "inner")
  ck.save(tmp_path / "ckpt", spec, params + 1)  # Orbax's kind of file alone: replaced
  np.testing.assert_array_equal(ck.restore(tmp_path / "ckpt", spec), params + 1)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_save_replaces_a_damaged_checkpoint(tmp_path):
  spec = jcr.CudnnGRU(1, 4, 3)
  params = spec.init_params(jax.random.key(0))
  ck.save(tmp_path / "c", spec, params)
  (tmp_path / "c" / ck.SPEC_FILE).write_text("{not json")
  ck.save(tmp_path / "c", spec, params + 1)
  np.testing.assert_array_equal(ck.restore(tmp_path / "c", spec), params + 1)


def test_a_failed_move_keeps_the_earlier_checkpoint(tmp_path, monkeypatch):
  """Where the new checkpoint cannot be moved into place, the earlier one is
  moved back (and the error raised); where that fails too, the error says
  where the earlier one is kept, and it is kept there."""
  spec = jcr.CudnnGRU(1, 4, 3)
  params = spec.init_params(jax.random.key(0))
  ck.save(tmp_path / "c", spec, params)
  real_replace = os.replace
  target = str(tmp_path / "c")

  def refuse_the_new_one(src, dst):
    if dst == target and os.path.basename(src) == "checkpoint":
      raise PermissionError(f"refused: {src}")
    return real_replace(src, dst)
  monkeypatch.setattr(ck.os, "replace", refuse_the_new_one)
  with pytest.raises(PermissionError, match="refused"):
    ck.save(tmp_path / "c", spec, params + 1)
  np.testing.assert_array_equal(ck.restore(tmp_path / "c", spec), params)
  assert sorted(os.listdir(tmp_path)) == ["c"]  # no staging left behind

  def refuse_both(src, dst):
    if dst == target:
      raise PermissionError(f"refused: {src}")
    return real_replace(src, dst)
  monkeypatch.setattr(ck.os, "replace", refuse_both)
  with pytest.raises(ck.CheckpointError, match=r"nor the earlier one back; the earlier one "
                                               r"is kept at (\S+)") as caught:
    ck.save(tmp_path / "c", spec, params + 1)
  monkeypatch.setattr(ck.os, "replace", real_replace)
  kept = str(caught.value).rsplit(" ", 1)[-1]
  assert os.path.dirname(os.path.dirname(kept)) == str(tmp_path)
  np.testing.assert_array_equal(ck.restore(kept, spec), params)


def test_a_spec_that_is_not_one_is_a_type_error(tmp_path):
  params = jnp.zeros(10)
  message = r"spec must be a CudnnLSTM, CudnnGRU, CudnnRNNTanh or CudnnRNNRelu, got str 'lstm'"
  for call in (lambda: ck.save(tmp_path / "c", "lstm", params),
               lambda: ck.restore(tmp_path / "c", "lstm"),
               lambda: ck.to_canonical_tree("lstm", params),
               lambda: ck.RNNParamsSave("lstm", params),
               lambda: ck.RNNParamsRestore(spec="lstm")):
    with pytest.raises(TypeError, match=message):
      call()
  assert not (tmp_path / "c").exists()


def test_restore_places_with_a_sharding(tmp_path):
  spec = jcr.CudnnLSTM(1, 4, 3, dtype=jnp.bfloat16)
  params = spec.init_params(jax.random.key(0))
  ck.save(tmp_path / "c", spec, params)
  # `make_single_device_sharding`: jax 0.12.1 deprecates `SingleDeviceSharding`.
  single = jax.sharding.make_single_device_sharding(jax.devices()[0])
  mesh = jax.make_mesh((1,), ("x",))
  for sharding in (single,
                   jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))):
    restored = ck.restore(tmp_path / "c", spec, sharding=sharding)
    assert restored.sharding == sharding and restored.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(restored, np.float32), np.asarray(params, np.float32))
  # Through Orbax's arguments too, cast to another dtype on the way.
  with ocp.Checkpointer(ck.RNNParamsHandler()) as checkpointer:
    restored = checkpointer.restore(tmp_path / "c", args=ck.RNNParamsRestore(
        spec, jnp.float32, single))
  assert restored.dtype == jnp.float32
  assert restored.sharding == single
  np.testing.assert_array_equal(restored, np.asarray(params, np.float32))


def test_a_sharding_that_is_not_one_is_a_type_error(tmp_path):
  spec = jcr.CudnnGRU(1, 4, 3)
  ck.save(tmp_path / "c", spec, spec.init_params(jax.random.key(0)))
  message = r"sharding: expected a jax.sharding.Sharding or None, got str 'cpu'"
  for call in (lambda: ck.restore(tmp_path / "c", spec, sharding="cpu"),
               lambda: ck.restore(tmp_path / "missing", spec, sharding="cpu"),
               lambda: ck.RNNParamsRestore(spec, sharding="cpu")):
    with pytest.raises(TypeError, match=message):
      call()
