"""Placing the rows of a row-sparse table over servers by two objectives:
the servers' bandwidth and their disk caches.  A pure function; docs/STORE.md says how it is
meant to be used.

A table of R rows is read and written row by row, row r with frequency ``freq[r]`` (rows per
step, estimated from the ids the workers saw).  Server s has rate ``rates[s]`` (bytes/s, the
adaptive plan's measurement) and a cache of ``cache_rows[s]`` rows; a row that is not among
the ``cache_rows[s]`` hottest of its server is read from disk at ``io_seconds`` per access.
A server's time per step is then

    time_s = row_bytes * traffic_s / rates[s] + io_seconds * missed_s

with ``traffic_s`` the frequencies of its rows summed and ``missed_s`` those of its rows
beyond its cache; a synchronous step waits for the slowest server, so the placement minimises
``max_s time_s`` (``cost``).

``place_rows`` returns a permutation of the row ids (row r is stored at position
``perm[r]``) and how many positions each server owns, in server order (contiguous ranges: a
dense-id table and its slices stay as they are, the workers translate ids): within a server
its rows are in decreasing frequency (the hot ones together, read in long runs and admitted
to the cache first).  It tries two placements and keeps the cheaper:

1. the *contiguous* one mxps uses without this function (ids in order, cut in proportion to
   the rates), the baseline: so the result is never worse than it (a property test);
2. a *greedy* one: rows hottest first, each to the server whose time it raises least
   (counting whether it still fits that server's cache) - a list-scheduling rule, which
   spreads hot rows over servers in proportion to their rates until a server's cache is
   full, and then weighs its disk time against the others' links.
"""
import numpy as np


def _times(order_by_server, freq, rates, cache_rows, io_seconds, row_bytes):
    out = []
    for s, rows in enumerate(order_by_server):
        f = np.sort(freq[rows])[::-1] if len(rows) else np.zeros(0)
        traffic = float(f.sum())
        missed = float(f[cache_rows[s]:].sum())
        out.append(row_bytes * traffic / rates[s] + io_seconds * missed)
    return out


def cost(assign, freq, rates, cache_rows, io_seconds=0.0, row_bytes=1.0):
    """The slowest server's time per step when row r is on server ``assign[r]``."""
    assign = np.asarray(assign)
    groups = [np.flatnonzero(assign == s) for s in range(len(rates))]
    return max(_times(groups, np.asarray(freq, float), rates, cache_rows, io_seconds,
                      row_bytes))


def contiguous(n_rows, rates):
    """Ids in order, cut in proportion to the rates: the server of each row."""
    share = np.asarray(rates, float) / float(np.sum(rates))
    bounds = np.round(np.cumsum(share) * n_rows).astype(np.int64)
    bounds[-1] = n_rows
    return np.searchsorted(bounds, np.arange(n_rows), side="right")


def greedy(freq, rates, cache_rows, io_seconds=0.0, row_bytes=1.0):
    """Hottest row first, each to the server whose time it raises least."""
    freq = np.asarray(freq, float)
    n_servers = len(rates)
    assign = np.empty(len(freq), np.int64)
    time = np.zeros(n_servers)
    held = np.zeros(n_servers, np.int64)
    per_byte = row_bytes / np.asarray(rates, float)
    caps = np.asarray(cache_rows, np.int64)
    for r in np.argsort(-freq, kind="stable"):
        add = freq[r] * (per_byte + np.where(held >= caps, io_seconds, 0.0))
        s = int(np.argmin(time + add))
        assign[r] = s
        time[s] += add[s]
        held[s] += 1
    return assign


def place_rows(freq, rates, cache_rows, io_seconds=0.0, row_bytes=1.0):
    """``(perm, counts, assign, chosen)``: row r at position ``perm[r]``; server s owns
    positions ``[sum(counts[:s]), sum(counts[:s+1]))``; ``assign[r]`` its server; ``chosen``
    "greedy" or "contiguous" (see the module doc)."""
    freq = np.asarray(freq, float)
    if freq.ndim != 1 or (freq < 0).any():
        raise ValueError("row frequencies must be a 1-D array of non-negative numbers")
    if len(rates) != len(cache_rows) or not all(r > 0 for r in rates):
        raise ValueError("one positive rate and one cache size per server")
    base = contiguous(len(freq), rates)
    best = greedy(freq, rates, cache_rows, io_seconds, row_bytes)
    chosen = "greedy"
    if cost(best, freq, rates, cache_rows, io_seconds, row_bytes) > \
            cost(base, freq, rates, cache_rows, io_seconds, row_bytes):
        best, chosen = base, "contiguous"
    perm = np.empty(len(freq), np.int64)
    counts = []
    pos = 0
    for s in range(len(rates)):
        rows = np.flatnonzero(best == s)
        rows = rows[np.argsort(-freq[rows], kind="stable")]     # hot rows first
        perm[rows] = np.arange(pos, pos + len(rows))
        pos += len(rows)
        counts.append(len(rows))
    return perm, counts, best, chosen
