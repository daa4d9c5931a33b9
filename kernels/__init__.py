"""Fast, exact per-parameter operations of the asynchronous strategies.

SpecTrain predicts weights before each pass, XPipe/PipeOptim do the same
from Adam's moments, PipeDream stashes versions, PipeDream-2BW swaps two
buffers and AvgPipe pulls replicas toward a centre. All of them touch every
parameter at every step, so if these operations are slow they eat the time
pipelining saves. This package holds them for the validation runtime to call
and for the simulator to cost (:func:`bytes_moved`).

Three implementations behind one API: a multi-tensor path on
``torch._foreach_*`` ops for every device, fused C loops for CPU tensors
(:mod:`pipesim.kernels.native`, compiled on first use) and fused Triton
kernels (one launch over all parameters) for CUDA tensors; ``auto`` picks the
fused path of the device when it is available, :func:`set_backend` or
``backend=`` forces one.
"""

from pipesim.kernels.averaging import elastic_average
from pipesim.kernels.backend import (
    BACKENDS,
    get_backend,
    native_available,
    native_unavailable_reason,
    set_backend,
    triton_available,
    use_backend,
)
from pipesim.kernels.buffers import DoubleBuffer, StashFullError, VersionPool, WeightStash
from pipesim.kernels.cost import KERNELS, bytes_moved
from pipesim.kernels.module import PredictionGroup, Predictor, elastic_average_modules, optimizer_kind, predict_module
from pipesim.kernels.prediction import (
    InplacePrediction,
    adam_coefficients,
    predict_adam,
    predict_adam_,
    predict_sgd,
    predict_sgd_,
)

__all__ = [
    "BACKENDS",
    "KERNELS",
    "DoubleBuffer",
    "InplacePrediction",
    "PredictionGroup",
    "Predictor",
    "StashFullError",
    "VersionPool",
    "WeightStash",
    "adam_coefficients",
    "bytes_moved",
    "elastic_average",
    "elastic_average_modules",
    "get_backend",
    "native_available",
    "native_unavailable_reason",
    "optimizer_kind",
    "predict_adam",
    "predict_adam_",
    "predict_module",
    "predict_sgd",
    "predict_sgd_",
    "set_backend",
    "triton_available",
    "use_backend",
]
