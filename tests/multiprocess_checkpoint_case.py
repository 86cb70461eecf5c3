"""One process of a two-process run (`test_checkpoint_multiprocess.py` starts
two): `jax.distributed` over two CPU processes of two devices each, so that a
buffer split over the four devices is not addressable from either process.

    python multiprocess_checkpoint_case.py PROCESS_ID PORT DIRECTORY

Prints one line, `RESULT <json>`: each check's name and whether it held (or
the error it raised), for the parent to assert on.
"""

import json
import os
import sys
import traceback


def main(process_id: int, port: int, directory: str) -> dict:
  import jax
  jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
  import jax.numpy as jnp
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jax_cudnn_rnn as jcr
  from jax_cudnn_rnn import checkpoint

  assert jax.process_count() == 2 and jax.device_count() == 4, (
      jax.process_count(), jax.device_count())
  mesh = jax.make_mesh((4,), ("d",))
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
  spec = jcr.CudnnLSTM(1, 8, 4)  # 448 elements: four parts of 112
  first = np.asarray(spec.init_params(jax.random.key(0)))
  second = np.asarray(spec.init_params(jax.random.key(1)))

  def place(host, sharding):
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  def holds(array, host):
    """Each of this process's parts is its slice of `host`, and the parts
    gathered from both processes are `host`."""
    parts = all(np.array_equal(np.asarray(s.data), host[s.index])
                for s in array.addressable_shards)
    whole = np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return bool(parts and np.array_equal(whole, host))

  checks = {}

  def check(name, fn):
    try:
      checks[name] = bool(fn())
    except Exception as e:  # recorded for the parent; the run goes on in step with the other
      checks[name] = f"{type(e).__name__}: {e}"[:2000]
      traceback.print_exc()

  path = lambda name: os.path.join(directory, name)
  check("split saved, restored split",
        lambda: (checkpoint.save(path("split"), spec, place(first, split)),
                 holds(checkpoint.restore(path("split"), spec, sharding=split), first))[1])
  check("split saved, restored replicated",
        lambda: holds(checkpoint.restore(path("split"), spec, sharding=replicated), first))
  check("replicated saved, restored split",
        lambda: (checkpoint.save(path("replicated"), spec, place(first, replicated)),
                 holds(checkpoint.restore(path("replicated"), spec, sharding=split), first))[1])
  check("a checkpoint replaced",
        lambda: (checkpoint.save(path("replicated"), spec, place(second, split)),
                 holds(checkpoint.restore(path("replicated"), spec, sharding=split), second))[1])
  check("restored without a sharding, on this process's default device",
        lambda: np.array_equal(np.asarray(checkpoint.restore(path("replicated"), spec)), second))

  def bfloat16():
    half = jcr.CudnnLSTM(1, 8, 4, dtype=jnp.bfloat16)
    checkpoint.save(path("bf16"), half, place(first.astype(jnp.bfloat16), split))
    restored = checkpoint.restore(path("bf16"), half, jnp.float32, sharding=split)
    return restored.dtype == jnp.float32 and holds(
        restored, first.astype(jnp.bfloat16).astype(np.float32))
  check("bfloat16, restored as float32", bfloat16)

  def manager():
    with ocp.CheckpointManager(path("manager")) as m:
      m.save(3, args=ocp.args.Composite(rnn=checkpoint.RNNParamsSave(spec, place(first, split))))
      m.wait_until_finished()
    with ocp.CheckpointManager(path("manager")) as m:
      restored = m.restore(3, args=ocp.args.Composite(
          rnn=checkpoint.RNNParamsRestore(spec, sharding=split)))
    return holds(restored.rnn, first)
  check("through a CheckpointManager", manager)

  def refused():
    foreign = path("foreign")
    if process_id == 0:
      os.makedirs(foreign)
      with open(os.path.join(foreign, "notes.txt"), "w") as f:
        f.write("not a checkpoint")
    multihost_utils.sync_global_devices("foreign directory made")
    try:
      checkpoint.save(foreign, spec, place(first, split))
    except checkpoint.CheckpointError as e:
      multihost_utils.sync_global_devices("foreign directory refused")
      return "nothing was written" in str(e) and os.listdir(foreign) == ["notes.txt"]
    return False
  check("a foreign directory refused on every process", refused)

  def failed_move():
    """Process 0 cannot move the written checkpoint into place: it raises
    its error, and process 1 learns of it and raises too (no hang)."""
    target = path("unmovable")
    real_replace = checkpoint.os.replace

    def replace(src, dst):
      if process_id == 0 and dst == target:
        raise PermissionError(f"refused moving into {dst}")
      return real_replace(src, dst)
    checkpoint.os.replace = replace
    try:
      checkpoint.save(target, spec, place(first, split))
    except PermissionError as e:
      return process_id == 0 and "refused moving" in str(e)
    except checkpoint.CheckpointError as e:
      return process_id == 1 and "process 0 could not move the checkpoint" in str(e)
    finally:
      checkpoint.os.replace = real_replace
    return False
  check("a failure on process 0 raised on both", failed_move)

  multihost_utils.sync_global_devices("checks done")
  check("no staging directory left", lambda: sorted(
      n for n in os.listdir(directory) if n.startswith(".")) == [])
  return checks


if __name__ == "__main__":
  result = main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
  print("RESULT " + json.dumps(result), flush=True)
