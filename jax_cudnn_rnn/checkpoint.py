"""Checkpoints of RNN parameters in the canonical format, through Orbax.

The seeds' `RNNParamsSaveable` / `CudnnOpaqueParamsSaveable`, the JAX way: an
opaque buffer is saved as its canonical per-layer, per-direction, per-gate
arrays and restored into an opaque buffer, so a checkpoint outlives cuDNN
versions, GPUs and backends (a GPU checkpoint restores on a CPU and back).

File format (version 1), one directory per RNN:
- `spec.json`: `{"format": "jax_cudnn_rnn.canonical", "version": 1,
  "spec": {class, num_layers, num_units, input_size, input_mode, direction,
  dtype, dropout, seed}, "arrays": {name: [shape, stored dtype]}}`;
- `arrays.npz`: one array per canonical tensor, named as in
  `to_canonical_tree` flattened with "/" (`layer_0/forward/W_i`). float16 and
  bfloat16 are stored as float32 (exactly), the spec's dtype is in `spec.json`.

Canonical tree (stable names, a file format): `{"layer_<l>": {"forward" |
"backward": {"W_<gate>", "R_<gate>", "bW_<gate>", "bR_<gate>"}}}` with gates
`i, f, g, o` (LSTM), `r, z, n` (GRU), `h` (Elman RNNs); `W` `[num_units, in]`,
`R` `[num_units, num_units]`, biases `[num_units]`. Under skip_input,
`layer_0` has no `W_*`.

Restoring checks the spec (each differing field named), the format version,
every array's presence and shape; any problem raises `CheckpointError` and
returns nothing partial. `saved_spec` reads the spec a checkpoint holds, so
that a model can be rebuilt from it alone. Given the step directory of an
Orbax CheckpointManager, which holds checkpoints (its items) rather than
being one, both name the items it holds. Given a `sharding`, the restored
buffer is placed with it (replicated over a mesh, say), each addressable
device's part taken from the host copy (`jax.make_array_from_callback`).
`save` writes through Orbax's atomic temporary directory and only then
replaces an existing checkpoint; it refuses to replace a file, a directory
that is not a checkpoint, a checkpoint holding anything besides its own files
(a checkpoint saved inside it, a file of the user's), or the process's
working directory (or one above it), which the replacing rename would move
away from under the process. A symbolic link is followed: what it points to
is replaced, and the link stays.

Several processes (a multi-host run, `jax.distributed`): every process calls
`save` / `restore` (or Orbax's `save` / `restore` with our args), as Orbax
asks, with one directory on a file system they all see. Saving gathers a
buffer split over several processes' devices (`process_allgather`, a
collective), and only the primary process (Orbax's `primary_host`, 0 by
default) writes the files and moves them into place; `save`'s staging
directory is named from a token process 0 draws and sends to all, and
`save` returns (or raises, on every process) only once process 0 has put
the checkpoint in place or failed to. Restoring reads the files in every
process, each placing its own devices' parts (tested with two processes on
one machine, `tests/test_checkpoint_multiprocess.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _layout, _params, _spec

FORMAT = "jax_cudnn_rnn.canonical"
VERSION = 1
SPEC_FILE = "spec.json"
ARRAYS_FILE = "arrays.npz"
_SPEC_CLASSES = {c.__name__: c for c in (jcr.CudnnLSTM, jcr.CudnnGRU, jcr.CudnnRNNTanh,
                                         jcr.CudnnRNNRelu)}
_SPEC_FIELDS = ("num_layers", "num_units", "input_size", "input_mode", "direction", "dtype",
                "dropout", "seed")


class CheckpointError(ValueError):
  """A checkpoint is missing, damaged, or does not match the requested spec."""


def _names(spec) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
  """(layer, direction, leaf) names of the canonical weights and biases."""
  weights, biases = _layout.tensors(spec)

  def name(t):
    leaf = _layout.tensor_name(spec, t).split("/")[-1]
    return f"layer_{t.layer}", ("forward", "backward")[t.direction], leaf

  return [name(t) for t in weights], [name(t) for t in biases]


@_spec.takes_spec
def to_canonical_tree(spec, params) -> dict:
  """The opaque buffer as a nested dict of named canonical arrays (see module doc)."""
  weights, biases = spec.params_to_canonical(params)
  w_names, b_names = _names(spec)
  tree: dict = {}
  for (layer, direction, leaf), array in zip(w_names + b_names, weights + biases):
    tree.setdefault(layer, {}).setdefault(direction, {})[leaf] = array
  return tree


@_spec.takes_spec
def from_canonical_tree(spec, tree) -> jax.Array:
  """Inverse of `to_canonical_tree`: an opaque buffer of `spec.dtype`."""
  if not isinstance(tree, Mapping):
    raise TypeError(f"tree must be a canonical tree, a dict of layers (to_canonical_tree's), "
                    f"got {type(tree).__name__}")
  w_names, b_names = _names(spec)
  w_entries, b_entries = _layout.tensors(spec)

  def get(names, entries):
    out = []
    for (layer, direction, leaf), entry in zip(names, entries):
      try:
        value = tree[layer][direction][leaf]
      except (KeyError, TypeError):
        raise CheckpointError(f"canonical tree has no {layer}/{direction}/{leaf} "
                              f"(needed by {spec})") from None
      out.append(_params.canonical_entry(f"canonical tree's {layer}/{direction}/{leaf}", value,
                                         entry.shape))
    return out

  return spec.canonical_to_params(get(w_names, w_entries), get(b_names, b_entries))


@_spec.takes_spec
def spec_to_dict(spec) -> dict:
  """The spec as `spec.json` records it: its class name and every field, the
  dtype by name (JSON-serializable)."""
  d = {"class": type(spec).__name__}
  for f in _SPEC_FIELDS:
    v = getattr(spec, f)
    d[f] = v.name if f == "dtype" else v
  return d


def spec_from_dict(d: dict):
  """The spec `spec_to_dict` recorded, or a `CheckpointError` saying the record
  is invalid."""
  try:
    cls = _SPEC_CLASSES[d["class"]]
    return cls(**{f: d[f] for f in _SPEC_FIELDS})
  except (KeyError, TypeError, ValueError) as e:
    raise CheckpointError(f"checkpoint's spec record is invalid: {d!r} ({e})") from None


def _spec_differences(saved: dict, wanted) -> list[str]:
  want = spec_to_dict(wanted)
  # dtype may differ: restoring casts. dropout and seed do not change params.
  return [f"{k}: checkpoint has {saved.get(k)!r}, requested {want[k]!r}"
          for k in ("class", "num_layers", "num_units", "input_size", "input_mode", "direction")
          if saved.get(k) != want[k]]


def _flat_names(spec) -> list[str]:
  w_names, b_names = _names(spec)
  return ["/".join(n) for n in w_names + b_names]


def _is_primary(primary_host: int | None) -> bool:
  """Whether this process is the one that writes (Orbax's convention: None
  makes every process one)."""
  return primary_host is None or primary_host == jax.process_index()


def _write(directory: epath.Path, spec, params, primary: bool = True) -> None:
  """Writes the checkpoint's files; every process calls it, the primary writes.
  A buffer split over several processes' devices is gathered first, a
  collective that every process takes part in."""
  if (isinstance(params, jax.Array) and not params.is_fully_addressable
      and not params.is_fully_replicated):
    params = multihost_utils.process_allgather(params, tiled=True)
  if not primary:
    return
  params = np.asarray(jax.device_get(params))
  tree = to_canonical_tree(spec, params)
  store = np.float32 if spec.dtype.itemsize < 4 else spec.dtype
  arrays = {}
  for name in _flat_names(spec):
    layer, direction, leaf = name.split("/")
    arrays[name] = np.asarray(np.asarray(tree[layer][direction][leaf]).astype(store))
  record = {"format": FORMAT, "version": VERSION, "spec": spec_to_dict(spec),
            "arrays": {k: [list(v.shape), v.dtype.name] for k, v in arrays.items()}}
  directory.mkdir(parents=True, exist_ok=True)
  with open(os.fspath(directory / ARRAYS_FILE), "wb") as f:
    np.savez(f, **arrays)
  (directory / SPEC_FILE).write_text(json.dumps(record, indent=1))


def _checkpoints_inside(directory: epath.Path) -> list[str]:
  """The entries of `directory` that are checkpoints of ours (the items of an
  Orbax CheckpointManager's step, say), sorted."""
  try:
    return sorted(p.name for p in directory.iterdir() if (p / SPEC_FILE).exists())
  except OSError:
    return []


def _missing(path: epath.Path) -> CheckpointError:
  """A missing file's error; where the directory holds checkpoints rather than
  being one (a CheckpointManager's step directory), it names them."""
  inside = _checkpoints_inside(path.parent)
  hint = (f" ({path.parent} holds the checkpoints {', '.join(inside)}: an Orbax "
          "CheckpointManager's step? pass one of them)") if inside else ""
  return CheckpointError(f"checkpoint file {path} is missing{hint}")


def _read_record(directory: epath.Path) -> dict:
  """`spec.json`'s record, its format and version checked."""
  spec_path = directory / SPEC_FILE
  if not spec_path.exists():
    raise _missing(spec_path)
  try:
    record = json.loads(spec_path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{spec_path} is damaged: {e}") from None
  if not isinstance(record, dict) or record.get("format") != FORMAT:
    raise CheckpointError(f"{spec_path} is not a {FORMAT} checkpoint")
  if record.get("version") != VERSION:
    raise CheckpointError(f"{spec_path} has format version {record.get('version')}, "
                          f"this library reads version {VERSION}")
  if not isinstance(record.get("spec"), dict):
    raise CheckpointError(f"{spec_path} has no spec record (got {record.get('spec')!r})")
  return record


def _read(directory: epath.Path, spec, dtype=None, sharding=None) -> jax.Array:
  record = _read_record(directory)
  arrays_path = directory / ARRAYS_FILE
  if not arrays_path.exists():
    raise _missing(arrays_path)
  differences = _spec_differences(record["spec"], spec)
  if differences:
    raise CheckpointError("checkpoint spec differs from the requested spec: "
                          + "; ".join(differences))
  names = _flat_names(spec)
  w_shapes = [t.shape for t in _layout.tensors(spec)[0]]
  b_shapes = [t.shape for t in _layout.tensors(spec)[1]]
  try:
    # Our own file handle: np.load leaves the file it opened open when the
    # archive is damaged.
    with open(os.fspath(arrays_path), "rb") as f, np.load(f, allow_pickle=False) as data:
      arrays = {}
      for name, shape in zip(names, w_shapes + b_shapes):
        if name not in data.files:
          raise CheckpointError(f"{arrays_path} has no array {name}")
        a = data[name]
        if a.shape != shape:
          raise CheckpointError(f"{arrays_path}: {name} has shape {a.shape}, expected {shape}")
        arrays[name] = a
  except CheckpointError:
    raise
  except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
    raise CheckpointError(f"{arrays_path} is damaged: {e}") from None
  target = spec if dtype is None else dataclasses.replace(spec, dtype=dtype)
  weights = [arrays[n] for n in names[:len(w_shapes)]]
  biases = [arrays[n] for n in names[len(w_shapes):]]
  params = target.canonical_to_params([jnp.asarray(w) for w in weights],
                                      [jnp.asarray(b) for b in biases])
  return params if sharding is None else _place(params, sharding)


def _check_savable_params(spec, params) -> None:
  """Checks `params` before anything is written: a concrete opaque buffer of
  `spec` (the shape and dtype its calls take). A traced one, under `jit`,
  `grad` or `vmap`, has no values to write."""
  if isinstance(params, jax.core.Tracer):
    raise TypeError(
        f"params must be a concrete array to be saved, got a traced "
        f"{np.dtype(params.dtype).name}{list(params.shape)} "
        "(saving writes files, so call it outside jit, grad and vmap, on the values they return)")
  _params._check_params(spec, params)


def _check_restore_dtype(spec, dtype) -> None:
  """`dtype` (None: the spec's) as a spec takes it, and one JAX can make here:
  checked before any file is read."""
  target = spec if dtype is None else dataclasses.replace(spec, dtype=_spec.check_dtype(dtype))
  if target.dtype == np.float64 and not jax.config.jax_enable_x64:
    raise TypeError(f"dtype: restoring into float64 needs x64 ({_params.X64_HINT}); "
                    "or pass dtype=jnp.float32 to restore as float32")


def _check_sharding(sharding) -> None:
  if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
    raise TypeError("sharding: expected a jax.sharding.Sharding or None, got "
                    f"{type(sharding).__name__} {sharding!r}")


def _place(params: jax.Array, sharding) -> jax.Array:
  """`params` placed with `sharding`: each addressable device's part cut from
  the host copy, so that every process of a multi-host run supplies its own."""
  host = np.asarray(params)
  try:
    sharding.shard_shape(host.shape)  # raises where the buffer cannot be so split
  except ValueError as e:
    raise ValueError(f"sharding: {sharding} cannot place the parameter buffer of shape "
                     f"{host.shape}: {e}") from None
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


class RNNParamsHandler(ocp.CheckpointHandler):
  """Orbax handler writing and reading one RNN's canonical arrays.

  `multiprocessing_options`: Orbax's `MultiprocessingOptions`; its
  `primary_host` (default 0) is the process that writes, as in Orbax's own
  handlers (None: every process writes, for file systems not shared).
  """

  def __init__(self, multiprocessing_options=None):
    self._primary_host = getattr(multiprocessing_options, "primary_host", 0)

  def save(self, directory: epath.Path, args: "RNNParamsSave") -> None:
    _write(epath.Path(directory), args.spec, args.params, _is_primary(self._primary_host))

  def restore(self, directory: epath.Path, args: "RNNParamsRestore" = None) -> jax.Array:
    if args is None:
      raise CheckpointError("restoring RNN params needs RNNParamsRestore(spec)")
    return _read(epath.Path(directory), args.spec, args.dtype, args.sharding)

  def metadata(self, directory: epath.Path) -> Any:
    path = epath.Path(directory) / SPEC_FILE
    return json.loads(path.read_text()) if path.exists() else None


@ocp.args.register_with_handler(RNNParamsHandler, for_save=True)
@dataclasses.dataclass
class RNNParamsSave(ocp.args.CheckpointArgs):
  """Save one RNN's opaque `params` of `spec` in the canonical format."""

  spec: Any
  params: Any

  def __post_init__(self):
    _spec.check_spec(self.spec, type(self).__name__)
    _check_savable_params(self.spec, self.params)


@ocp.args.register_with_handler(RNNParamsHandler, for_restore=True)
@dataclasses.dataclass
class RNNParamsRestore(ocp.args.CheckpointArgs):
  """Restore into an opaque buffer of `spec` (cast to `dtype` if given, else
  spec.dtype), placed with `sharding` if given."""

  spec: Any
  dtype: Any = None
  sharding: Any = None

  def __post_init__(self):
    _spec.check_spec(self.spec, type(self).__name__)
    _check_restore_dtype(self.spec, self.dtype)
    _check_sharding(self.sharding)


# What a checkpoint directory written by `save` holds (ours and Orbax's files).
_CHECKPOINT_ENTRIES = frozenset({SPEC_FILE, ARRAYS_FILE, "_CHECKPOINT_METADATA",
                                 "commit_success.txt"})


def _why_not_replaceable(directory: epath.Path) -> str | None:
  """None where `save` may replace what is at `directory`, an empty directory
  or one of our checkpoints (even a damaged one); else what it is: a file or
  other data. A checkpoint may hold more of Orbax's metadata files (a newer
  Orbax's: named `_...`, as its own are), but nothing else: a checkpoint saved
  inside it, or a file of the user's, would go with it."""
  if not directory.is_dir():
    return "a file"
  entries = set(os.listdir(os.fspath(directory)))
  if entries <= _CHECKPOINT_ENTRIES:
    return None
  try:
    ours = json.loads((directory / SPEC_FILE).read_text()).get("format") == FORMAT
  except (OSError, ValueError, AttributeError):
    ours = False
  if not ours:
    return "a directory that is not a jax_cudnn_rnn checkpoint"
  others = sorted(e for e in entries - _CHECKPOINT_ENTRIES
                  if not (e.startswith("_") and os.path.isfile(os.fspath(directory / e))
                          and not os.path.islink(os.fspath(directory / e))))
  if others:
    return (f"a checkpoint that also holds {', '.join(others)}, which replacing it would "
            "delete")
  return None


def _staging_name(directory: epath.Path) -> str:
  """A fresh name for `save`'s staging directory beside `directory`, the same
  in every process (process 0's random token, sent to all)."""
  token = np.frombuffer(os.urandom(8), np.uint8)
  if jax.process_count() > 1:
    token = np.asarray(multihost_utils.broadcast_one_to_all(token), np.uint8)
  return f".{directory.name}.{token.tobytes().hex()}"


def _all_learn(ok: bool) -> bool:
  """Process 0's `ok`, learnt by every process (a collective where there are
  several): so that a failure on process 0 raises everywhere, not hangs."""
  if jax.process_count() == 1:
    return ok
  return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


def _move_into_place(written: epath.Path, directory: epath.Path,
                     previous: epath.Path) -> Exception | None:
  """Replaces `directory` (if any) by `written`; the earlier checkpoint moves
  to `previous` first and back if the second move fails. Returns the error,
  None on success."""
  had_earlier = directory.exists()
  try:
    if had_earlier:
      os.replace(os.fspath(directory), os.fspath(previous))
  except OSError as e:
    return e
  try:
    os.replace(os.fspath(written), os.fspath(directory))
  except OSError as e:
    if had_earlier:
      try:
        os.replace(os.fspath(previous), os.fspath(directory))
      except OSError:
        return CheckpointError(f"could not move the new checkpoint to {directory} ({e}) nor "
                               f"the earlier one back; the earlier one is kept at {previous}")
    return e
  return None


def _directory(directory) -> epath.Path:
  """`directory` as an absolute path, or a `TypeError` naming the argument
  (rather than epath's "Invalid path type")."""
  if not isinstance(directory, (str, os.PathLike)):
    raise TypeError(f"directory must be a str or an os.PathLike, got {type(directory).__name__}")
  if not os.fspath(directory):  # epath would read it as the working directory
    raise ValueError("directory must name a directory, got ''")
  return epath.Path(directory).absolute()


def _holds_working_directory(directory: epath.Path) -> bool:
  """Whether `directory` is the working directory or one above it (an empty
  one, say `save(".", ...)` where `.` is empty: `os.replace` would move it
  away from under the process)."""
  try:
    here = os.path.realpath(os.getcwd())
  except OSError:  # the working directory is gone already
    return False
  there = os.path.realpath(os.fspath(directory))
  return here == there or here.startswith(there.rstrip(os.sep) + os.sep)


@_spec.takes_spec
def save(directory, spec, params) -> None:
  """Saves `params` of `spec` to `directory`, replacing a checkpoint there only on success.

  Raises `CheckpointError` (writing nothing) where `directory` exists and is
  neither empty nor a checkpoint of this module: a file or a folder of other
  data is never replaced. With several processes, each calls it (module doc).
  """
  args = RNNParamsSave(spec, params)  # checks its arguments before anything is written
  # Where a link points: replacing the link itself put the checkpoint beside it,
  # a link to another file system (`ckpt -> /scratch/...`) becoming a directory.
  directory = epath.Path(os.path.realpath(_directory(directory)))
  why_not = _why_not_replaceable(directory) if directory.exists() else None
  if why_not:
    raise CheckpointError(f"{directory} exists and is {why_not}; save replaces only an empty "
                          "directory or an earlier checkpoint, so nothing was written")
  if _holds_working_directory(directory):
    raise CheckpointError(
        f"{directory} is this process's working directory (or holds it): save replaces the "
        "directory it is given, which would leave the process in a removed directory; name "
        "a directory inside it instead, so nothing was written")
  primary = _is_primary(0)  # the process whose token and verdict `_staging_name`, `_all_learn` send
  staging = directory.parent / _staging_name(directory)
  if primary:
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging.mkdir(mode=0o700)
  error = None
  try:
    written = staging / "checkpoint"
    with ocp.Checkpointer(RNNParamsHandler()) as checkpointer:
      checkpointer.save(written, args=args)
    if primary:
      error = _move_into_place(written, directory, staging / "previous")
  finally:
    # A CheckpointError from the move: staging holds the only earlier copy.
    if primary and not isinstance(error, CheckpointError):
      shutil.rmtree(os.fspath(staging), ignore_errors=True)
  if not _all_learn(error is None):
    if error is not None:
      raise error
    raise CheckpointError(f"process 0 could not move the checkpoint into place at "
                          f"{directory}; its error says why")


@_spec.takes_spec
def restore(directory, spec, dtype=None, *, sharding=None) -> jax.Array:
  """Restores an opaque buffer of `spec` (cast to `dtype` if given) from `directory`.

  `sharding`: a `jax.sharding.Sharding` to place the buffer with (for a mesh,
  `NamedSharding(mesh, PartitionSpec())` replicates it); by default it lands
  on JAX's default device.
  """
  args = RNNParamsRestore(spec, dtype, sharding)  # checks its arguments before any reading
  directory = _existing_directory(directory)
  with ocp.Checkpointer(RNNParamsHandler()) as checkpointer:
    return checkpointer.restore(directory, args=args)


def saved_spec(directory):
  """The spec a checkpoint was saved with (its dtype, dropout and seed too), so
  that a model can be rebuilt from the checkpoint alone:
  `restore(directory, saved_spec(directory))`."""
  return spec_from_dict(_read_record(_existing_directory(directory))["spec"])


def _existing_directory(directory) -> epath.Path:
  """`directory` as an absolute path, or an error unless it is a directory."""
  directory = _directory(directory)
  if not directory.exists():
    raise CheckpointError(f"checkpoint directory {directory} does not exist")
  if not directory.is_dir():
    raise CheckpointError(f"{directory} is a file, not a checkpoint directory")
  return directory
