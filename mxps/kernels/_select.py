"""Pick a hot path: the compiled Cython module, or its pure-Python twin (MXPS_PURE_PYTHON=1)."""
import importlib
import os

from .. import config


def implementation(compiled, twin, source):
    """The module ``mxps.kernels.<compiled>`` (built from cython/<source>), or its twin
    ``mxps.kernels.<twin>`` when MXPS_PURE_PYTHON=1."""
    if config.pure_python():
        return importlib.import_module("mxps.kernels." + twin), "python"
    try:
        return importlib.import_module("mxps.kernels." + compiled), "cython"
    except ImportError as e:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        raise ImportError(
            "mxps's compiled extension mxps/kernels/%s is missing (%s); mxps was imported from "
            "%s. If that is a source checkout without its build (`python -m ...` or `python -c` "
            "started in the checkout's root puts it ahead of the installed mxps), start the "
            "process elsewhere or with `python -P`; otherwise reinstall with `pip install .` "
            "from the checkout (it builds cython/%s), or set MXPS_PURE_PYTHON=1 for the slower "
            "pure-Python path." % (compiled, e, here, source)) from None
