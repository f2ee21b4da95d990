"""The systems the simulator knows, by the bench's names, and how each places keys and sends.

Placement is the runtime's own code (``mxps.placement``): MXNet's rule (``mxnet_default_rule``)
for native, its chunked form for ``mxps-default``, the bandwidth-proportional split and the
live re-planner (``adaptive.split_table``, ``adaptive.Replanner``) for ``mxps-adaptive``.  P3's
slicing is MXNet 1.9.1's ``P3StoreDist::EncodeDefaultKey`` (src/kvstore/p3store_dist.h): every
key cut into slices of ``MXNET_KVSTORE_SLICE_THRESHOLD`` (40000) elements, the slices dealt to
the servers round-robin by one counter over all keys in the order they are first encoded.

Sending: native pushes each key as its gradient is ready (the engine's order), first come first
sent; P3's van sends the queued message of highest priority first (Gluon's priority ``-key``:
key 0 first), with about one slice in the socket; mxps's I/O thread keeps a priority queue per
server and at most ``MXPS_SEND_WINDOW`` bytes (1 MiB) in each server's socket.
"""
import dataclasses
from typing import Optional

from .. import runtime

P3_SLICE_ELEMENTS = 40 * 1000
MXPS_SEND_WINDOW = 1 << 20


class SystemError_(ValueError):
    """A system the simulator does not model (the message says which it does)."""


@dataclasses.dataclass(frozen=True)
class SimSystem:
    name: str
    kind: str                 # "native" (ps-lite's costs) or "mxps"
    placement: str            # "native", "p3", "chunked", "adaptive"
    push: str = "tcp"         # "tcp" or "ltp"
    priority: bool = False    # send the queued message of the lowest key first
    window: Optional[int] = None   # bytes committed to a socket ahead of the priority queue
    secret: bool = True
    max_chunk: Optional[int] = None


BASE = {
    "native": SimSystem("native", "native", "native"),
    "native-p3": SimSystem("native-p3", "native", "p3", priority=True,
                           window=P3_SLICE_ELEMENTS * 4),
    "mxps-default": SimSystem("mxps-default", "mxps", "chunked", priority=True,
                              window=MXPS_SEND_WINDOW),
    "mxps-unchunked": SimSystem("mxps-unchunked", "mxps", "native", priority=True,
                                window=MXPS_SEND_WINDOW, max_chunk=0),
    "mxps-adaptive": SimSystem("mxps-adaptive", "mxps", "adaptive", priority=True,
                               window=MXPS_SEND_WINDOW),
    "mxps-ltp": SimSystem("mxps-ltp", "mxps", "chunked", push="ltp", priority=True,
                          window=MXPS_SEND_WINDOW),
    "mxps-adaptive-ltp": SimSystem("mxps-adaptive-ltp", "mxps", "adaptive", push="ltp",
                                   priority=True, window=MXPS_SEND_WINDOW),
}

#: settings a ``NAME:VAR=VALUE`` system may carry, and what they change in the model
_SETTINGS = {
    "MXPS_SECRET": lambda s, v: dataclasses.replace(s, secret=bool(v)),
    "MXPS_MAX_CHUNK": lambda s, v: dataclasses.replace(s, max_chunk=int(v)),
    "MXPS_SEND_WINDOW": lambda s, v: dataclasses.replace(s, window=int(v)),
    "MXPS_PUSH": lambda s, v: dataclasses.replace(s, push=v),
}


def system(name):
    """A system by the bench's name, ``NAME[:VAR=VALUE...]`` with the settings above."""
    base, *settings = name.split(":")
    if base not in BASE:
        raise SystemError_("unknown system %r; the simulator models %s" % (
            base, ", ".join(BASE)))
    s = dataclasses.replace(BASE[base], name=name)
    for item in settings:
        var, eq, value = item.partition("=")
        if not eq or var not in _SETTINGS:
            raise SystemError_("system %r: %r is not modelled; settings the simulator takes: "
                               "%s" % (name, item, ", ".join("%s=..." % k for k in _SETTINGS)))
        s = _SETTINGS[var](s, value)
    if s.push not in ("tcp", "ltp"):
        raise SystemError_("system %r: MXPS_PUSH must be tcp or ltp" % name)
    return s


def _placement():
    return runtime.module("placement.plan"), runtime.module("placement.adaptive")


def default_max_chunk(num_workers):
    return runtime.module("config").default_max_chunk(num_workers)


def initial_table(sys_, sizes, num_servers, num_workers, link_rates, bigarray_bound=1000 * 1000,
                  min_slice=16384):
    """``{key: [(server, offset, length), ...]}`` the system starts with; ``link_rates``: each
    server's rate in bytes/s (what mxps-adaptive's start-up probe measures)."""
    plan, adaptive = _placement()
    chunk = default_max_chunk(num_workers) if sys_.max_chunk is None else sys_.max_chunk
    if sys_.placement == "native":
        rule = plan.mxnet_default_rule
        return {k: rule(k, n, num_servers, bigarray_bound) for k, n in enumerate(sizes)}
    if sys_.placement == "chunked":
        rule = plan.chunked_rule(chunk)
        return {k: rule(k, n, num_servers, bigarray_bound) for k, n in enumerate(sizes)}
    if sys_.placement == "adaptive":
        held = [2.0 * r / (2.0 * num_workers) for r in link_rates]
        return adaptive.split_table(list(enumerate(sizes)), held, min_slice, chunk)
    if sys_.placement == "p3":
        out, server = {}, 0
        for k, n in enumerate(sizes):
            slices, off = [], 0
            while off < n or (n == 0 and not slices):
                length = min(P3_SLICE_ELEMENTS, n - off)
                slices.append(plan.Slice(server % num_servers, off, length))
                off += length
                server += 1
                if n == 0:
                    break
            out[k] = tuple(slices)
        return out
    raise SystemError_("placement %r" % sys_.placement)
