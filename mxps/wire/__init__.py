"""Bytes on the wire: the frame format (``frame``) and the transports that carry frames.

``tcp``: the reliable transport (pyzmq ROUTER/DEALER over TCP), used by every role today.
A lossy transport (UDP, LTP's push) and the authentication of every frame belong here too,
under both transports, so that nothing above this package sees an unauthenticated byte.
"""
