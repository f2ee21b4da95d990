"""The three roles of a parameter-server job, and what ``import mxps`` does to start them.

``scheduler`` (rendezvous, barriers, liveness, re-plan decisions), ``server`` (rounds, the
optimizer, moving state between servers), ``worker`` (the I/O thread of a training process),
``link`` (every node's connection to the scheduler), ``takeover`` (a scheduler or server
process started by MXNet's launcher runs its mxps role on ``import mxps``).
"""
