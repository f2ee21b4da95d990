"""``mxps simulate --calibrate``: measure the model's parameters on this machine and write them
to ``calibration.json`` (each with the command that measured it, the commit and the date).

None of them is a training step, so none is fitted to a scenario the model is validated on:

- ``message``: ``mxps bench-server`` moving the same bytes per round in 4 keys of 4 Mi
  elements and in 256 keys of 64 Ki elements; a server's (worker's) CPU per message is the
  difference of the CPU-seconds per round over the difference of the messages per round
  (every worker pushes and pulls every key: ``2 x W x keys`` messages a round).
- ``push``: TCP through a switch port (``python -m mxps_tools.incast``, the push alone): 3
  senders each pushing a message split over 3 receivers per round, on the emulated network
  with the bench's default switch queue (50 ms) and its offloads (on, unless loss turns them
  off), at 0, 1 and 5% loss, messages of 256 KB, 4 MB and 32 MB, links of 100 and 400
  Mbit/s: the round's mean over the ideal is the efficiency of a TCP push of that many bytes
  per sender and receiver at that rate (what loss costs depends on the rate: 1% loss costs a
  4 MB message (1.4 MB per receiver) 1.61x at 400 Mbit/s and 1.04x at 100).
- ``net``: the emulated network's own interrupt and softirq CPU per GB, offloads on and off.
- ``latency``: the idle round trip and the round trip across a link bulk flows keep busy.
- ``incast9000``: the 8 -> 1 push alone at MTU 9000 (the incast term; at 1500 it comes from
  docs/bench/ltp_push_alone_grid.json): ``python -m mxps_tools.simulate.calibrate
  incast9000``. Not run by default (~15 min); it needs a quiet machine: beside another
  process its TCP points come out up to 15% slower.

The LTP per-datagram CPU and the CPU per byte stay as measured in docs/bench (their commands
are in calibration.json).  Needs root (the emulated network); one benchmark at a time
(``flock /tmp/mxps-bench.lock``).
"""
import json
import os
import subprocess
import sys
import tempfile
import time

from .calibration import CALIBRATION_FILE

SIZES = ("256K", "4M", "32M")
LOSSES = (0.0, 1.0, 5.0)
QUEUE_MS = 50.0
#: the link rates (Mbit/s) of the push rounds: the bench's slow link (R/4) and its R
PUSH_RATES = (100.0, 400.0)
W = R = 3


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.abspath(__file__))
                              ).stdout.strip() or None
    except OSError:
        return None


def _run(argv, what):
    print("+ " + " ".join(argv), flush=True)
    p = subprocess.run(argv, text=True, capture_output=True)
    if p.returncode != 0:
        raise SystemExit("mxps simulate --calibrate: %s failed (exit %d): %s"
                         % (what, p.returncode, (p.stderr or p.stdout)[-2000:]))
    return p


def per_message(workers=2, rounds=20, repeat=3, out_dir=None):
    out_dir = out_dir or tempfile.mkdtemp(prefix="mxps-calib-")
    res = {}
    shapes = {"big": (4, 4 * 1024 * 1024), "small": (256, 64 * 1024)}
    for name, (keys, elements) in shapes.items():
        d = os.path.join(out_dir, name)
        argv = [sys.executable, "-m", "mxps_tools.cli", "bench-server", "--workers",
                str(workers), "--keys", str(keys), "--elements", str(elements), "--rounds",
                str(rounds), "--repeat", str(repeat), "--systems", "native,mxps",
                "--out-dir", d]
        _run(argv, "bench-server %s" % name)
        with open(os.path.join(d, "bench_server.json")) as f:
            summary = json.load(f)
        res[name] = (keys, summary)
    out = {}
    for system, kind in (("native", "native"), ("mxps", "mxps")):
        per = {}
        for name, (keys, summary) in res.items():
            recs = [r for r in summary["records"] if r["system"] == system and r.get("ok")]
            if not recs:
                raise SystemExit("mxps simulate --calibrate: no %s run of bench-server %s "
                                 "succeeded" % (system, name))
            per[name] = (keys, sum(r["server_cpu_s"] / r["rounds"] for r in recs) / len(recs),
                         sum(r["worker_cpu_s"] / r["rounds"] for r in recs) / len(recs))
        (kb, sb, wb), (ks, ss, ws) = per["big"], per["small"]
        msgs = lambda k: 2.0 * workers * k        # noqa: E731
        out[kind] = {"value": max(0.0, (ss - sb) / (msgs(ks) - msgs(kb))),
                     "worker": max(0.0, (ws - wb) / (msgs(ks) - msgs(kb))),
                     "source": "mxps bench-server --workers %d --rounds %d --repeat %d "
                               "--systems native,mxps, --keys 4 --elements 4194304 against "
                               "--keys 256 --elements 65536 (same bytes): the server's "
                               "(workers') CPU-seconds per round over the messages per round"
                               % (workers, rounds, repeat)}
    return out


