"""A pytest plugin that runs the GPU tests' own code on a CPU, with the handler
model (`handler_model.py`) standing in for the native library and cuDNN.

    PYTHONPATH=tests pytest -p gpu_dry_run tests/test_cudnn.py

The GPU tests cannot run where there is no GPU, so mistakes in the tests
themselves (a wrong dtype, a wrong argument) would otherwise first show on a
lent GPU, whose time is short. Here every test of `test_cudnn.py` not marked
`needs_device` (those need a real CUDA device or the real handlers: placement
on a CUDA device, device memory, the handlers' own error messages) runs once,
with its first parameters, against the model. This proves the tests' code
runs and agrees with a model of cuDNN; it proves nothing about cuDNN itself.
`test_gpu_dry_run.py` runs it.

The patches are applied when the plugin is imported, before `test_cudnn.py`
asks `_cudnn.availability()` at its own import.
"""

from handler_model import HandlerModel

HandlerModel().install(setattr)


def pytest_collection_modifyitems(config, items):
  kept, dropped, seen = [], [], set()
  for item in items:
    name = getattr(item, "originalname", item.name)
    if item.get_closest_marker("needs_device") is not None or name in seen:
      dropped.append(item)
    else:
      seen.add(name)
      kept.append(item)
  config.hook.pytest_deselected(items=dropped)
  items[:] = kept
