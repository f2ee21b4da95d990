"""Placement: which server holds which element range of which key.

A ``Plan`` maps every key to a tuple of ``Slice``s (server, offset, length) that cover the key's
flat array exactly once, in order, with at most one slice per server per key.  It carries a
version; every data message names the plan version it was built with.  Plans are pure data: the
transport routes by them and never decides placement (ps-lite's ``set_slicer`` seam).

``mxnet_default_rule`` is MXNet 1.9.1's own placement (src/kvstore/kvstore_dist.h, EncodeKey):
an array with fewer than ``MXNET_KVSTORE_BIGARRAY_BOUND`` elements goes whole to server
``(key * 9973) % num_servers``; a larger one is cut into ``num_servers`` parts, part i covering
``[round(size/S*i), round(size/S*(i+1)))`` (C ``round``: halves away from zero) on server i.
"""
import dataclasses
import math

from .failover import successors


class PlanError(ValueError):
    """A plan that does not place every element of a key exactly once."""


@dataclasses.dataclass(frozen=True)
class Slice:
    server: int
    offset: int
    length: int

    @property
    def stop(self):
        return self.offset + self.length


def _c_round(x):
    # C's round(): halfway cases away from zero (Python's round() rounds half to even).
    # Not floor(x + 0.5): that addition itself rounds 0.49999999999999994 up to 1.0.
    a = abs(x)
    f = math.floor(a)
    r = int(f) + (1 if a - f >= 0.5 else 0)
    return r if x >= 0 else -r


def mxnet_default_rule(key, size, num_servers, bigarray_bound):
    """MXNet's placement of one key (see the module docstring)."""
    if size < bigarray_bound:
        return (Slice((key * 9973) % num_servers, 0, size),)
    parts = []
    for i in range(num_servers):
        lo = _c_round(size / num_servers * i)
        hi = _c_round(size / num_servers * (i + 1))
        parts.append(Slice(i, lo, hi - lo))
    return tuple(p for p in parts if p.length > 0)


def check_slices(key, size, slices, num_servers, one_per_server=True):
    """Raise PlanError unless ``slices`` cover [0, size) exactly once, in order (and, with
    ``one_per_server``, at most one slice per server).

    A key with no elements is one empty slice (it still has an owner, as in MXNet)."""
    if size == 0:
        if len(slices) != 1 or slices[0].length != 0 or slices[0].offset != 0 \
                or not 0 <= slices[0].server < num_servers:
            raise PlanError("key %r has no elements: expected one empty slice, got %s"
                            % (key, slices))
        return
    pos = 0
    seen = set()
    for s in slices:
        if not 0 <= s.server < num_servers:
            raise PlanError("key %r: slice on server %d, only %d servers" % (key, s.server,
                                                                             num_servers))
        if one_per_server and s.server in seen:
            raise PlanError("key %r: two slices on server %d" % (key, s.server))
        seen.add(s.server)
        if s.offset != pos or s.length <= 0:
            raise PlanError("key %r: slice %s does not continue at element %d" % (key, s, pos))
        pos = s.stop
    if pos != size:
        raise PlanError("key %r: slices cover %d of %d elements" % (key, pos, size))


def table_to_json(table):
    """A table ``{key: (Slice, ...)}`` as JSON-able data (keys as strings)."""
    return {str(k): [[s.server, s.offset, s.length] for s in v] for k, v in table.items()}


def table_from_json(obj):
    """The inverse of ``table_to_json``."""
    return {int(k): tuple(Slice(*map(int, x)) for x in v) for k, v in obj.items()}


class Plan:
    """A versioned placement table; keys not in the table are placed by ``rule`` on first use."""

    def __init__(self, num_servers, version=0, table=None, bigarray_bound=1000 * 1000,
                 rule=mxnet_default_rule):
        if num_servers < 1:
            raise PlanError("a plan needs at least one server, got %d" % num_servers)
        self.num_servers = num_servers
        self.version = version
        self.bigarray_bound = bigarray_bound
        self._rule = rule
        self._table = {}
        self._sizes = {}
        # servers lost to a failover (placement.failover): a key placed later by ``rule``
        # puts their slices on the survivors the same way
        self.lost = frozenset()
        for key, slices in (table or {}).items():
            slices = tuple(slices)
            size = sum(x.length for x in slices)
            check_slices(key, size, slices, num_servers, one_per_server=False)
            self._table[key] = slices
            self._sizes[key] = size

    def slices(self, key, size):
        """The slices of ``key`` (an int id) whose flat array has ``size`` elements."""
        s = self._table.get(key)
        if s is None:
            s = self._rule(key, size, self.num_servers, self.bigarray_bound)
            check_slices(key, size, s, self.num_servers, one_per_server=False)
            if self.lost and any(x.server in self.lost for x in s):
                s = successors({key: s}, self.lost, self.num_servers)[0][key]
            self._table[key] = s
            self._sizes[key] = size
        elif self._sizes[key] != size:
            raise PlanError("key %r has %d elements, the plan places %d"
                            % (key, size, self._sizes[key]))
        return s

    def keys(self):
        return self._table.keys()

    def table(self):
        """The placement of every key placed so far, ``{key: (Slice, ...)}``."""
        return dict(self._table)

    def replaced(self, version, table):
        """A plan of ``version`` placing ``table``'s keys as it says (the rest as this one)."""
        new = Plan(self.num_servers, version, table, self.bigarray_bound, self._rule)
        new.lost = self.lost
        for key, slices in self._table.items():
            if key not in new._table:
                new._table[key] = slices
                new._sizes[key] = self._sizes[key]
        return new

    def without(self, version, lost, buddies=False, alive=False):
        """The plan of ``version`` after ``lost`` (server ranks) are gone, and {(key,
        offset): successor} of the slices that moved (``placement.failover``; ``buddies``:
        to each lost server's buddy, MXPS_REPLICA).  ``alive`` (MXPS_DIVERT): the servers
        are slow, not gone; they hold nothing now, and later plans may place on them."""
        gone = self.lost | frozenset(lost)
        table, moved = successors(self._table, gone, self.num_servers, buddies)
        new = Plan(self.num_servers, version, table, self.bigarray_bound, self._rule)
        new.lost = self.lost if alive else gone
        return new, moved

    def elements_per_server(self):
        """Total elements each server holds under this plan (for bytes-per-server reports)."""
        out = [0] * self.num_servers
        for slices in self._table.values():
            for s in slices:
                out[s.server] += s.length
        return out