def push_rounds(rate=400.0, rounds=20, out_dir=None):
    out_dir = out_dir or tempfile.mkdtemp(prefix="mxps-calib-")
    ratio = []
    for loss in LOSSES:
        row = []
        for size in SIZES:
            path = os.path.join(out_dir, "tcp_%g_%s_%g.json" % (rate, size, loss))
            argv = [sys.executable, "-m", "mxps_tools.incast", "--transport", "tcp", "-W",
                    str(W), "-R", str(R), "--rate", "%g" % rate, "--message", size,
                    "--queue-ms", str(QUEUE_MS), "--loss", str(loss), "--rounds", str(rounds),
                    "--offloads", "--out", path]
            _run(argv, "incast %g Mbit/s %s %g%%" % (rate, size, loss))
            with open(path) as f:
                rec = json.load(f)
            row.append(rec["points"][0]["summary"]["mean_over_ideal"])
        ratio.append(row)
    sizes = [_bytes(s) / R for s in SIZES]
    return {"rate_mbit": rate, "loss": list(LOSSES), "bytes": sizes, "ratio": ratio,
            "source": "python -m mxps_tools.incast --transport tcp -W %d -R %d --rate %g "
                      "--message {%s} --queue-ms %g --loss {%s} --rounds %d --offloads (on "
                      "where the emulated network allows, as in mxps bench: not with loss): "
                      "mean round over the ideal; "
                      "bytes = the message over the receivers (per sender and receiver)"
                      % (W, R, rate, ",".join(SIZES), QUEUE_MS,
                         ",".join("%g" % x for x in LOSSES), rounds)}


def _host_softirq():
    """Seconds every CPU of this machine spent in interrupts and softirqs (``/proc/stat``'s
    irq and softirq columns): where the veths, the bridge and tbf do their per-packet work."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (v[5] + v[6]) / float(hz)


def network_cpu(rounds=20, message="32M", rate=10000.0, offloads=False):
    """CPU the emulated network itself spends per GB (``emunet_cpu_s_per_gb``): a 3 -> 3 TCP
    push at 10 Gbit/s; the machine's interrupt and softirq CPU-seconds over the run, over the
    GB pushed: the per-packet work of the veths, the bridge and tbf (and the TCP receive path
    in softirq), which a job on one machine pays on the same cores and the loopback
    bench-server measured only in part (its loopback has no veth, bridge or tbf).  Other
    processes' user and system time do not count, so other load barely moves it."""
    out = tempfile.mkdtemp(prefix="mxps-calib-")
    path = os.path.join(out, "net.json")
    argv = [sys.executable, "-m", "mxps_tools.incast", "--transport", "tcp", "-W", str(W),
            "-R", str(R), "--rate", str(rate), "--message", message, "--queue-ms",
            str(QUEUE_MS), "--rounds", str(rounds), "--warmup", "0", "--out", path] + \
        (["--offloads"] if offloads else [])
    busy0, t0 = _host_softirq(), time.time()
    _run(argv, "incast at %g Mbit/s" % rate)
    busy1, t1 = _host_softirq(), time.time()
    gb = W * _bytes(message) * rounds / 1e9
    return {"value": (busy1 - busy0) / gb, "softirq_s": busy1 - busy0, "gb": gb,
            "seconds": t1 - t0,
            "source": " ".join(["python"] + [x for x in argv[1:] if x != path]) +
                      ": the machine's irq and softirq "
                      "CPU-seconds (/proc/stat) over the run, per GB pushed"}


