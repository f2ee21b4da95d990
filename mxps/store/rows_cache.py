"""Eviction policies of ``DiskRows``' RAM cache (see ``mxps.store.rows`` and docs/STORE.md).

The cache is a fixed number of *slots*, each holding one whole record (a row's weights and
optimizer states).  A policy only sees slot numbers: ``hit(slots)`` for rows served from the
cache, ``admit(slots, ghost)`` for rows just placed in slots (``ghost``: which of them were
recently evicted, as the row index remembers), ``victims(n)`` to pick ``n`` occupied slots to
free (called only when every slot is occupied) and ``evicted()`` once the cache has written
those rows back and marked them ``ON_DISK`` in the row index.  A policy is built with the
cache's slot count, its row index (``codes``) and its slot -> row table (``row_of``).

Every policy works on whole batches with numpy (a server handles thousands of rows per call;
a Python loop per row would cost more than the I/O it saves), so each is the batch form of its
textbook policy: a batch's evictions are chosen before its rows are admitted.  The default,
``s3fifo``, had the best hit rate of the policies measured on Zipf-distributed ids (docs/STORE.md,
``scripts/store_engines.py policies``).
"""
import numpy as np

# Codes of the row index (one int32 per row of the table) for rows not in the cache; a row in
# the cache has its slot number (>= 0) there.
ON_DISK = -1        # the row's record is in the file
GHOST = -2          # in the file, and evicted recently (S3-FIFO's ghost queue)
NEW = -3            # never written: its first touch asks the table's init for it

# Bytes of bookkeeping per slot besides its record, counted in the cache budget: row id (8),
# dirty flag (1), frequency (1), queue entry (4), ghost entry (8), rounded up.
SLOT_META_BYTES = 32


class Lru:
    """Least recently used: a stamp per slot, the ``n`` oldest go (O(slots) per eviction)."""

    name = "lru"

    def __init__(self, slots, codes, row_of):
        self._stamp = np.zeros(slots, np.int64)
        self._now = 0

    def _touch(self, slots):
        n = len(slots)
        self._stamp[slots] = np.arange(self._now, self._now + n)
        self._now += n

    def hit(self, slots):
        self._touch(slots)

    def admit(self, slots, ghost):
        self._touch(slots)

    def victims(self, n):
        if n >= len(self._stamp):
            return np.arange(len(self._stamp))
        return np.argpartition(self._stamp, n - 1)[:n]

    def evicted(self):
        pass


