"""Pick a hot path: the compiled Cython module, or its pure-Python twin (MXPS_PURE_PYTHON=1)."""
import importlib
import os


def implementation(compiled, twin, source):
    """The module ``mxps.<compiled>`` (built from cython/<source>), or ``mxps.<twin>``."""
    if os.environ.get("MXPS_PURE_PYTHON", "0").lower() in ("1", "true", "yes", "on"):
        return importlib.import_module("mxps." + twin), "python"
    try:
        return importlib.import_module("mxps." + compiled), "cython"
    except ImportError as e:  # pragma: no cover - a broken install
        raise ImportError(
            "mxps's compiled extension mxps/%s is missing (%s). Reinstall with `pip install .` "
            "from the mxps checkout (it builds cython/%s), or set MXPS_PURE_PYTHON=1 to use the "
            "slower pure-Python path." % (compiled, e, source)) from None
