"""Gradient compression's quantizers: the compiled ``mxps.kernels._quantize`` unless
MXPS_PURE_PYTHON=1 (numpy twin ``quantize_py``)."""
from ._select import implementation

_impl, IMPLEMENTATION = implementation("_quantize", "quantize_py", "quantize.pyx")
quantize_2bit = _impl.quantize_2bit
quantize_1bit = _impl.quantize_1bit
dequantize_2bit = _impl.dequantize_2bit
dequantize_1bit = _impl.dequantize_1bit
