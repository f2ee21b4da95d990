"""Slice accumulation: the compiled ``mxps._accum`` unless MXPS_PURE_PYTHON=1 (numpy twin)."""
import os

if os.environ.get("MXPS_PURE_PYTHON", "0") in ("1", "true", "yes", "on"):
    from .accum_py import add_into, copy_into  # noqa: F401
    IMPLEMENTATION = "python"
else:
    try:
        from ._accum import add_into, copy_into  # noqa: F401
        IMPLEMENTATION = "cython"
    except ImportError as e:  # pragma: no cover - a broken install
        raise ImportError(
            "mxps's compiled extension mxps/_accum is missing (%s). Reinstall with "
            "`pip install .` from the mxps checkout (it builds cython/accum.pyx), or set "
            "MXPS_PURE_PYTHON=1 to use the slower pure-Python path." % e) from None
