"""Hot paths, compiled from ``cython/`` with a pure-Python twin each (MXPS_PURE_PYTHON=1):
``accum`` (summing pushes into a round's accumulator without the GIL) and ``engine``
(asynchronous operations on MXNet's dependency engine).  ``_select`` picks one in one place."""
