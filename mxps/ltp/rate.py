"""BBR-style rate model of one LTP path (worker -> server): a pure model, no sockets, no clock.

The sender tells the model what it sent (``on_send``), what was acknowledged (``on_ack``) and
what it gave up (``on_lost``), and asks when the next packet may leave (``next_send_time``).
Every method takes the current time ``now`` (seconds, float) from the caller, so the model runs
the same under a real clock and inside a discrete-event simulation (tests/test_ltp_rate.py).
docs/LTP_RATE.md explains the model and its constants.

Why BBR and not a loss-based control: LTP's push tolerates random loss on purpose (the server
fills the holes), so a packet loss must not cut the rate.  BBR v1 never looks at loss: it
measures the path's bottleneck rate (``btl_bw``: windowed max of delivery-rate samples) and its
propagation round trip (``min_rtt``: windowed min of RTT samples), paces at a gain times
``btl_bw`` and bounds the bytes in flight by a window of a few bandwidth-delay products.  Here
that window is 1.5 x BDP plus the measured ACK aggregation (BBR v1: 2 x BDP), which keeps 8
paths into one shallow buffer from overfilling it (docs/LTP_RATE.md has the measurements).

Delivery-rate samples follow Linux tcp_rate.c: at send, a packet records how many bytes had
been delivered and when; at its ACK, the rate is (bytes delivered since) / max(time between the
sends, time between the ACKs), which under ACK compression is never faster than the sender sent.
Samples from packets sent while the sender had nothing to send (``idle``, ``app_limited``) may
raise ``btl_bw`` but never lower it: a sender that was not busy measured itself, not the path.

One instance per path, owned by one thread (not thread-safe); ``now`` from one monotonic clock.

Lost packets: a packet neither acknowledged nor given up within ``loss_timeout`` (4 smoothed
RTTs, at least 2 ms) leaves ``inflight`` by itself, so that a lossy path does not stall on a
window full of packets that will never be acknowledged.  Its ACK, if it still comes, counts as
delivered (the bytes did arrive) but does not leave ``inflight`` twice.
"""
import math
import random
from collections import deque

STARTUP = "STARTUP"
DRAIN = "DRAIN"
PROBE_BW = "PROBE_BW"
PROBE_RTT = "PROBE_RTT"

