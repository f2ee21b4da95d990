"""The bench's scenarios as simulator inputs: links, slow ranks, moves, loss, incast.

The vocabulary is ``mxps bench``'s (mxps_tools/bench.py): ``homogeneous`` (every link at R),
``static`` (server rank r at R/k, once per rank of ``--slow-rank``), ``dynamic`` (the slow link
moves to the next server rank every ``--period`` seconds from worker 0's first timed step, or
every ``--period-steps`` timed steps), ``incast`` (every link at R, the switch's queue shallow:
the calibrated many-to-one term applies to TCP pushes), ``--schedule FILE`` (``[[t, {node:
rate}], ...]``, t seconds from the start, node ``s<i>``/``rank:<i>`` a server, rate Mbit/s).
Server ranks are the plan's ranks (the simulator has no start order to confuse them with).
"""
import dataclasses
import json
from typing import List, Optional

from .job import WorkerClass


def mbit(x):
    return float(x) * 1e6 / 8.0


class ScenarioError(ValueError):
    """A scenario the simulator cannot build (the message says why)."""


@dataclasses.dataclass
class Options:
    scenario: str = "static"
    num_workers: int = 4
    num_servers: int = 4
    model: str = "resnet18_v1"
    mlp_hidden: Optional[int] = None
    rate: float = 400.0
    slow_rank: str = "all"
    slow_factor: float = 4.0
    slow_servers: Optional[float] = None    # a share of the servers slow (predictions)
    period: float = 15.0
    period_steps: Optional[int] = None
    schedule: Optional[str] = None
    loss: float = 0.0
    mtu: int = 1500
    queue_ms: Optional[float] = None
    steps: Optional[int] = None
    warmup: int = 3
    compute: Optional[float] = None
    shared_cores: Optional[float] = None
    node_cores: float = 1.0
    systems: tuple = ("native", "native-p3", "mxps-default", "mxps-adaptive")


@dataclasses.dataclass
class Variant:
    tag: str
    scenario: str
    server_rates: List[float]
    changes: list                 # (seconds after worker 0's first timed step, {rank: rate})
    step_changes: list            # (round, {rank: rate})
    slow_rank: Optional[int] = None


def default_steps(o):
    if o.steps:
        return o.steps
    if o.scenario == "dynamic":
        if o.period_steps:
            return max(4 * o.period_steps, 3 * o.period_steps + 3)
        return 24
    return 8


def slow_ranks(o, elements=None):
    """The ranks of ``--slow-rank``: numbers, ``all``, ``heaviest``/``lightest`` (most / fewest
    elements under MXNet's placement, ``elements`` per rank)."""
    out = []
    for item in str(o.slow_rank).split(","):
        item = item.strip()
        if item == "all":
            out.extend(range(o.num_servers))
        elif item in ("heaviest", "lightest"):
            if elements is None:
                raise ScenarioError("--slow-rank %s needs the model's sizes" % item)
            pick = max if item == "heaviest" else min
            out.append(pick(range(o.num_servers), key=lambda s: (elements[s], -s)))
        else:
            try:
                r = int(item)
            except ValueError:
                raise ScenarioError("--slow-rank %r: a rank, all, heaviest or lightest"
                                    % item) from None
            if not 0 <= r < o.num_servers:
                raise ScenarioError("--slow-rank %d: only %d servers" % (r, o.num_servers))
            out.append(r)
    return list(dict.fromkeys(out))


def variants(o, elements=None):
    """The runs a scenario makes (static: one per slow rank)."""
    R = mbit(o.rate)
    slow = R / o.slow_factor
    S = o.num_servers
    base = [R] * S
    if o.slow_servers:
        n = max(1, int(round(o.slow_servers * S)))
        base = [slow if s < n else R for s in range(S)]
    if o.schedule:
        try:
            with open(o.schedule) as f:
                events = json.load(f)
        except (OSError, ValueError) as e:
            raise ScenarioError("--schedule %s: %s" % (o.schedule, e)) from None
        changes, first = [], list(base)
        for t, rates in events:
            per = {}
            for node, rate in rates.items():
                s = _server_of(node, S)
                if s is None:
                    continue            # a worker's link: the model's workers are alike
                per[s] = mbit(rate[0] if isinstance(rate, list) else rate) if rate else R * 100
            if float(t) <= 0:
                for s, r in per.items():
                    first[s] = r
            else:
                changes.append((float(t), per))
        return [Variant("schedule", "schedule", first, [(t, p) for t, p in changes], [])]
    if o.scenario in ("homogeneous", "incast"):
        return [Variant(o.scenario, o.scenario, base, [], [])]
    if o.scenario == "static":
        return [Variant("static-rank%d" % r, "static",
                        [slow if s == r else R for s in range(S)], [], [], r)
                for r in slow_ranks(o, elements)]
    if o.scenario == "dynamic":
        first = [slow if s == 0 else R for s in range(S)]
        moves = []
        steps = default_steps(o)
        if o.period_steps:
            r, i = o.warmup + o.period_steps, 1
            while r <= o.warmup + steps - 3:
                moves.append((r, {(i - 1) % S: R, i % S: slow}))
                r += o.period_steps
                i += 1
            return [Variant("dynamic", "dynamic", first, [], moves)]
        # enough moves for any run: the job ends them when it ends
        for i in range(1, 200):
            moves.append((o.period * i, {(i - 1) % S: R, i % S: slow}))
        return [Variant("dynamic", "dynamic", first, moves, [])]
    raise ScenarioError("unknown scenario %r: homogeneous, static, dynamic or incast"
                        % o.scenario)


def _server_of(node, S):
    node = str(node)
    if node.startswith("rank:"):
        s = int(node.split(":", 1)[1])
    elif node.startswith("s") and node[1:].isdigit():
        s = int(node[1:])
    else:
        return None
    if not 0 <= s < S:
        raise ScenarioError("schedule names server %s: only %d servers" % (node, S))
    return s


def worker_classes(o, compute_s):
    """The bench's workers: every link at R (no scenario slows a worker's), one class."""
    R = mbit(o.rate)
    return [WorkerClass("w", o.num_workers, R, R, compute_s)]
