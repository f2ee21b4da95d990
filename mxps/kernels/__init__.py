"""Hot paths, compiled from ``cython/`` with a pure-Python twin each (MXPS_PURE_PYTHON=1):
``accum`` (summing pushes into a round's accumulator without the GIL), ``engine``
(asynchronous operations on MXNet's dependency engine), ``quantize`` (gradient compression),
``ltp`` (LTP's batched UDP I/O).  ``_select`` picks one in one place.  Besides: ``ndview``
(numpy views of NDArray memory) and ``dtypes`` (the dtype codes the kernels and the wire
share).  Nothing here imports the layers above it but ``ltp_py`` (LTP's packet layout)."""