def _sweep(freq, n):
    """A CLOCK hand's sweep over ``freq`` (the counters of a queue in hand order), done at once:
    the hand passes entries, taking those at 0 and decrementing the others, until it has taken
    ``n``.  Returns ``(taken, new_freq, turn)``: the taken positions, every counter after the
    sweep, and where the hand stopped (the queue continues from ``turn + 1``, then wraps).

    An entry at position p with counter c is taken on the hand's (c+1)-th pass, at time
    c * len + p, so the ``n`` smallest times are the victims; an entry left was passed once per
    round that reached it before the last victim."""
    m = len(freq)
    pos = np.arange(m, dtype=np.int64)
    when = freq.astype(np.int64) * m + pos
    taken = np.argpartition(when, n - 1)[:n] if n < m else pos
    last = int(when[taken].max())
    passes = np.where(last > pos, (last - pos + m - 1) // m, 0)
    return taken, np.maximum(freq - passes, 0).astype(freq.dtype), last % m


class Clock:
    """CLOCK with counters (GCLOCK): a hit raises a slot's counter up to ``max_count``, the hand
    decrements it on each pass and takes slots at 0.  ``max_count`` 1 is plain CLOCK."""

    name = "clock"

    def __init__(self, slots, codes, row_of, max_count=1):
        self._count = np.zeros(slots, np.int8)
        self._hand = 0
        self._max = max_count

    def hit(self, slots):
        self._count[slots] = np.minimum(self._count[slots] + 1, self._max)

    def admit(self, slots, ghost):
        self._count[slots] = 0

    def victims(self, n):
        order = np.roll(np.arange(len(self._count)), -self._hand)
        taken, after, turn = _sweep(self._count[order], n)
        self._count[order] = after
        self._hand = int(order[turn] + 1) % len(self._count)
        return order[taken]

    def evicted(self):
        pass


class S3Fifo:
    """S3-FIFO (Yang et al., SOSP'23): new rows enter a small FIFO queue S (10% of the slots);
    a row reaching S's head unused since it entered leaves (its id kept in a ghost queue), one
    used again moves to the main queue M; M is a FIFO with reinsertion (a CLOCK with counters
    up to 3).  A row admitted while its id is in the ghost queue goes straight to M.  One-hit
    rows (the long tail of a Zipf distribution) therefore leave fast and never push hot rows
    out of M.

    The ghost queue is the row index's GHOST code plus a ring of the last ``|M|`` evicted ids
    (a ring entry whose row came back is skipped when it expires)."""

    name = "s3fifo"
    SMALL = 0.1
    MAX_FREQ = 3

    def __init__(self, slots, codes, row_of):
        self._codes = codes
        self._row_of = row_of
        self._leaving = np.empty(0, np.int64)     # rows taken from S by the last victims()
        self._freq = np.zeros(slots, np.int8)
        self._small = np.empty(0, np.int32)      # slot ids, head first
        self._main = np.empty(0, np.int32)
        self._small_cap = max(1, int(slots * self.SMALL))
        self._ghost = np.full(max(1, slots - self._small_cap), -1, np.int64)
        self._ghost_at = 0

    def hit(self, slots):
        self._freq[slots] = np.minimum(self._freq[slots] + 1, self.MAX_FREQ)

    def admit(self, slots, ghost):
        self._freq[slots] = 0
        slots = slots.astype(np.int32)
        self._main = np.concatenate([self._main, slots[ghost]])
        self._small = np.concatenate([self._small, slots[~ghost]])

    def victims(self, n):
        out, leaving = [], []
        while n > 0:
            if len(self._small) >= self._small_cap or not len(self._main):
                taken = self._from_small(n)
                leaving.append(self._row_of[taken])
            else:
                taken = self._from_main(n)
            out.append(taken)
            n -= len(taken)
        self._leaving = np.concatenate(leaving) if leaving else self._leaving[:0]
        return np.concatenate(out)

    def _from_small(self, n):
        """Pass S's head entries (while S stays at its share, or M is empty): used ones move
        to M's tail, unused ones are taken, until ``n`` are taken."""
        allow = len(self._small) - self._small_cap + 1 if len(self._main) else len(self._small)
        head = self._small[:max(1, allow)]
        unused = self._freq[head] == 0
        taken_so_far = np.cumsum(unused)
        cut = len(head) if taken_so_far[-1] < n else int(np.searchsorted(taken_so_far, n)) + 1
        head, unused = head[:cut], unused[:cut]
        moved = head[~unused]
        self._freq[moved] = 0
        self._main = np.concatenate([self._main, moved])
        self._small = self._small[cut:]
        return head[unused]

    def _from_main(self, n):
        n = min(n, len(self._main))
        taken, after, turn = _sweep(self._freq[self._main], n)
        self._freq[self._main] = after
        keep = np.ones(len(self._main), bool)
        keep[taken] = False
        victims = self._main[taken]
        self._main = np.roll(self._main[keep], -int(keep[:turn + 1].sum()))
        return victims

    def evicted(self):
        """Rows that left S unused join the ghost ring; ids pushed out of it forget the mark
        (unless their row came back meanwhile)."""
        rows = self._leaving[-len(self._ghost):]
        k = len(rows)
        at = (self._ghost_at + np.arange(k)) % len(self._ghost)
        old = self._ghost[at]
        old = old[old >= 0]
        self._codes[old[self._codes[old] == GHOST]] = ON_DISK
        self._ghost[at] = rows
        self._ghost_at = int((self._ghost_at + k) % len(self._ghost))
        self._codes[rows] = GHOST


class GClock(Clock):
    """CLOCK with counters up to 3 (frequency-aware)."""

    name = "gclock"

    def __init__(self, slots, codes, row_of):
        super().__init__(slots, codes, row_of, max_count=3)


POLICIES = {p.name: p for p in (Lru, Clock, GClock, S3Fifo)}