#: timed rounds of the incast grid's points, by message: a 32 MB round is 5 s of 8 senders
#: at 400 Mbit/s
INCAST_ROUNDS = {"256K": 20, "4M": 20, "32M": 5}


def incast_grid(mtu, sizes=("256K", "4M", "32M"), losses=(0.0, 1.0, 5.0, 10.0),
                out_dir=None):
    """The push alone, 8 -> 1 through a 2 ms switch queue, TCP and LTP, at ``mtu``: the
    incast term at that MTU (docs/bench/ltp_push_alone_grid.json has it at 1500).  The 32 MB
    point is there because a job's pushes to one server are tens of MB a step (a round of
    4 MB ends in a tail that a longer push amortizes).  A point already in ``out_dir`` is kept
    (a run resumes); a point that fails is tried once more."""
    out_dir = out_dir or os.path.join(tempfile.gettempdir(), "mxps-calib-incast%d" % mtu)
    os.makedirs(out_dir, exist_ok=True)
    grid = {}
    for tr in ("tcp", "ltp"):
        ratio = []
        for loss in losses:
            row = []
            for size in sizes:
                path = os.path.join(out_dir, "%s_%s_%g.json" % (tr, size, loss))
                argv = [sys.executable, "-m", "mxps_tools.incast", "--transport", tr, "-W", "8",
                        "-R", "1", "--mtu", str(mtu), "--message", size, "--queue-ms", "2",
                        "--loss", str(loss), "--rounds", str(INCAST_ROUNDS[size]),
                        "--out", path]
                if not _has_point(path):
                    try:
                        _run(argv, "incast %s %s %g%%" % (tr, size, loss))
                    except SystemExit as e:
                        print("%s; once more" % e, flush=True)
                        _run(argv, "incast %s %s %g%%" % (tr, size, loss))
                with open(path) as f:
                    row.append(json.load(f)["points"][0]["summary"]["mean_over_ideal"])
            ratio.append(row)
        grid[tr] = {"loss": list(losses), "bytes": [_bytes(x) for x in sizes], "ratio": ratio}
    grid["source"] = ("python -m mxps_tools.incast --transport {tcp,ltp} -W 8 -R 1 --mtu %d "
                      "--message {%s} --queue-ms 2 --loss {%s} --rounds {%s}: mean round "
                      "over the ideal" % (mtu, ",".join(sizes),
                                          ",".join("%g" % x for x in losses),
                                          ",".join(str(INCAST_ROUNDS[x]) for x in sizes)))
    return grid


_PROBE_SERVER = r"""
import socket, sys, threading
def echo(c):
    while True:
        d = c.recv(64)
        if not d:
            return
        c.sendall(d)
def sink(c):
    while c.recv(1 << 20):
        pass
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    kind = c.recv(1)
    threading.Thread(target=echo if kind == b"e" else sink, args=(c,), daemon=True).start()
"""

_PROBE_CLIENT = r"""
import socket, statistics, sys, threading, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
def rtts(n):
    c = socket.create_connection((host, port)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.sendall(b"e"); out = []
    for _ in range(n):
        t = time.perf_counter(); c.sendall(b"x" * 32); got = b""
        while len(got) < 32:
            got += c.recv(64)
        out.append(time.perf_counter() - t); time.sleep(0.02)
    return out
idle = rtts(40)
stop = threading.Event()
def bulk():
    c = socket.create_connection((host, port)); c.sendall(b"b"); buf = bytes(1 << 20)
    while not stop.is_set():
        c.sendall(buf)
threads = [threading.Thread(target=bulk, daemon=True) for _ in range(3)]
for t in threads:
    t.start()
time.sleep(1.0)
loaded = rtts(int(seconds / 0.02))
stop.set()
print("RTT %f %f" % (statistics.median(idle), statistics.median(loaded)), flush=True)
"""