STARTUP_GAIN = 2.0 / math.log(2.0)      # 2.885: the smallest gain that doubles delivery per RTT
DRAIN_GAIN = 1.0 / STARTUP_GAIN         # empties in one round the queue STARTUP built
CYCLE_GAINS = (1.25, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
CWND_GAIN = 1.5                         # cwnd = 1.5 x BDP + ACK aggregation (docs/LTP_RATE.md)
FULL_BW_GROWTH = 1.25                   # STARTUP ends when btl_bw grew less than this ...
FULL_BW_ROUNDS = 3                      # ... for this many round trips in a row
BW_WINDOW_ROUNDS = 10                   # btl_bw: max over this many round trips (a gain cycle + 2)
MIN_RTT_WINDOW = 10.0                   # seconds: min_rtt is the min over this window
PROBE_RTT_TIME = 0.2                    # seconds at PROBE_RTT_CWND when min_rtt went stale
PROBE_RTT_CWND_PACKETS = 1              # many paths share a bottleneck: 4 each would not drain it
PRIOR_ROUNDS = 2                        # initial_rate stands in for btl_bw this many round trips
PACING_MARGIN = 0.01                    # pace 1% under the estimate so no queue builds in cruise
INITIAL_CWND_PACKETS = 10
MIN_CWND_PACKETS = 4
CWND_EXTRA_PACKETS = 1                  # one packet of slack on top of that
EXTRA_ACKED_ROUNDS = 5                  # ACK aggregation: max over 2 slots of 5 round trips
EXTRA_ACKED_MAX_SECONDS = 0.1           # ... and never more than 100 ms at btl_bw
DEFAULT_RTT = 0.001                     # seconds, before any RTT sample (pacing of STARTUP)
MIN_RTT_SAMPLE = 1e-6                   # seconds: a caller's coarse clock may say 0
SRTT_GAIN = 0.125                       # RFC 6298's alpha
RTTVAR_GAIN = 0.25                      # RFC 6298's beta
RTO_RTTVARS = 4.0                       # RFC 6298's K
LOSS_TIMEOUT_SRTTS = 4.0
MIN_LOSS_TIMEOUT = 0.002                # seconds
INITIAL_LOSS_TIMEOUT = 0.05             # seconds, before any RTT sample
BURST_SECONDS = 0.001                   # pacing credit a late sender may use at once ...
BURST_MAX_BYTES = 64 * 1024             # ... at most this much (and at least 2 packets)
GONE_KEEP = 4096                        # given-up packets remembered for a late ACK
DEFAULT_MIN_RATE = 125e3                # bytes/s (1 Mbit/s): never pace slower
DEFAULT_MAX_RATE = 12.5e9               # bytes/s (100 Gbit/s)

# one sent packet: (nbytes, sent, delivered, delivered_time, first_tx_time, app_limited)
_N, _SENT, _DELIVERED, _DTIME, _FIRST_TX, _APP = range(6)


class PathRate:
    """One (worker -> server) path's model: bottleneck rate and min RTT from ACKs, pacing.

    ``initial_rate`` (bytes/s): a rate the sender already knows for this path (e.g. the
    server's measured rate divided by the workers pushing to it at once).  The model then skips
    STARTUP, paces at that rate from the first packet, and lets measurements replace it after
    ``PRIOR_ROUNDS`` round trips.  Without it the model starts in STARTUP from 10 packets per
    (unknown, 1 ms assumed) round trip.  ``seed``: the random start phase of the gain cycle
    (desynchronises the probes of paths sharing a bottleneck); ``burst``: seconds of pacing
    credit a sender that wakes up late may use at once (never more than 64 KB).
    """

    def __init__(self, now, initial_rate=None, mss=1400, min_rate=DEFAULT_MIN_RATE,
                 max_rate=DEFAULT_MAX_RATE, seed=None, burst=BURST_SECONDS,
                 min_rtt_window=MIN_RTT_WINDOW, probe_rtt_time=PROBE_RTT_TIME):
        if not (mss > 0):
            raise ValueError("mss must be a positive number of bytes, got %r" % (mss,))
        if not (0 < min_rate <= max_rate):
            raise ValueError("need 0 < min_rate <= max_rate, got min_rate=%r max_rate=%r"
                             % (min_rate, max_rate))
        if initial_rate is not None and not (initial_rate > 0 and math.isfinite(initial_rate)):
            raise ValueError("initial_rate must be a positive, finite bytes/s, got %r"
                             % (initial_rate,))
        self.mss = int(mss)
        self.min_rate, self.max_rate = float(min_rate), float(max_rate)
        self._sample_cap = self.max_rate    # the fastest sample believed (``cap`` aside)
        self._rng = random.Random(seed)
        self._burst = float(burst)
        self._min_rtt_window = float(min_rtt_window)
        self._probe_rtt_time = float(probe_rtt_time)
        # packets: outstanding (in flight) and given up (a late ACK still counts as delivered)
        self._out = {}
        self._order = deque()
        self._gone = {}
        self._gone_order = deque()
        self._last_pn = None
        self._inflight = 0
        # delivery accounting (tcp_rate.c)
        self._delivered = 0
        self._delivered_time = now
        self._first_tx_time = now
        # a new path starts like a restart after idle: the first flight's samples measure the
        # sender's ramp (and a round may be shorter than one flight), not the path
        self._app_limited_until = 1
        self._idle = False
        # round trips, counted by delivery: a round ends when a packet sent after its start
        # is acknowledged
        self._round = 0
        self._next_round_delivered = 0
        # filters
        self._bw_rounds = deque()           # [round, max sample of that round]
        self._prior = float(initial_rate) if initial_rate is not None else None
        self._btl = self._prior
        self._min_rtt = None
        self._min_rtt_stamp = now
        self._srtt = None
        self._rttvar = None
        self._timeout = INITIAL_LOSS_TIMEOUT
        # state machine
        self._full_bw = 0.0
        self._full_bw_count = 0
        self._full_bw_reached = initial_rate is not None
        self.state = PROBE_BW if initial_rate is not None else STARTUP
        self._cycle_idx = 2
        self._cycle_stamp = now
        self._idle_restart = False
        self._probe_rtt_done = None         # PROBE_RTT: when the drained window may end
        self._probe_rtt_round_done = False
        self._prior_cwnd = 0
        # ACK aggregation (Linux bbr_update_ack_aggregation): bytes ACKed beyond what btl_bw
        # explains since the epoch began, e.g. a receiver that ACKs a batch at a time
        self._ack_epoch_start = now
        self._ack_epoch_acked = 0
        self._extra_acked = [0.0, 0.0]
        self._extra_idx = 0
        self._extra_rounds = 0
        # outputs
        self._cwnd = INITIAL_CWND_PACKETS * self.mss
        self._cwnd_open = initial_rate is not None  # pacing alone bounds the first round trip
        self._pacing = self._clamp(self._prior * (1 - PACING_MARGIN) if self._prior
                                   else STARTUP_GAIN * self._cwnd / DEFAULT_RTT)
        self._next_departure = now
        self._wanted = self._pacing     # the model's own rate, before the ceiling (``cap``)
        self._capped = False            # the ceiling holds pacing below it
        # counters (snapshot)
        self.sent_bytes = 0
        self.lost_bytes = 0
        self.late_bytes = 0
        self.ignored_acks = 0

    # --- estimates ------------------------------------------------------------------------

    @property
    def btl_bw(self):
        """Bottleneck rate (bytes/s): max delivery rate over the last ``BW_WINDOW_ROUNDS``
        round trips with a sample; ``initial_rate`` while it stands in; None before anything
        is known."""
        return self._btl

    @property
    def min_rtt(self):
        """Propagation round trip (s): the smallest RTT sample; a sample replaces it when it
        is not larger, or when ``min_rtt_window`` s passed without one (after PROBE_RTT, or the
        first sample after idle: an idle path has drained its queue)."""
        return self._min_rtt

    @property
    def srtt(self):
        return self._srtt

    @property
    def rttvar(self):
        """The RTT samples' mean deviation (RFC 6298's RTTVAR); None before a sample."""
        return self._rttvar

    def rto(self, floor, ceiling):
        """A retransmission timeout for a critical packet of this path, RFC 6298's
        ``srtt + 4 rttvar`` within [``floor``, ``ceiling``]; None before any RTT sample.  The
        samples are of every ACKed packet (each resend has a packet number of its own, so no
        sample is ambiguous, as in QUIC) and include the receiver's and the sender's delays
        in reading and answering, which an END's ACK sees too."""
        if self._srtt is None:
            return None
        return min(ceiling, max(floor, self._srtt + RTO_RTTVARS * self._rttvar))

    @property
    def delivered_bytes(self):
        """Bytes acknowledged so far (late ACKs of given-up packets included)."""
        return self._delivered

    @property
    def pacing_rate(self):
        return self._pacing

    @property
    def cwnd(self):
        return int(self._cwnd) if not self._cwnd_open else _BIG

    @property
    def inflight(self):
        return self._inflight

    @property
    def credit(self):
        """Seconds of pacing credit a late sender may spend at once (``burst`` s of data at
        the pacing rate, 2 packets to 64 KB)."""
        return self._credit()

    @property
    def pacing_gain(self):
        if self.state == STARTUP:
            return STARTUP_GAIN
        if self.state == DRAIN:
            return DRAIN_GAIN
        if self.state == PROBE_RTT:
            return 1.0
        return CYCLE_GAINS[self._cycle_idx]

    def bdp(self, bw=None):
        """Bandwidth-delay product (bytes) at ``bw`` (default ``btl_bw``); None if unknown."""
        bw = self.btl_bw if bw is None else bw
        rtt = self.min_rtt
        return None if bw is None or rtt is None else bw * rtt

    def loss_timeout(self):
        """Seconds after which an unacknowledged packet leaves ``inflight``: 4 smoothed
        RTTs, at least 2 ms (50 ms before the first RTT sample)."""
        return self._timeout

    # --- sender events --------------------------------------------------------------------

    def on_send(self, pn, nbytes, now, app_limited=False):
        """Packet ``pn`` (increasing per path; a resent payload gets a new pn) of ``nbytes``
        left at ``now``.  ``app_limited``: the sender had no more to send (the last packets of
        a round): rate samples of this flight must not lower ``btl_bw``."""
        if self._last_pn is not None and pn <= self._last_pn:
            raise ValueError("packet number %r sent after %r: pns must increase per path"
                             % (pn, self._last_pn))
        if not nbytes > 0:
            raise ValueError("packet %r has %r bytes: must be positive" % (pn, nbytes))
        self._expire(now)
        if not self._out:
            # a new flight: its send and ACK intervals start now (not at the last ACK, which
            # may be an idle period ago)
            self._first_tx_time = self._delivered_time = now
            if self._idle:
                self._restart_after_idle()
        self._idle = False
        if app_limited or self._capped:
            self._mark_app_limited()
        self._last_pn = pn
        self._out[pn] = (nbytes, now, self._delivered, self._delivered_time,
                         self._first_tx_time, self._app_limited_until != 0)
        self._order.append(pn)
        self._inflight += nbytes
        self.sent_bytes += nbytes
        start = max(self._next_departure, now - self._credit())
        self._next_departure = start + nbytes / self._pacing

    def next_send_time(self, nbytes, now):
        """Earliest time a packet of ``nbytes`` may leave given what is known at ``now``
        (pacing, then cwnd).  An ACK can only make it earlier, so ask again after each one.
        When the window is full, the answer is when the oldest packet in flight times out."""
        self._expire(now)
        t = max(now, self._next_departure)
        if self._inflight and self._inflight + nbytes > self.cwnd:
            t = max(t, self._oldest_timeout())
        return t

    def send_run(self, pn, nbytes, room, now, last_nbytes=None):
        """Send as many of ``room`` packets as pacing and cwnd allow at ``now``: packet numbers
        ``pn, pn + 1, ...`` of ``nbytes`` each (the ``room``-th of ``last_nbytes``, if given).
        Exactly what a loop of ``next_send_time(size, now) <= now`` then ``on_send(pn + i,
        size, now)`` does, without its per-packet cost (the worker's pump sends runs of a
        slice's packets); returns how many were recorded as sent."""
        last = nbytes if last_nbytes is None else last_nbytes
        if not (nbytes > 0 and last > 0):
            raise ValueError("packets of %r and %r bytes: must be positive" % (nbytes, last))
        if room <= 0 or self.next_send_time(last if room == 1 else nbytes, now) > now:
            return 0
        self.on_send(pn, last if room == 1 else nbytes, now)
        # after the first, within one ``now``: nothing expires, no flight starts, no restart,
        # the pacing rate and the window do not change
        out, order = self._out, self._order
        cwnd, pacing = self.cwnd, self._pacing
        floor = now - self._credit()
        rec = out[pn]
        nd, inflight, k = self._next_departure, self._inflight, 1
        while k < room:
            size = last if k == room - 1 else nbytes
            if nd > now or (inflight and inflight + size > cwnd):
                break
            if size != rec[_N]:
                rec = (size,) + rec[1:]
            out[pn + k] = rec
            order.append(pn + k)
            if self._capped:       # as on_send: app-limited up to what is in flight before it
                self._app_limited_until = (self._delivered + inflight) or 1
            inflight += size
            self.sent_bytes += size
            nd = max(nd, floor) + size / pacing
            k += 1
        self._last_pn = pn + k - 1
        self._inflight = inflight
        self._next_departure = nd
        return k

    def idle(self, now):
        """The sender has nothing to send (between rounds).  Marks the flight in progress and
        the next one app-limited, and makes the next send a restart: pacing at 1 x btl_bw (no
        probe on a stale clock), and no credit for the idle time (``_credit``)."""
        self._expire(now)
        self._mark_app_limited()
        self._idle = True

    def on_lost(self, pns, now):
        """Packets the sender gave up (e.g. its round closed).  They leave ``inflight``; the
        rate is not touched: loss is never taken as congestion."""
        for pn in pns:
            rec = self._out.pop(pn, None)
            if rec is not None:
                self._give_up(pn, rec)
        self._expire(now)

    def on_ack(self, pns, now):
        """Selective ACK of ``pns`` (any order; duplicates, unknown and never-sent pns are
        ignored; a packet already given up counts as delivered, once)."""
        acked, newest, rtt = 0, None, None
        for pn in pns:
            rec = self._out.pop(pn, None)
            if rec is not None:
                self._inflight -= rec[_N]
            else:
                rec = self._gone.pop(pn, None)
                if rec is None:
                    self.ignored_acks += 1
                    continue
                self.late_bytes += rec[_N]
            acked += rec[_N]
            sample = max(now - rec[_SENT], MIN_RTT_SAMPLE)
            rtt = sample if rtt is None else min(rtt, sample)
            if newest is None or (rec[_DELIVERED], rec[_SENT]) > (newest[_DELIVERED],
                                                                  newest[_SENT]):
                newest = rec
        if newest is not None:
            self._delivered += acked
            expired = self._update_rtt(rtt, now)
            bw, app = self._rate_sample(newest, now)
            self._update_model(newest, bw, app, acked, expired, now)
        self._expire(now)

    # --- metrics --------------------------------------------------------------------------

    def cap(self, ceiling):
        """A rate ceiling (bytes/s) from outside the path's own model (the server's share,
        ltp.share): pace at most this fast from now on, in every state.  While it holds the
        pacing below the model's own rate, the packets sent are marked app-limited: their
        delivery samples measure the ceiling, not the path, so they may raise ``btl_bw`` but
        never lower it (as Linux treats a sender held by the receiver's window).  Without that
        the estimate fell to the ceiling within a window of round trips, and the sender needed
        a probe cycle per 25% to climb back when the ceiling rose (measured: a server's grant
        that rose from 3 to 9 MB/s met paths whose estimates had fallen to 2-4 MB/s)."""
        self.max_rate = max(float(ceiling), self.min_rate)
        self._capped = self._wanted > self.max_rate
        if self._pacing > self.max_rate:
            self._pacing = self.max_rate

    def snapshot(self):
        """The model's state for metrics and traces (plain JSON-able values)."""
        return {
            "state": self.state, "pacing_gain": round(self.pacing_gain, 4),
            "btl_bw": self.btl_bw, "min_rtt": self.min_rtt, "srtt": self._srtt,
            "rttvar": self._rttvar,
            "pacing_rate": self._pacing, "cwnd": self.cwnd if not self._cwnd_open else None,
            "inflight": self._inflight, "round": self._round,
            "extra_acked": self.extra_acked(),
            "app_limited": self._app_limited_until != 0, "capped": self._capped,
            "sent_bytes": self.sent_bytes,
            "delivered_bytes": self._delivered, "lost_bytes": self.lost_bytes,
            "late_bytes": self.late_bytes, "ignored_acks": self.ignored_acks,
        }

    # --- internals ------------------------------------------------------------------------

    def _clamp(self, rate):
        return min(max(rate, self.min_rate), self.max_rate)

    def _credit(self):
        """Pacing credit (s) a late sender may spend at once: ~1 ms of data, 2 packets to
        64 KB; after idle this is all the burst there is, never a whole cwnd."""
        nbytes = min(max(self._pacing * self._burst, 2 * self.mss), BURST_MAX_BYTES)
        return nbytes / self._pacing

    def _oldest_timeout(self):
        while self._order and self._order[0] not in self._out:
            self._order.popleft()
        if not self._order:
            return -math.inf
        return self._out[self._order[0]][_SENT] + self._timeout

    def _expire(self, now):
        """Give up the packets sent more than ``loss_timeout`` ago (oldest first: the
        timeout is the same for all, so they time out in send order)."""
        order, out, timeout = self._order, self._out, self._timeout
        while order:
            rec = out.get(order[0])
            if rec is None:
                order.popleft()
            elif rec[_SENT] + timeout <= now:
                self._give_up(order.popleft(), rec)
            else:
                return

    def _give_up(self, pn, rec):
        self._out.pop(pn, None)
        self._inflight -= rec[_N]
        self.lost_bytes += rec[_N]
        self._gone[pn] = rec
        self._gone_order.append(pn)
        while len(self._gone_order) > GONE_KEEP:
            self._gone.pop(self._gone_order.popleft(), None)

    def _mark_app_limited(self):
        # samples of packets sent until everything now in flight is delivered are app-limited
        self._app_limited_until = (self._delivered + self._inflight) or 1

    def _restart_after_idle(self):
        self._idle_restart = True
        if self.state == PROBE_BW and self.btl_bw is not None:
            self._wanted = self.btl_bw * (1 - PACING_MARGIN)
            self._capped = self._wanted > self.max_rate
            self._pacing = self._clamp(self._wanted)

    def _update_rtt(self, rtt, now):
        """srtt, rttvar (RFC 6298, section 2) and the min_rtt filter; True if min_rtt had gone
        unrefreshed for the window."""
        if self._srtt is None:
            self._srtt, self._rttvar = rtt, rtt / 2
        else:
            self._rttvar = ((1 - RTTVAR_GAIN) * self._rttvar
                            + RTTVAR_GAIN * abs(self._srtt - rtt))
            self._srtt = (1 - SRTT_GAIN) * self._srtt + SRTT_GAIN * rtt
        self._timeout = max(LOSS_TIMEOUT_SRTTS * self._srtt, MIN_LOSS_TIMEOUT)
        expired = (self._min_rtt is not None
                   and now > self._min_rtt_stamp + self._min_rtt_window)
        if self._min_rtt is None or rtt <= self._min_rtt or expired:
            self._min_rtt, self._min_rtt_stamp = rtt, now
        return expired

    def _rate_sample(self, rec, now):
        """(bytes/s or None, app-limited) from the most recently sent packet of this ACK."""
        send_elapsed = rec[_SENT] - rec[_FIRST_TX]
        ack_elapsed = now - rec[_DTIME]
        self._first_tx_time = rec[_SENT]
        self._delivered_time = now
        if self._app_limited_until and self._delivered > self._app_limited_until:
            self._app_limited_until = 0
        interval = max(send_elapsed, ack_elapsed)
        min_rtt = self.min_rtt
        if interval <= 0 or (min_rtt is not None and interval < min_rtt):
            return None, rec[_APP]      # shorter than a round trip: ACK compression, not rate
        bw = (self._delivered - rec[_DELIVERED]) / interval
        return min(bw, self._sample_cap), rec[_APP]

    def _update_model(self, rec, bw, app_limited, acked, rtt_expired, now):
        """One ACK's worth of BBR: round trips, the btl_bw filter, the state machine, then
        pacing and cwnd (the order of Linux's bbr_main)."""
        round_start = rec[_DELIVERED] >= self._next_round_delivered
        if round_start:
            self._next_round_delivered = self._delivered
            self._round += 1
            if self._round == PRIOR_ROUNDS:
                self._update_btl()
        if bw is not None and (not app_limited or self._btl is None or bw >= self._btl):
            self._add_bw(bw)
        self._update_ack_aggregation(acked, round_start, now)
        if self.state == PROBE_BW and self._cycle_done(now):
            self._cycle_idx = (self._cycle_idx + 1) % len(CYCLE_GAINS)
            self._cycle_stamp = now
        if round_start and not app_limited and bw is not None:
            self._check_full_bw()
        if self.state == STARTUP and self._full_bw_reached:
            self.state = DRAIN
        if self.state == DRAIN and self._inflight <= (self.bdp() or 0):
            self._enter_probe_bw(now)
        self._update_probe_rtt(round_start, rtt_expired, now)
        self._idle_restart = False
        self._set_pacing()
        self._set_cwnd(acked)

    def _update_probe_rtt(self, round_start, rtt_expired, now):
        """PROBE_RTT: when min_rtt went ``min_rtt_window`` without a refresh (a queue stood
        all that time), hold at most PROBE_RTT_CWND_PACKETS in flight for ``probe_rtt_time``
        and a round trip, so the queue drains and min_rtt is measured again.  Not after idle:
        the idle period already drained the queue and the restart's samples refreshed it."""
        if (rtt_expired and self._probe_rtt_time > 0 and not self._idle_restart
                and self.state != PROBE_RTT):
            self.state = PROBE_RTT
            self._prior_cwnd = self._cwnd
            self._probe_rtt_done = None
        if self.state != PROBE_RTT:
            return
        if self._probe_rtt_done is None:
            if self._inflight <= PROBE_RTT_CWND_PACKETS * self.mss:
                self._probe_rtt_done = now + self._probe_rtt_time
                self._probe_rtt_round_done = False
                self._next_round_delivered = self._delivered
            return
        self._probe_rtt_round_done |= round_start
        if self._probe_rtt_round_done and now >= self._probe_rtt_done:
            self._min_rtt_stamp = now
            self._cwnd = max(self._cwnd, self._prior_cwnd)
            if self._full_bw_reached:
                self._enter_probe_bw(now)
            else:
                self.state = STARTUP

    def _add_bw(self, bw):
        rounds = self._bw_rounds
        if rounds and rounds[-1][0] == self._round:
            rounds[-1][1] = max(rounds[-1][1], bw)
        else:
            rounds.append([self._round, bw])
        while rounds and rounds[0][0] <= self._round - BW_WINDOW_ROUNDS:
            rounds.popleft()
        self._update_btl()

    def _update_btl(self):
        # old rounds leave the window only when a new sample comes: a path whose samples
        # are all app-limited keeps the estimate it had
        best = max(m for _, m in self._bw_rounds) if self._bw_rounds else None
        if self._prior is not None and (best is None or self._round < PRIOR_ROUNDS):
            best = self._prior if best is None else max(best, self._prior)
        self._btl = best

    def _update_ack_aggregation(self, acked, round_start, now):
        """Track the largest burst of ACKs beyond ``btl_bw`` x elapsed within recent round
        trips; cwnd keeps that much extra room so a receiver that ACKs in batches does not
        make the window too small for the rate (which would lower the samples, then btl_bw,
        then the window: a spiral)."""
        bw = self._btl
        if bw is None:
            return
        if round_start:
            self._extra_rounds += 1
            if self._extra_rounds >= EXTRA_ACKED_ROUNDS:
                self._extra_rounds = 0
                self._extra_idx ^= 1
                self._extra_acked[self._extra_idx] = 0.0
        expected = bw * (now - self._ack_epoch_start)
        if self._ack_epoch_acked <= expected:
            self._ack_epoch_start, self._ack_epoch_acked, expected = now, 0, 0.0
        self._ack_epoch_acked += acked
        extra = min(self._ack_epoch_acked - expected, self._cwnd)
        if extra > self._extra_acked[self._extra_idx]:
            self._extra_acked[self._extra_idx] = extra

    def extra_acked(self):
        """Bytes of ACK aggregation cwnd allows for on top of gain x BDP."""
        bw = self._btl
        if bw is None or not self._full_bw_reached:
            return 0.0
        return min(max(self._extra_acked), bw * EXTRA_ACKED_MAX_SECONDS)

    def _cycle_done(self, now):
        gain = CYCLE_GAINS[self._cycle_idx]
        full = now - self._cycle_stamp > (self.min_rtt or 0.0)
        bdp = self.bdp() or 0.0
        if gain > 1:
            return full and self._inflight >= gain * bdp
        if gain < 1:
            return full or self._inflight <= bdp
        return full

    def _check_full_bw(self):
        bw = self.btl_bw
        if self._full_bw_reached or bw is None:
            return
        if bw >= self._full_bw * FULL_BW_GROWTH:
            self._full_bw, self._full_bw_count = bw, 0
            return
        self._full_bw_count += 1
        self._full_bw_reached = self._full_bw_count >= FULL_BW_ROUNDS

    def _enter_probe_bw(self, now):
        self.state = PROBE_BW
        # any phase but the 0.75 one (which would drain an already drained pipe)
        self._cycle_idx = self._rng.choice([0, 2, 3, 4, 5, 6, 7])
        self._cycle_stamp = now

    def _set_pacing(self):
        bw = self.btl_bw
        if bw is None:
            rate = STARTUP_GAIN * self._cwnd / (self._srtt or DEFAULT_RTT)
        else:
            rate = self.pacing_gain * bw * (1 - PACING_MARGIN)
        self._wanted = rate
        self._capped = rate > self.max_rate
        rate = self._clamp(rate)
        if self._full_bw_reached or rate > self._pacing:
            self._pacing = rate      # STARTUP only ever speeds up

    def _set_cwnd(self, acked):
        bdp = self.bdp()
        if bdp is None:
            self._cwnd += acked if not self._full_bw_reached else 0
            return
        gain = CWND_GAIN if self.state == PROBE_BW else STARTUP_GAIN
        target = gain * bdp + self.extra_acked() + CWND_EXTRA_PACKETS * self.mss
        if self._capped and self._srtt is not None:
            # held by the server's grant (``cap``): room for the grant at the round trip the
            # path sees.  Its samples are app-limited, so STARTUP never ends and the ACK
            # aggregation allowance never applies, and a BDP of the minimum RTT misses the
            # server's own delay before it ACKs (measured: resnet18 on 3 x 3,
            # min_rtt 0.1 ms, paths delivering half of their grant with ~30-50 KB in flight)
            target = max(target, CWND_GAIN * self.max_rate * self._srtt)
        if self._cwnd_open:
            # the first RTT sample with a known rate: the window is the target at once
            self._cwnd_open, self._cwnd = False, target
        elif self._full_bw_reached:
            self._cwnd = min(self._cwnd + acked, target)
        elif self._cwnd < target or self._delivered < INITIAL_CWND_PACKETS * self.mss:
            self._cwnd += acked
        self._cwnd = max(self._cwnd, MIN_CWND_PACKETS * self.mss)
        if self.state == PROBE_RTT:
            self._cwnd = min(self._cwnd, PROBE_RTT_CWND_PACKETS * self.mss)


_BIG = 1 << 62
