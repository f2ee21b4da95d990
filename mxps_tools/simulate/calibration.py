"""The simulator's measured parameters: few, named, each with the command that measures it.

Nothing here is fitted to a scenario's step time.  ``calibration.json`` beside this module
holds the values and, per value, its source (a command and the JSON it wrote, or a published
figure of this repository's docs/bench); ``mxps simulate --calibrate`` measures the CPU costs
again on this machine (``mxps bench-server`` at two message sizes) and rewrites them.

- ``cpu_s_per_gb``: CPU-seconds a worker (a server) spends per GB it pushes and pulls
  (a server: per GB through it), per system kind and with or without the job secret: the
  per-byte work (copies, the cipher, the kernel's TCP).
- ``cpu_s_per_message``: a server's CPU per message it receives or answers beyond the bytes
  (Python per chunk, framing, the optimizer call): the difference between small and large
  messages of the same bytes in ``mxps bench-server``.
- ``push_alone``: a many-to-one TCP (LTP) push's round time over the ideal, against the loss
  and the bytes per sender (``mxps study ltp``'s push-alone grid, 8 -> 1, 2 ms queue): the
  incast and loss term, applied as the efficiency of a push that crosses a lossy or shallow
  switch port.
- ``push_rounds``: the same through the bench's default switch queue, 3 senders -> 3
  receivers, at two link rates (``mxps simulate --calibrate``): what TCP loses to its own
  dynamics (start-up of a burst, ACK clocking through tbf, random loss) on the links of every
  other scenario.  What loss costs depends on the link's rate (1% costs 1.4 MB per sender
  and receiver 1.61x at 400 Mbit/s, 1.04x at 100), so a push's term is interpolated in log
  rate between the measured rates (clamped at their edges).
- ``emunet_cpu_s_per_gb``: what the emulated network (veths, bridge, tbf in softirq) costs
  the machine per GB beyond the processes' own CPU; only where every node shares one machine.
- ``latency_s``: the emulated network's idle round trip, and its round trip across a link
  that bulk TCP flows keep busy (``mxps simulate --calibrate``): the difference, at that
  link's rate, is the bytes a loaded link holds in its queue; a message waits for them at the
  slower of the links it crosses.
- header efficiency: derived, not measured: TCP payload per frame ``(mtu - 52) / (mtu + 14)``
  (IP, TCP with timestamps; tbf counts the Ethernet header), LTP's ``(mtu - 60) / (mtu + 14)``.
"""
import bisect
import json
import math
import os

CALIBRATION_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")


class Calibration:
    def __init__(self, data):
        self.data = data
        self.cpu = data["cpu_s_per_gb"]
        self.per_message = data["cpu_s_per_message"]
        lat = data["latency_s"]
        # the idle path's one-way delay, and the bytes a loaded link holds in its queue (its
        # round trip under load minus the idle one, at the rate it was measured at)
        self.latency_s = float(lat.get("idle_rtt_s", lat["value"])) / 2.0
        self.loaded_queue_bytes = max(0.0, float(lat.get("loaded_rtt_s", 0.0)) -
                                      float(lat.get("idle_rtt_s", 0.0))) * \
            float(lat.get("rate_mbit", 400.0)) * 1e6 / 8.0
        self.push_alone = data["push_alone"]

    @classmethod
    def load(cls, path=CALIBRATION_FILE):
        with open(path) as f:
            return cls(json.load(f))

    def cpu_per_byte(self, kind, role, secret=True):
        """Seconds of CPU per byte for a ``kind`` (native, mxps) ``role`` (worker, server)."""
        k = self.cpu[kind]
        v = k[role + ("" if secret or kind != "mxps" else "_plain")]
        return float(v) / 1e9

    def message_cost(self, kind, role="server"):
        """CPU-seconds per message beyond its bytes: a server's per message it takes or
        answers, a worker's per message it sends or receives."""
        m = self.per_message[kind]
        return float(m["value"] if role == "server" else m.get("worker", m["value"]))

    def emunet_cpu_per_byte(self, per_packet):
        """CPU-seconds per byte the emulated network spends in interrupts and softirqs, with
        offloads off (``per_packet``: where it drops packets) or on."""
        x = (self.data.get("emunet_cpu_s_per_gb") or {}).get(
            "per_packet" if per_packet else "offloads")
        return float(x["value"]) / 1e9 if x else 0.0

    @staticmethod
    def header_efficiency(mtu, transport="tcp"):
        over = 52 if transport == "tcp" else 60
        return (mtu - over) / float(mtu + 14)

    def push_efficiency(self, transport, loss_pct, bytes_per_sender, grid="push_alone",
                        mtu=None, rate=None):
        """Goodput over the ideal of a push at ``loss_pct`` (interpolated in the loss, in log
        bytes per sender and, where the grid was measured at several link rates, in log
        ``rate`` (bytes/s), within the measured grid; clamped at its edges).  ``grid``:
        ``push_alone`` (8 -> 1 through a 2 ms switch queue: incast) or ``push_rounds`` (3 -> 3
        through the bench's default 50 ms queue)."""
        if grid == "push_alone" and mtu and mtu != 1500 and \
                self.data.get("push_alone_mtu%d" % mtu):
            grid = "push_alone_mtu%d" % mtu
        grids = self.data.get(grid) or {}
        if transport not in grids:
            return 1.0
        per_rate = grids[transport]
        if isinstance(per_rate, dict):          # one grid, one rate
            return 1.0 / max(self._ratio(per_rate, loss_pct, bytes_per_sender), 1.0)
        per_rate = sorted(per_rate, key=lambda g: g["rate_mbit"])
        rates = [math.log(g["rate_mbit"] * 1e6 / 8.0) for g in per_rate]
        x = rates[-1] if rate is None else math.log(max(rate, 1.0))
        j0, j1, f = _interp(rates, x)
        r = self._ratio(per_rate[j0], loss_pct, bytes_per_sender) * (1 - f) + \
            self._ratio(per_rate[j1], loss_pct, bytes_per_sender) * f
        return 1.0 / max(r, 1.0)

    @staticmethod
    def _ratio(grid, loss_pct, bytes_per_sender):
        """A grid's round over the ideal ({"loss": [...], "bytes": [...], "ratio": [[]]}),
        interpolated in the loss and in log bytes per sender."""
        losses, sizes, ratio = grid["loss"], grid["bytes"], grid["ratio"]
        lb = math.log(max(bytes_per_sender, 1.0))
        ls = [math.log(s) for s in sizes]
        i0, i1, fi = _interp(losses, loss_pct)
        j0, j1, fj = _interp(ls, lb)

        def at(i):
            return ratio[i][j0] * (1 - fj) + ratio[i][j1] * fj
        return at(i0) * (1 - fi) + at(i1) * fi


def _interp(xs, x):
    """The two indices of sorted ``xs`` around ``x`` and ``x``'s share between them
    (clamped at the ends)."""
    if x <= xs[0]:
        return 0, 0, 0.0
    if x >= xs[-1]:
        return len(xs) - 1, len(xs) - 1, 0.0
    j = bisect.bisect_right(xs, x)
    return j - 1, j, (x - xs[j - 1]) / (xs[j] - xs[j - 1])
