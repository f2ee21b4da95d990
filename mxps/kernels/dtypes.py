"""The dtype codes the compiled kernels switch on and the wire carries: MXNet's own type flags
(mshadow::TypeFlag), one table for both (``wire.frame`` names them in its errors)."""
import numpy as np

DTYPES = {0: np.dtype("float32"), 1: np.dtype("float64"), 2: np.dtype("float16"),
          3: np.dtype("uint8"), 4: np.dtype("int32"), 5: np.dtype("int8"),
          6: np.dtype("int64")}
