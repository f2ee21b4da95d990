"""LTP's batched UDP I/O and packet opening: the compiled ``mxps.kernels._ltp`` (recvmmsg,
sendmmsg, headers and tags checked in C) unless MXPS_PURE_PYTHON=1 (its twin ``ltp_py``: loops
of ``recvfrom_into`` / ``sendmsg`` and ``kernels.ltp_packet``'s own checks)."""
from ._select import implementation

_impl, IMPLEMENTATION = implementation("_ltp", "ltp_py", "ltp.pyx")
recv_batch = _impl.recv_batch
# turning a socket's receive timestamps on is one setsockopt: the twin's for both
from .ltp_py import enable_stamps  # noqa: E402
send_batch = _impl.send_batch
open_batch = _impl.open_batch
round_add = _impl.round_add
send_run = _impl.send_run
# the server's packet intake (ltp_py's last section)
PathCore = _impl.PathCore
ShareCore = _impl.ShareCore
RoundCore = _impl.RoundCore
take_common = _impl.take_common
intake = _impl.intake
encode_acks = _impl.encode_acks
