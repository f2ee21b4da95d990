"""A fluid network on SimPy: links as capacities, connections as queues of messages, every
active connection's rate max-min fair, recomputed when a connection starts or stops sending or
a capacity changes (SimGrid's flow model, without its TCP corrections).

A *resource* is anything with a capacity in bytes/s that connections share: a node's uplink or
downlink, a CPU that spends time per byte.  A *connection* is one sender's ordered byte stream
to one receiver (a TCP connection, an LTP path); it uses resources with a *weight*: the units
of that resource one byte of goodput takes.  The weight carries three things:

- multiplicity: a connection that stands for ``m`` identical workers' connections (the
  simulator keeps one representative per class of identical workers) weighs ``m`` on the
  resources those ``m`` share (a server's downlink) and 1 on the representative's own link;
- efficiency: headers, retransmissions and timeouts (goodput / wire bytes, ``1 / e``);
- CPU: seconds of a core per byte, on a CPU resource whose capacity is its cores.

Max-min fairness over the real connections: progressive filling, every unfrozen connection at
the same rate, the resource that saturates first freezing the connections that use it.

Messages queue in a connection in (priority, arrival) order; the first ``window`` bytes of it
are *committed* (in the socket: sent in order, never overtaken), the rest wait in the sender's
priority queue and are committed as the window drains (``window=None``: everything is committed
as it arrives, FIFO).  A message's callback runs when its last byte arrives (latency is the
caller's to add).
"""
import heapq
import itertools
import math

import simpy

EPS_BYTES = 1e-6


class Connection:
    __slots__ = ("net", "index", "uses", "window", "committed", "pending", "head_left",
                 "committed_bytes", "rate", "active", "sent_bytes", "name")

    def __init__(self, net, index, uses, window, name):
        self.net = net
        self.index = index
        self.uses = uses            # [(resource index, weight)]
        self.window = window
        self.committed = []         # FIFO of [bytes, callback]
        self.pending = []           # heap of (priority, seq, bytes, callback)
        self.head_left = 0.0        # bytes left of committed[0]
        self.committed_bytes = 0.0
        self.rate = 0.0
        self.active = False
        self.sent_bytes = 0.0
        self.name = name


