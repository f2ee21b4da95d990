"""A synchronous data-parallel job on a parameter server, step by step, on the fluid network.

Workers that are alike (same links, same compute) behave alike, so the model keeps one
representative per *class* of workers and weighs its connections by the class's size on the
links the class shares (``fluid``): 256 workers of one kind cost what one does.

A step of a worker: forward (a third of the measured compute-only step), then backward, which
makes each key's gradient ready in the reverse of the layer order, in proportion to the keys'
sizes; a ready key's slices are queued on the connections to their servers, in the system's
order (``systems``).  A server takes each push on its one I/O thread (``cpu_s_per_message`` per
message, serially), and when every worker has pushed a slice it answers that slice's pulls
(one message per worker; ps-lite acknowledges the pushes instead, and each worker's pull
request follows the acknowledgement).  A worker's step ends when its last pull has arrived
and its backward is done (the bench job waits for every parameter before the next step:
forward never overlaps the pulls).  A message arrives ``latency`` after its last byte leaves.

mxps-adaptive starts on the split of its start-up probe (the links' rates) and, after every
round, gives the runtime's ``Replanner`` what the workers measured (bytes through each server
over the slowest worker's busy span, per round); a table it adopts is put in place at a
stopped point: the slices that change server move server to server (weights and momentum),
the workers wait for it.
"""
import math

import simpy

from .. import runtime
from .fluid import Network
from .systems import initial_table, default_max_chunk

ELEMENT_BYTES = 4
#: bytes on the wire beside a message's payload (ps-lite / mxps headers; a sealed message's
#: nonce and tag): small against any slice, named so that it is not a hidden zero
MESSAGE_HEADER_BYTES = 64
#: SGD with momentum (the bench job's optimizer): a moved slice carries weights and momentum
STATE_COPIES = 2.0


class WorkerClass:
    def __init__(self, name, count, up, down, compute_s):
        self.name, self.count, self.up, self.down = name, int(count), float(up), float(down)
        self.compute_s = float(compute_s)


