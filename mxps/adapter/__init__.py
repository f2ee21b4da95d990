"""MXNet's side: the kvstore plugin (``kvstore``), views of NDArray memory (``ndview``) and the
in-process fixes of MXNet 1.9.1 (``fixes``).  The engine operations are in ``mxps.kernels``."""
