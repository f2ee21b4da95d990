"""Slice accumulation: the compiled ``mxps._accum`` unless MXPS_PURE_PYTHON=1 (numpy twin)."""
from ._select import implementation

_impl, IMPLEMENTATION = implementation("_accum", "accum_py", "accum.pyx")
add_into = _impl.add_into
copy_into = _impl.copy_into