class Job:
    """One system's run of ``rounds`` steps; ``run()`` returns per-class step start/end times."""

    def __init__(self, system, model, classes, server_rates, calib, *, loss_pct=0.0, mtu=1500,
                 incast=False, shared_cores=None, node_cores=1.0, warmup=3, steps=8,
                 changes=(), step_changes=(), fwd_share=1.0 / 3.0):
        self.sys = system
        self.model = model
        self.classes = classes
        self.S = len(server_rates)
        self.W = sum(c.count for c in classes)
        self.calib = calib
        self.loss = float(loss_pct)
        self.mtu = int(mtu)
        self.incast = incast
        self.warmup, self.steps = int(warmup), int(steps)
        self.rounds = self.warmup + self.steps
        self.fwd_share = fwd_share
        self.env = simpy.Environment()
        self.net = Network(self.env)
        # a message's delay: the idle path's, plus the queue a loaded link holds (measured in
        # bytes at one rate, so it lasts longer on a slower link)
        self.lat = calib.latency_s
        self.queue_bytes = calib.loaded_queue_bytes
        self.changes = sorted(changes, key=lambda x: x[0])   # (seconds after the first timed
        self.step_changes = list(step_changes)                # step, {node: rate}); by step
        self.server_rates = [float(r) for r in server_rates]
        sizes = model.keys
        self.sizes = sizes
        self.table = {k: tuple(v) for k, v in initial_table(
            system, sizes, self.S, self.W, self.server_rates).items()}
        self.planner = None
        self.plan_versions = [0]
        self.moves = []
        if system.placement == "adaptive":
            adaptive = runtime.module("placement.adaptive")
            self.planner = adaptive.Replanner(self.S, self.W,
                                              rates=[2.0 * r for r in self.server_rates])
        self._build_network(shared_cores, node_cores)
        # backward: each key's ready time as a share of the backward pass
        order = model.backward_order()
        total = float(sum(sizes)) or 1.0
        cum, self.ready_share = 0.0, {}
        for k in order:
            cum += sizes[k]
            self.ready_share[k] = cum / total
        self.order = order
        self.starts = [[] for _ in classes]
        self.ends = [[] for _ in classes]
        self.rate_log = []          # (sim time, node, rate bytes/s)
        self.first_timed_end = None
        self._first_timed = self.env.event()    # worker 0 ended its first timed step
        self._done = False
        self._waiting = {}          # round -> the classes' events at its point
        self._ended = set()
        self._agg = {}              # (round, key, slice) -> classes whose push is taken
        self._rstate = {}           # (class, round) -> that round's bookkeeping
        self._reports = {}          # round -> class -> per server [bytes, busy seconds]

    # --- the network ------------------------------------------------------------------

    def _build_network(self, shared_cores, node_cores):
        net, c = self.net, self.calib
        kind, secret = self.sys.kind, self.sys.secret
        tcp_eff = c.header_efficiency(self.mtu, "tcp")
        ltp_eff = c.header_efficiency(self.mtu, "ltp")
        cw = c.cpu_per_byte(kind, "worker", secret)
        cs = c.cpu_per_byte(kind, "server", secret)
        self.msg_cost = c.message_cost(kind, "server")
        self.worker_msg_cost = c.message_cost(kind, "worker")
        host = net.resource("host cpu", shared_cores) if shared_cores else None
        # on one machine its emulated network's softirq work (veths, bridge, tbf) per byte:
        # with offloads off where it drops packets (loss, a shallow queue: emunet's
        # per_packet), on otherwise
        per_packet = self.loss > 0 or self.incast
        cn = c.emunet_cpu_per_byte(per_packet) if host is not None else 0.0
        self.s_up = [net.resource("s%d up" % s, r) for s, r in enumerate(self.server_rates)]
        self.s_down = [net.resource("s%d down" % s, r) for s, r in enumerate(self.server_rates)]
        s_cpu = [host or net.resource("s%d cpu" % s, node_cores) for s in range(self.S)]
        # per server: bytes one worker pushes there per step (the incast term's message)
        per_server = [0.0] * self.S
        for k, slices in self.table.items():
            for sl in slices:
                per_server[sl.server] += sl.length * ELEMENT_BYTES
        self.push, self.pull = [], []
        w_cpus = []
        ltp = self.sys.push == "ltp"
        if ltp:
            payload = self.mtu - 60
            cw_push = cw + c.data["ltp_cpu_s_per_datagram"]["sender"] / payload
            cs_push = cs + c.data["ltp_cpu_s_per_datagram"]["receiver"] / payload
        for ci, wc in enumerate(self.classes):
            m = wc.count
            up = net.resource("%s up" % wc.name, wc.up)
            down = net.resource("%s down" % wc.name, wc.down)
            w_cpu = host or net.resource("%s cpu" % wc.name, node_cores)
            w_cpus.append(w_cpu)
            wmul = m if host is not None else 1
            pushes, pulls = [], []
            for s in range(self.S):
                if ltp:
                    e = ltp_eff * c.push_efficiency("ltp", self.loss, max(per_server[s], 1),
                                                    mtu=self.mtu)
                    pw, ps_ = cw_push, cs_push
                else:
                    e = tcp_eff * self._tcp_push_efficiency(
                        per_server[s], min(wc.up, self.server_rates[s]))
                    pw, ps_ = cw, cs
                uses = [(up, 1.0 / e), (self.s_down[s], m / e), (w_cpu, wmul * pw),
                        (s_cpu[s], m * ps_)]
                if host is not None:
                    uses = [(up, 1.0 / e), (self.s_down[s], m / e), (host, m * (pw + ps_ + cn))]
                pushes.append(net.connection(uses, self.sys.window, "push %s>s%d" % (wc.name, s)))
                # a pull is TCP from one server to many workers: no incast, no loss (the
                # scenarios drop packets towards the servers), TCP's own round dynamics
                e = tcp_eff * c.push_efficiency("tcp", 0.0, max(per_server[s], 1),
                                                "push_rounds",
                                                rate=min(self.server_rates[s], wc.down))
                uses = [(self.s_up[s], m / e), (down, 1.0 / e), (w_cpu, wmul * cw),
                        (s_cpu[s], m * cs)]
                if host is not None:
                    uses = [(self.s_up[s], m / e), (down, 1.0 / e), (host, m * (cw + cs + cn))]
                pulls.append(net.connection(uses, None, "pull s%d>%s" % (s, wc.name)))
            self.push.append(pushes)
            self.pull.append(pulls)
            wc.up_res, wc.down_res = up, down
        # compute: on one shared host the workers' compute and every process's communication
        # share its cores (the measured compute-only step had the W workers competing: each
        # worker's step is compute_s x min(cores, W) / W CPU-seconds, one worker alone may use
        # every core); on a cluster each worker computes on its own (an accelerator, or cores
        # the I/O thread does not use): compute_s seconds, whatever the traffic
        self.compute = []
        for ci, wc in enumerate(self.classes):
            if host is not None:
                own = net.resource("%s compute" % wc.name, shared_cores)
                uses = [(host, wc.count), (own, 1.0)]
            else:
                uses = [(net.resource("%s compute" % wc.name, 1.0), 1.0)]
            self.compute.append(net.connection(uses, None, "compute %s" % wc.name))
        # the I/O threads: per-message CPU, one message at a time (one core), on the node's
        # cores (the shared machine's, or its own)
        self.worker_io = []
        for ci, wc in enumerate(self.classes):
            thread = net.resource("%s io thread" % wc.name, 1.0)
            cpu = [(host, float(wc.count))] if host is not None else [(w_cpus[ci], 1.0)]
            self.worker_io.append(net.connection([(thread, 1.0)] + cpu, None,
                                                 "io %s" % wc.name))
        self.server_io = []
        for s in range(self.S):
            thread = net.resource("s%d io thread" % s, 1.0)
            self.server_io.append(net.connection([(thread, 1.0), (s_cpu[s], 1.0)], None,
                                                 "io s%d" % s))
        self.cpu_per_compute_s = (min(shared_cores, self.W) / float(self.W)
                                  if host is not None else 1.0)
        self.peer = {}
        self._tcp_eff = tcp_eff
        self._s_cpu, self._cs = s_cpu, cs

    def _tcp_push_efficiency(self, nbytes, rate):
        """A TCP push's goodput share through the switch at the path's ``rate`` (bytes/s,
        where the links start): the calibrated many-to-one term with the switch's shallow
        queue (incast), else TCP's own dynamics and what random loss adds to them."""
        if self.incast:
            return self.calib.push_efficiency("tcp", self.loss, nbytes, mtu=self.mtu,
                                              rate=rate)
        return self.calib.push_efficiency("tcp", self.loss, nbytes, "push_rounds", rate=rate)

    def _delay(self, ci, s, push):
        """A message's delay from its last byte out to its arrival: the idle path's latency
        and the loaded queue's bytes at the slower of the two links it crosses."""
        wc = self.classes[ci]
        cap = self.net.capacity
        rate = min(cap[wc.up_res], cap[self.s_down[s]]) if push else \
            min(cap[self.s_up[s]], cap[wc.down_res])
        return self.lat + self.queue_bytes / rate

    def _peer(self, a, b):
        key = (a, b)
        if key not in self.peer:
            self.peer[key] = self.net.connection(
                [(self.s_up[a], 1.0 / self._tcp_eff), (self.s_down[b], 1.0 / self._tcp_eff)],
                None, "move s%d>s%d" % (a, b))
        return self.peer[key]

    def set_server_rate(self, s, rate):
        self.net.set_capacity(self.s_up[s], rate)
        self.net.set_capacity(self.s_down[s], rate)
        self.server_rates[s] = rate
        self.rate_log.append((self.env.now, "rank:%d" % s, rate))

    # --- a round ----------------------------------------------------------------------

    def _later(self, delay, fn):
        ev = self.env.timeout(max(delay, 0.0))
        ev.callbacks.append(lambda _e: fn())

    def run(self):
        env = self.env
        for ci in range(len(self.classes)):
            env.process(self._worker(ci))
        env.process(self._clock())
        env.run()
        return self

    def _clock(self):
        """The scenario's rate changes, in seconds after worker 0's first timed step."""
        if not self.changes:
            return
        yield self._first_timed
        t0 = self.first_timed_end
        for t, rates in self.changes:
            wait = t0 + t - self.env.now
            if wait > 0:
                yield self.env.timeout(wait)
            if self._done:
                return
            for s, r in rates.items():
                self.set_server_rate(s, r)

    def _worker(self, ci):
        for r in range(self.rounds):
            if self.planner is not None or self.step_changes:
                yield self._barrier(r)
            yield from self._round(ci, r)
        self._arrived_at_end(ci)

    # rounds are kept in step by a barrier where the job stops at a point (mxps-adaptive)
    def _barrier(self, r):
        ev = self.env.event()
        self._waiting.setdefault(r, []).append(ev)
        if len(self._waiting[r]) == len(self.classes):
            self.env.process(self._point(r, self._waiting.pop(r)))
        return ev

    def _point(self, r, events):
        if r > 0 and self.planner is not None:
            yield from self._replan(r)
        for rr, rates in self.step_changes:
            if rr == r:
                for s, rate in rates.items():
                    self.set_server_rate(s, rate)
        for ev in events:
            ev.succeed()

    def _arrived_at_end(self, ci):
        self._ended.add(ci)
        if len(self._ended) == len(self.classes):
            self._done = True

    def _round(self, ci, r):
        env, wc = self.env, self.classes[ci]
        start = env.now
        self.starts[ci].append(start)
        state = {"left": 0, "backward_done": False, "done": env.event(),
                 "first": [None] * self.S, "last": [0.0] * self.S, "bytes": [0.0] * self.S}
        table = self.table
        for k in self.order:
            state["left"] += len(table[k])
        self._rstate[(ci, r)] = state
        # the compute, as work on the compute connection: forward, then each key's share of
        # backward in backward order; a key's gradient goes out when its share is done
        work = wc.compute_s * self.cpu_per_compute_s
        conn = self.compute[ci]
        self.net.send(conn, work * self.fwd_share, lambda: None)
        prev = 0.0
        for k in self.order:
            share = self.ready_share[k]
            self.net.send(conn, work * (1 - self.fwd_share) * (share - prev),
                          lambda k=k: self._push_key(ci, r, k))
            prev = share
        self.net.send(conn, 1e-12, lambda: self._backward_done(ci, r))
        yield state["done"]
        end = env.now
        self.ends[ci].append(end)
        if ci == 0 and r == self.warmup and self.first_timed_end is None:
            self.first_timed_end = end
            self._first_timed.succeed()
        rep = {}
        for s in range(self.S):
            span = (state["last"][s] - state["first"][s]) if state["first"][s] is not None else 0
            rep[s] = [state["bytes"][s] * wc.count, span]
        self._reports.setdefault(r, {})[ci] = rep
        del self._rstate[(ci, r)]

    def _backward_done(self, ci, r):
        st = self._rstate[(ci, r)]
        st["backward_done"] = True
        self._maybe_done(st)

    def _maybe_done(self, st):
        if st["left"] == 0 and st["backward_done"] and not st["done"].triggered:
            st["done"].succeed()

    def _push_key(self, ci, r, k):
        """Key ``k``'s gradient is ready: its slices go through the worker's I/O thread (its
        CPU per message, in turn) and out."""
        env = self.env
        st = self._rstate[(ci, r)]
        for idx, sl in enumerate(self.table[k]):
            nbytes = sl.length * ELEMENT_BYTES + MESSAGE_HEADER_BYTES
            s = sl.server
            prio = k if self.sys.priority else None

            def send(s=s, nbytes=nbytes, prio=prio, idx=idx):
                if st["first"][s] is None:
                    st["first"][s] = env.now
                st["bytes"][s] += nbytes
                self.net.send(self.push[ci][s], nbytes,
                              lambda: self._later(self._delay(ci, s, True),
                                                  lambda: self._pushed(ci, r, k, idx, s,
                                                                                   nbytes)),
                              prio)
            self.net.send(self.worker_io[ci], self.worker_msg_cost, send)

    def _pushed(self, ci, r, k, idx, s, nbytes):
        """A class's push of slice (k, idx) reached server ``s``: its I/O thread takes the
        class's ``m`` messages; when every worker's is in, it answers every worker's pull."""
        m = self.classes[ci].count
        self.net.send(self.server_io[s], m * self.msg_cost,
                      lambda: self._taken(r, k, idx, s, nbytes))

    def _taken(self, r, k, idx, s, nbytes):
        agg = self._agg
        key = (r, k, idx)
        agg[key] = agg.get(key, 0) + 1
        if agg[key] < len(self.classes):
            return
        del agg[key]

        def answer():
            for cj in range(len(self.classes)):
                self._answer(cj, r, k, s, nbytes)
        self.net.send(self.server_io[s], self.W * self.msg_cost, answer)

    def _answer(self, cj, r, k, s, nbytes):
        """Class ``cj``'s pull of slice (k, s): mxps answers it when the round's update is
        done; ps-lite (native, P3) acknowledges the push then, and the worker's pull request
        (after the acknowledgement's delay and its I/O thread) asks for it."""
        if self.sys.kind != "native":
            return self._pull(cj, r, k, s, nbytes)

        def requested():
            self.net.send(self.server_io[s], self.classes[cj].count * self.msg_cost,
                          lambda: self._pull(cj, r, k, s, nbytes))

        def acked():
            self.net.send(self.worker_io[cj], self.worker_msg_cost,
                          lambda: self._later(self._delay(cj, s, True), requested))
        self._later(self._delay(cj, s, False), acked)

    def _pull(self, cj, r, k, s, nbytes):
        st = self._rstate[(cj, r)]

        def arrived():
            st["bytes"][s] += nbytes
            st["last"][s] = self.env.now
            st["left"] -= 1
            self._maybe_done(st)

        def taken():
            # the worker's I/O thread takes the reply (its per-message CPU), in turn
            self.net.send(self.worker_io[cj], self.worker_msg_cost, arrived)
        self.net.send(self.pull[cj][s], nbytes,
                      lambda: self._later(self._delay(cj, s, False), taken))

    # --- re-planning (mxps-adaptive) --------------------------------------------------

    def _replan(self, r):
        """The point before round ``r``: the Replanner sees round r-1, may adopt a table."""
        reps = self._reports.pop(r - 1, {})
        reports = []
        for ci in range(len(self.classes)):
            per = reps.get(ci)
            if per is None:
                return
            reports.append({r - 1: [per[s] for s in range(self.S)]})
        self.planner.observe(reports)
        keys = list(enumerate(self.sizes))
        chunk = default_max_chunk(self.W) if self.sys.max_chunk is None else self.sys.max_chunk
        new = self.planner.decide(keys, self.table, len(self.plan_versions), r,
                                  max_chunk=chunk)
        if new is None:
            return
        flows = self._moves(self.table, new)
        planned = sum(flows.values())       # adaptive.moved_bytes, by (from, to) pair
        t0 = self.env.now
        if flows:
            evs = []
            for (a, b), nbytes in flows.items():
                ev = self.env.event()
                self.net.send(self._peer(a, b), nbytes * STATE_COPIES,
                              lambda ev=ev: self._later(self.lat, ev.succeed))
                evs.append(ev)
            yield self.env.all_of(evs)
        self.planner.moved(planned, planned * STATE_COPIES)
        self.table = {k: tuple(v) for k, v in new.items()}
        self.plan_versions.append(r)
        self.moves.append({"round": r, "bytes": planned * STATE_COPIES,
                           "seconds": self.env.now - t0})

    @staticmethod
    def _moves(old, new):
        """{(from server, to server): bytes} of the elements that change server."""
        out = {}
        for key, nslices in new.items():
            o = sorted(old.get(key, ()), key=lambda s: s.offset)
            n = sorted(nslices, key=lambda s: s.offset)
            i = j = 0
            while i < len(o) and j < len(n):
                lo, hi = max(o[i].offset, n[j].offset), min(o[i].stop, n[j].stop)
                if hi > lo and o[i].server != n[j].server:
                    pair = (o[i].server, n[j].server)
                    out[pair] = out.get(pair, 0) + (hi - lo) * ELEMENT_BYTES
                if o[i].stop <= n[j].stop:
                    i += 1
                else:
                    j += 1
        return out

    # --- results ----------------------------------------------------------------------

    def step_times(self):
        """Per class: the timed steps' (start, end)."""
        out = []
        for ci in range(len(self.classes)):
            s = self.starts[ci][self.warmup:]
            e = self.ends[ci][self.warmup:]
            out.append(list(zip(s, e)))
        return out

    def cpu_per_gb(self):
        """CPU-seconds per GB the workers pushed and pulled, per process kind, over the whole
        run (the bench's ``cpu_per_gb``, compute left out); None on one shared machine, where
        the model does not tell the processes apart."""
        net = self.net
        if "host cpu" in net.names:
            return None
        gb = 2.0 * self.W * self.rounds * self.model.bytes / 1e9
        used = dict(zip(net.names, net.used))
        w = sum(used["%s cpu" % c.name] * c.count for c in self.classes)
        s = sum(used["s%d cpu" % i] for i in range(self.S))
        return {"worker": w / gb, "server": s / gb}

    def mean_step(self):
        """The bench's mean: earliest start of the first timed step to the latest end of the
        last, over every worker, over the number of timed steps."""
        t = self.step_times()
        return (max(x[-1][1] for x in t) - min(x[0][0] for x in t)) / self.steps
