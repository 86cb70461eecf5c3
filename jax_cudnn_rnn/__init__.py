"""cuDNN's fused RNNs for JAX, with an exact pure-JAX equivalent on every backend.

    import jax_cudnn_rnn as jcr
    lstm = jcr.CudnnLSTM(num_layers=2, num_units=256, input_size=128)
    params = lstm.init_params(jax.random.key(0))
    y, h, c = lstm(x, None, None, params, is_training=False)
"""

from jax_cudnn_rnn import _requirements

_requirements.check_jax()

from jax_cudnn_rnn._spec import (  # noqa: E402  (after the version check)
    CudnnGRU,
    CudnnLSTM,
    CudnnRNNBase,
    CudnnRNNRelu,
    CudnnRNNTanh,
)
from jax_cudnn_rnn._dropout import keep_mask as dropout_keep_mask  # noqa: E402
from jax_cudnn_rnn._cudnn import (  # noqa: E402
    export_disabled_checks,
    register_ffi_targets,
)

__all__ = [
    "CudnnGRU",
    "CudnnLSTM",
    "CudnnRNNBase",
    "CudnnRNNRelu",
    "CudnnRNNTanh",
    "dropout_keep_mask",
    "export_disabled_checks",
    "register_ffi_targets",
]

__version__ = "0.1.0"