class Network:
    """Resources, connections and the process that moves their bytes (see the module doc)."""

    def __init__(self, env: simpy.Environment):
        self.env = env
        self.capacity = []
        self.names = []
        self.used = []              # per resource: units used so far (integral of its load)
        self.conns = []
        self.active = []
        self._seq = itertools.count()
        self._dirty = False
        self._wake = env.event()
        self._last = env.now
        self.events = 0
        env.process(self._run())

    # --- building -----------------------------------------------------------------------

    def resource(self, name, capacity):
        """A shared capacity in units/s (bytes/s for a link, cores for a CPU)."""
        if not capacity > 0:
            raise ValueError("resource %s: capacity must be > 0, got %r" % (name, capacity))
        self.capacity.append(float(capacity))
        self.names.append(name)
        self.used.append(0.0)
        return len(self.capacity) - 1

    def connection(self, uses, window=None, name=""):
        """A connection using ``uses`` = [(resource, weight per byte of goodput), ...]."""
        uses = [(r, float(w)) for r, w in uses if w > 0]
        if not uses:
            raise ValueError("connection %s uses no resource" % name)
        c = Connection(self, len(self.conns), uses, window, name)
        self.conns.append(c)
        return c

    def set_capacity(self, resource, capacity):
        """A link's rate changes now (a connection on it gets its new share at once)."""
        self._advance()
        self.capacity[resource] = max(float(capacity), 1e-9)
        self._poke()

    # --- sending ------------------------------------------------------------------------

    def send(self, conn, nbytes, callback, priority=None):
        """Queue ``nbytes`` on ``conn``; ``callback()`` runs when the last byte arrived.
        ``priority``: lower goes first among the messages not yet committed (None: FIFO)."""
        self._advance()
        seq = next(self._seq)
        nbytes = max(float(nbytes), EPS_BYTES)
        heapq.heappush(conn.pending, (seq if priority is None else priority, seq, nbytes,
                                      callback))
        self._commit(conn)
        if not conn.active:
            conn.active = True
            self.active.append(conn)
            self._poke()

    def _commit(self, conn):
        w = conn.window
        while conn.pending and (w is None or not conn.committed or conn.committed_bytes < w):
            _, _, nbytes, cb = heapq.heappop(conn.pending)
            if not conn.committed:
                conn.head_left = nbytes
            conn.committed.append([nbytes, cb])
            conn.committed_bytes += nbytes

    def _poke(self):
        self._dirty = True
        if not self._wake.triggered:
            self._wake.succeed()

    # --- rates --------------------------------------------------------------------------

    def _allocate(self):
        """Max-min fair rates of the active connections (progressive filling: every unfrozen
        connection at the same level; the resource whose level ``residual / load`` is lowest
        saturates first and freezes the connections on it; a heap keeps the levels, stale
        entries skipped)."""
        residual = list(self.capacity)
        load = [0.0] * len(residual)
        users = [None] * len(residual)
        for c in self.active:
            c.rate = -1.0                       # unfrozen
            for r, w in c.uses:
                load[r] += w
                u = users[r]
                if u is None:
                    users[r] = [c]
                else:
                    u.append(c)
        heap = [(residual[r] / load[r], r) for r in range(len(load)) if users[r] is not None
                and load[r] > 1e-15]
        heapq.heapify(heap)
        left = len(self.active)
        while left and heap:
            level, r = heapq.heappop(heap)
            if users[r] is None or load[r] <= 1e-15:
                continue
            now = residual[r] / load[r]
            if now > level * (1 + 1e-12) + 1e-18:
                heapq.heappush(heap, (now, r))  # stale: its level rose since
                continue
            level = max(now, 0.0)
            touched = set()
            for c in users[r]:
                if c.rate >= 0.0:
                    continue
                c.rate = level
                left -= 1
                for q, w in c.uses:
                    residual[q] -= w * level
                    load[q] -= w
                    touched.add(q)
            users[r] = None
            for q in touched:
                if users[q] is not None and load[q] > 1e-15:
                    heapq.heappush(heap, (max(residual[q], 0.0) / load[q], q))
        for c in self.active:
            if c.rate < 0.0:
                c.rate = math.inf
        self._dirty = False

    # --- the clock ----------------------------------------------------------------------

    def _advance(self):
        """Move every active connection's head on by the time since the last advance."""
        now = self.env.now
        dt = now - self._last
        self._last = now
        if dt <= 0:
            return
        used = self.used
        for c in self.active:
            moved = c.rate * dt
            c.head_left -= moved
            c.sent_bytes += moved
            for r, w in c.uses:
                used[r] += w * moved

    def _complete(self):
        done = []
        changed = False
        for c in self.active:
            while c.committed and c.head_left <= EPS_BYTES * 1e3:
                nbytes, cb = c.committed.pop(0)
                c.committed_bytes -= nbytes
                extra = c.head_left         # <= 0: overshoot goes to the next message
                self._commit(c)
                if c.committed:
                    c.head_left = c.committed[0][0] + extra
                done.append(cb)
            if not c.committed:
                c.active = False
                changed = True
        if changed:
            self.active = [c for c in self.active if c.active]
            self._dirty = True
        for cb in done:
            cb()

    def _run(self):
        env = self.env
        while True:
            if not self.active:
                yield self._wake
                self._wake = env.event()
                self._advance()
                continue
            if self._dirty:
                self._allocate()
            dt = math.inf
            for c in self.active:
                if c.rate > 0:
                    t = c.head_left / c.rate
                    if t < dt:
                        dt = t
            self.events += 1
            if dt == math.inf:
                yield self._wake
            else:
                yield env.timeout(max(dt, 0.0)) | self._wake
            self._advance()
            self._complete()
            if self._wake.triggered:
                self._wake = env.event()    # what it signalled is in self._dirty
