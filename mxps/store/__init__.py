"""Where a server keeps the numbers of its slices.

``memory.MemorySlice`` keeps one slice in RAM: the stored weights (the NDArray the optimizer
updates in place), the value pulls are served from, and the round accumulators' buffers.  The
protocol (rounds, pulls, migration) lives in ``mxps.roles.server_state`` and reaches a slice's
numbers only through that small interface.

``rows`` holds tables of rows with their optimizer state (``MemoryRows``, and ``DiskRows``: one
file per table behind a RAM cache with a byte budget, the disk being a checkpoint), the store
behind DRPS (docs/STORE.md); ``rows_cache`` its eviction policies; ``row_sets`` the rows of a
row-sparse push or pull inside a slice (the worker's adapter cuts them, the server places them).
"""