def chunked_rule(max_chunk):
    """MXNet's placement with every server's part of a key cut into consecutive chunks of at
    most ``max_chunk`` elements (``MXPS_PLAN=chunked``): the same servers hold the same
    elements as under ``mxnet_default_rule``, but a server answers a chunk as soon as every
    worker pushed it, as the adaptive plan's chunks do.  With it, a comparison against the
    adaptive plan measures placement alone, not pipelining."""
    max_chunk = max(0, int(max_chunk))

    def rule(key, size, num_servers, bigarray_bound):
        out = []
        for s in mxnet_default_rule(key, size, num_servers, bigarray_bound):
            n = 1 if not max_chunk else max(1, -(-s.length // max_chunk))
            bounds = [s.offset + s.length * j // n for j in range(n + 1)]
            out.extend(Slice(s.server, a, b - a) for a, b in zip(bounds, bounds[1:]))
        return tuple(out)
    return rule


class ProportionalRule:
    """Bandwidth-proportional placement, decided key by key as keys are initialised.

    Keys reach the kvstore one at a time (Gluon's Trainer initialises them one by one), and a
    key's placement cannot change once its value is on the servers (until a live re-plan), so
    the rule is online and deterministic: every worker builds it from the same rates and sees
    the keys in the same order, so every worker computes the same plan without talking.

    - A key of at least ``2 * min_slice`` elements is cut into contiguous slices, one per
      server in rank order, sized in proportion to what each server still lacks of its
      rate-proportional share of all bytes placed so far; a server whose slice would be under
      ``min_slice`` elements gets none (its part goes to the others).
    - A smaller key goes whole to the server furthest below its share of the bytes placed so
      far (``rate_s / sum(rates) * placed - load_s``), the lowest rank on ties.

    So each server's load stays proportional to its rate within one small key (or, for a cut
    key, the parts of the servers whose slice would fall under ``min_slice``).  With
    ``max_chunk`` a server's part of a key is further cut into consecutive chunks of at most
    that many elements (each chunk is its own slot on the server, see roles.server_state.optimizer_index):
    the first chunk's pull then overlaps the later chunks' pushes.
    """

    def __init__(self, rates, min_slice=16384, max_chunk=0):
        if not rates or any(not r > 0 for r in rates):
            raise PlanError("server rates must all be positive, got %s" % (list(rates),))
        total = float(sum(rates))
        self.shares = [r / total for r in rates]
        self.min_slice = max(1, int(min_slice))
        self.max_chunk = max(0, int(max_chunk))
        self.loads = [0] * len(rates)

    def __call__(self, key, size, num_servers, bigarray_bound):
        if num_servers != len(self.shares):
            raise PlanError("rates for %d servers, plan for %d" % (len(self.shares), num_servers))
        if size < 2 * self.min_slice:
            placed = sum(self.loads) + size
            s = max(range(num_servers),
                    key=lambda i: (self.shares[i] * placed - self.loads[i], -i))
            self.loads[s] += size
            return (Slice(s, 0, size),)
        # cut in proportion to what each server still needs to reach its share of everything
        # placed so far (this key included), so earlier rounding and small keys even out
        placed = sum(self.loads) + size
        need = [max(0.0, self.shares[i] * placed - self.loads[i]) for i in range(num_servers)]
        if sum(need) <= 0:
            need = list(self.shares)
        servers = [i for i in range(num_servers) if need[i] > 0]
        while True:
            total = sum(need[i] for i in servers)
            want = {i: size * need[i] / total for i in servers}
            # cuts are rounded cumulative sums, so a slice is within one element of its want:
            # a want under min_slice + 1 could round below min_slice
            small = [i for i in servers if want[i] < self.min_slice + 1]
            if not small or len(servers) == 1:
                break
            servers.remove(min(small, key=lambda i: (want[i], -i)))
        slices, pos, cum = [], 0, 0.0
        for n, i in enumerate(servers):
            cum += want[i]
            stop = size if n == len(servers) - 1 else _c_round(cum)
            slices.extend(self._chunks(i, pos, stop))
            self.loads[i] += stop - pos
            pos = stop
        return tuple(slices)

    def _chunks(self, server, start, stop):
        # a server's part of a key, in consecutive chunks of at most max_chunk elements (as
        # even as possible): the server answers a chunk as soon as every worker pushed it,
        # while the next chunks are still arriving
        n = 1 if not self.max_chunk else -(-(stop - start) // self.max_chunk)
        bounds = [start + (stop - start) * j // n for j in range(n + 1)]
        return [Slice(server, a, b - a) for a, b in zip(bounds, bounds[1:])]