def latency(rate=400.0, seconds=4.0, port=47311):
    """The one-way delay a message meets on a loaded link of the emulated network: a small
    TCP echo from node a to node b while three bulk TCP flows fill a's link to b (the bench's
    default 50 ms queue, offloads on), the echo's request crossing the loaded queues and its
    reply the idle ones; the median loaded round trip is the delay (the idle one beside it)."""
    from .. import emunet
    emunet.check_prerequisites()
    emunet.cleanup_stale()
    with emunet.Topology(["a", "b"], default_rate=rate) as topo:
        srv = topo.popen("b", [sys.executable, "-c", _PROBE_SERVER, str(port)],
                         stdout=subprocess.PIPE, text=True)
        if srv.stdout.readline().strip() != "ready":
            raise SystemExit("mxps simulate --calibrate: the latency probe's server did not "
                             "start")
        cli = topo.popen("a", [sys.executable, "-c", _PROBE_CLIENT, topo.addr("b"), str(port),
                               str(seconds)], stdout=subprocess.PIPE, text=True)
        out, _ = cli.communicate(timeout=60 + seconds)
        srv.kill()
    line = [ln for ln in out.splitlines() if ln.startswith("RTT ")]
    if not line:
        raise SystemExit("mxps simulate --calibrate: the latency probe printed nothing")
    idle, loaded = (float(x) for x in line[-1].split()[1:])
    return {"value": loaded, "idle_rtt_s": idle, "loaded_rtt_s": loaded, "rate_mbit": rate,
            "source": "mxps simulate --calibrate (latency): a TCP echo across a %g Mbit/s link "
                      "of the emulated network (50 ms queue, offloads on) while three bulk "
                      "flows fill it, median of %d probes" % (rate, int(seconds / 0.02))}


def _has_point(path):
    try:
        with open(path) as f:
            return bool(json.load(f)["points"])
    except (OSError, ValueError, KeyError):
        return False


def _bytes(s):
    return int(s[:-1]) * {"K": 1024, "M": 1024 * 1024}[s[-1]]


DEFAULT = ("message", "push", "net", "latency")


def main(what=DEFAULT):
    with open(CALIBRATION_FILE) as f:
        cal = json.load(f)
    stamp = {"commit": _commit(), "date": time.strftime("%Y-%m-%d")}
    if "message" in what:
        pm = per_message()
        for k, v in pm.items():
            v.update(stamp)
        cal["cpu_s_per_message"] = pm
    if "net" in what:
        both = {}
        for mode, off in (("per_packet", False), ("offloads", True)):
            both[mode] = network_cpu(offloads=off)
            both[mode].update(stamp)
        cal["emunet_cpu_s_per_gb"] = both
    if "latency" in what:
        lat = latency()
        lat.update(stamp)
        cal["latency_s"] = lat
    if "incast9000" in what:
        cal["push_alone_mtu9000"] = incast_grid(9000)
        cal["push_alone_mtu9000"].update(stamp)
    if "push" in what:
        grids = []
        for rate in PUSH_RATES:
            pr = push_rounds(rate)
            pr.update(stamp)
            grids.append(pr)
        cal["push_rounds"] = {"tcp": grids}
    with open(CALIBRATION_FILE, "w") as f:
        json.dump(cal, f, indent=1)
    print(json.dumps({k: cal[k] for k in ("cpu_s_per_message", "push_rounds",
                                          "emunet_cpu_s_per_gb", "latency_s") if k in cal},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(tuple(sys.argv[1:]) or DEFAULT))
