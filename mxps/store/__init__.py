"""Where a server keeps the numbers of its slices.

``memory.MemorySlice`` keeps one slice in RAM: the stored weights (the NDArray the optimizer
updates in place), the value pulls are served from, and the round accumulators' buffers.  The
protocol (rounds, pulls, migration) lives in ``mxps.roles.server_state`` and reaches a slice's
numbers only through that small interface, so a disk-resident store (for models larger than a
server's memory) can sit beside it here behind the same interface.
"""
