"""MXNet's side: the kvstore plugin (``kvstore``) and the in-process fixes of MXNet 1.9.1
(``fixes``).  The engine operations and the views of NDArray memory are in ``mxps.kernels``."""
