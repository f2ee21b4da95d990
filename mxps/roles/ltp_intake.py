"""LTP rounds on a server (docs/LTP.md): packets into their rounds, Early Close, the
elements nobody delivered kept as they were.

The receiver (``mxps.ltp.receiver``) verifies every datagram and hands it here, or adds the
packets that need nothing else into the open round itself (``ServerState.ltp_fast``).  A round
closes by the Early Close rule (``ltp.close.decide``): at the acceptance ratio, at its deadline,
or after the grace that follows the last END; ``on_tick`` closes those whose time came.
``LtpIntake`` is the part of ``ServerState`` that does this.
"""
import heapq
import logging

from ..kernels import ltp_packet
from ..ltp import close as ltp_close, rounds as ltp_rounds
from ..wire import frame as wire
from .rounds import Round

log = logging.getLogger("mxps.server")


class _Drop(Exception):
    """An LTP packet that fits no open round; the argument names the counter."""


class LtpIntake:
    """LTP packets and rounds (a part of ``ServerState``)."""

    # -- LTP: the loss-tolerant push (docs/LTP.md) -------------------------------------------
    _ltp_now = 0.0     # the time of the last packet or tick (a TCP push into an LTP round)

    def on_packet(self, f, payload, now):
        """A verified LTP packet (``ltp_packet.Fields``, its payload) at ``now``; returns the
        ``Out``s it causes (answers to pulls of rounds it closed).  A packet that fits no open
        round is dropped and counted in ``ltp_stats`` (``drop_<why>``), never an error: the
        sender is not waiting for an answer to it."""
        self.take_packet(f, payload, now)
        return self._flush()

    def fast_taken(self, now):
        """The receiver added packets into ``ltp_fast``'s rounds at ``now`` (as ``take_packet``
        would have: the time of the last packet)."""
        self._ltp_now = now

    def _unfast(self):
        """No packet goes into an open round past ``take_packet`` any more (the plan or the
        slices changed); the rounds that stay open come back as their next packets do."""
        fast = self.ltp_fast
        if fast:
            for lt in fast.values():
                lt.live = False
            fast.clear()

    def take_packet(self, f, payload, now):
        """``on_packet`` without handing back the ``Out``s: a server that reads its packets in
        batches calls ``outs()`` once after each batch, not a flush and a send per packet
        (with the receiver's loop made inline, 2.8% of a packet's server time at MTU 1500:
        scripts/ltp_loopback.py)."""
        self._ltp_now = now
        try:
            self._on_packet(f, payload, now)
        except _Drop as e:
            self.ltp_stats["drop_" + e.args[0]] += 1
            if self._trace is not None:
                self._trace.append(("packet_dropped_" + e.args[0], self._now(), f.round, f.key,
                                    f.offset, f.length, f.worker, payload.nbytes,
                                    f.plan_version, f.seq))
        except Exception:   # a bug: log it, keep serving
            log.exception("server %d: LTP packet %r failed", self.rank, f)
            self.ltp_stats["drop_error"] += 1

    def outs(self):
        """The ``Out``s of the ``take_packet`` calls since the last call (answers to pulls of
        the rounds they closed), in order."""
        return self._flush()

    def on_tick(self, now):
        """Close the LTP rounds whose deadline or grace has passed by ``now``."""
        self._ltp_now = now
        while self._wakes and self._wakes[0][0] <= now:
            _, key, offset, r = heapq.heappop(self._wakes)
            slot = self.slots.get((key, offset))
            rnd = slot.rounds.get(r) if slot is not None else None
            if rnd is not None and rnd.ltp is not None and not rnd.closed:
                self._ltp_check(slot, r, rnd, now)
                self._complete_rounds(slot)
                self._answer_waiting(slot)
        return self._flush()

    def next_wake(self):
        """When ``on_tick`` next has something to do (None: nothing scheduled)."""
        return self._wakes[0][0] if self._wakes else None

    def _on_packet(self, f, payload, now):
        st = self.ltp
        if st is None or not self.sync:
            raise _Drop("not_ltp")
        slot = self.slots.get((f.key, f.offset))
        if slot is None or slot.length != f.length or f.plan_version != self.plan_version:
            if self._hold_packet(f, payload, now):      # migration: its slice or plan comes
                return
            raise _Drop("slice" if slot is None or slot.length != f.length else "plan")
        if f.dtype != slot.dtype_code:
            raise _Drop("dtype")
        r = f.round
        if self.policy.ltp_participants_only:      # WSP: the push's round, as a TCP push's
            if f.worker >= self.num_workers:
                raise _Drop("worker")
            try:
                r = self.policy.packet_round(slot, f.worker, f.round, now)
            except ValueError:
                raise _Drop("late") from None
        rnd = slot.rounds.get(r)
        if r <= slot.applied or (rnd is not None and rnd.closed):
            if f.type == ltp_packet.END:       # its packets made the round: nothing is late
                self.ltp_stats["end_after_close"] += 1
                return
            raise _Drop("late")
        if rnd is None:
            rnd = slot.rounds[r] = Round(*slot.store.round_buffer(self.updater is not None))
        if rnd.ltp is None:
            itemsize = wire.dtype_of(slot.dtype_code).itemsize
            epp = ltp_packet.elements_per_packet(st.budget, itemsize)
            # the lowest acceptance ratio there is: the fixed ratio, or the adaptive rule's
            # floor (LtpRound.below)
            lowest = st.ratio if st.ratio > 0 else st.floor
            rnd.ltp = ltp_rounds.LtpRound(rnd.acc, epp, self.num_workers, slot.dtype_code,
                                          lowest)
            if self.ltp_fast is not None:
                rnd.ltp.plan_version = self.plan_version
                rnd.ltp.live = True
                self.ltp_fast[(slot.key, slot.offset, r)] = rnd.ltp
            st.share.opened(w for w in range(self.num_workers) if w not in rnd.senders)
            for w in rnd.senders:      # whole pushes (TCP) already in the sum
                rnd.ltp.seen[w] = bytearray(b"\x01") * rnd.ltp.n
                rnd.ltp.counts += 1
                rnd.ltp.credit(w, rnd.ltp.n)
                rnd.ltp.ends[w] = rnd.ltp.heard[w] = now
        if f.worker >= self.num_workers or f.worker in rnd.senders:
            raise _Drop("worker")
        try:
            lt = rnd.ltp
            if f.type == ltp_packet.DATA:
                first = lt.heard[f.worker] is None
                if not lt.add(f.worker, f.seq, f.count, payload, now):
                    raise _Drop("duplicate")
                if self._trace is not None:
                    self._data_row("packet_added", slot, f.round, f.worker, payload.nbytes,
                                   f.seq)
                # the rule can only change its answer at a DATA packet when a worker is
                # first heard (the deadline starts) or once every worker's part has reached
                # the lowest acceptance ratio there is (the fixed ratio, or the adaptive
                # rule's floor): while any is below it a packet needs no look (measured: the
                # look is a quarter of a packet's server time at MTU 1500; looking only at
                # the packets of parts past it still cost 11% of the server's samples at
                # 5% loss); deadlines and grace are the wakes' business
                if not first and lt.below:
                    return
            else:
                first = lt.ends[f.worker] is None
                lt.end(f.worker, f.seq, now)
                if first:
                    st.share.settled(f.worker)
        except ValueError:
            raise _Drop("cut") from None
        self._ltp_check(slot, r, rnd, now)
        self._complete_rounds(slot)
        self._answer_waiting(slot)

    def _take_held(self, packets):
        """Packets held for a slice that is now built or a plan that is now here
        (``Migrating._hold_packet``), taken in arrival order as if they came now: a round's
        deadline counts from when its slice could take packets."""
        for f, payload, at in packets:
            self._held_bytes -= payload.nbytes
            now = max(at, self._ltp_now)
            try:
                self._on_packet(f, payload, now)
            except _Drop as e:
                self.ltp_stats["drop_" + e.args[0]] += 1

    def _ltp_check(self, slot, r, rnd, now):
        """Apply the Early Close rule to round ``r`` of ``slot``; close it, or schedule a look."""
        lt, st = rnd.ltp, self.ltp
        if self.policy.ltp_participants_only:
            # WSP: the round is its participants' (the workers whose packets are in it); it
            # closes when Early Close says so over them and WSP lets it (``ltp_may_close``;
            # looked at again whenever the rounds are, ``ServerState._complete_rounds``)
            part = [w for w in range(lt.workers) if lt.heard[w] is not None]
            if not part:
                return
        else:
            part = range(lt.workers)
        if st.ratio > 0:
            ratio = st.ratio
        else:
            loss = st.loss() or ()
            worst = max(loss) if loss else 0.0
            ratio = ltp_close.acceptance_ratio(lt.n, worst, st.z, st.floor)
        if st.deadline < 0:
            deadline = slot.spans.value()
        else:
            deadline = st.deadline or None
        grace = ltp_close.grace_for(st.grace, st.reordered(), now)
        if self.policy.ltp_participants_only:
            received, heard, ends = ([x[w] for w in part]
                                     for x in (lt.received, lt.heard, lt.ends))
        else:
            received, heard, ends = lt.received, lt.heard, lt.ends
        reason, wake = ltp_close.decide(now, [lt.n] * len(part), received, heard, ends, ratio,
                                        grace, deadline)
        if reason is None:
            if wake is not None and (rnd.wake is None or wake < rnd.wake
                                     or rnd.wake <= now):
                rnd.wake = wake
                heapq.heappush(self._wakes, (wake, slot.key, slot.offset, r))
            return
        if self.policy.ltp_participants_only:
            if not self.policy.ltp_may_close(slot, r, rnd, part):
                return
            rnd.pushes = len(part)          # WSP's W / n: n parts (TCP pushes among them)
            rnd.rescaled = st.fill == ltp_rounds.RESCALE     # the filling scales each
            # packet delivered by c < W workers by W / c: WSP's scale, packet by packet
        rnd.closed = True
        if lt.live:
            lt.live = False
            self.ltp_fast.pop((slot.key, slot.offset, r), None)
        for w in range(lt.workers):
            if lt.ends[w] is None:          # its END did not come: it owes the round no more
                st.share.settled(w)
        rnd.frozen = lt.fill(st.fill)
        slot.spans.closed(reason, None if lt.last is None else lt.last - max(heard))
        stats = self.ltp_stats
        stats["rounds"] += 1
        stats["close_" + reason] += 1
        stats["packets_expected"] += lt.n * len(part)
        stats["packets_received"] += sum(lt.received)
        stats["packets_nobody"] += int((lt.counts == 0).sum())
        stats["duplicates"] += lt.duplicates
        if self._trace is not None:
            self._data_row("round_closed_" + reason, slot, r, -1,
                           int(1e6 * lt.delivered()))
