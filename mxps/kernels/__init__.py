"""Hot paths, compiled from ``cython/`` with a pure-Python twin each (MXPS_PURE_PYTHON=1):
``accum`` (summing pushes into a round's accumulator without the GIL), ``engine``
(asynchronous operations on MXNet's dependency engine), ``quantize`` (gradient compression),
``ltp`` (LTP's batched UDP I/O).  ``_select`` picks one in one place.  Besides: what the
kernels encode and read, ``dtypes`` (the dtype codes the wire carries too), ``ltp_packet``
(LTP's datagrams), ``ndview`` (numpy views of NDArray memory).  Nothing here imports a layer
above it (``_select`` reads ``mxps.config``, which imports nothing of mxps)."""
