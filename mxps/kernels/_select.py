"""Pick a hot path: the compiled Cython module, or its pure-Python twin (MXPS_PURE_PYTHON=1)."""
import importlib

from .. import config


def implementation(compiled, twin, source):
    """The module ``mxps.kernels.<compiled>`` (built from cython/<source>), or its twin
    ``mxps.kernels.<twin>`` when MXPS_PURE_PYTHON=1."""
    if config.pure_python():
        return importlib.import_module("mxps.kernels." + twin), "python"
    try:
        return importlib.import_module("mxps.kernels." + compiled), "cython"
    except ImportError as e:  # pragma: no cover - a broken install
        raise ImportError(
            "mxps's compiled extension mxps/kernels/%s is missing (%s). Reinstall with `pip install .` "
            "from the mxps checkout (it builds cython/%s), or set MXPS_PURE_PYTHON=1 to use the "
            "slower pure-Python path." % (compiled, e, source)) from None
