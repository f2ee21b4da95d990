"""LTP: the loss-tolerant push over UDP (docs/LTP.md).

``packet``: the datagram format and its tags; ``close``: the Early Close rule (pure);
``rate``: the BBR-style pacing model of one worker -> server path (pure); ``rounds``: a
server's per-(slice, round) accounting and Bubble Filling; ``sender`` / ``receiver``: the
worker's and the server's UDP endpoints.  The pull, control and small keys stay on the reliable
(TCP) transport.
"""
