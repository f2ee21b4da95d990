#!/usr/bin/env python3
"""Flood one server of a running mxps job and watch its memory.

A real 2 x 2 job (tests/jobs/train_job.py, SGD with the optimizer on the servers, the job
secret set) trains while 4 sender processes flood one of its servers for ``--seconds`` each
time, in phases, with a pause between them:

- ``plain``: without the secret, well-formed requests over raw TCP as an mxps node without a
  secret sends them (a NULL-mechanism greeting claiming the identity of worker 0, then PUSHes
  of 256 KiB gradients, PULLs, INITs, PROBEs), reconnecting whenever the server closes the
  connection, as fast as the senders can;
- ``outsider``: with the secret, from connection identities that are no node of the job
  (``worker:<n>`` beyond the job's workers, with tokens made with the secret, which the data
  plane's handshake refuses for the name): the same well-formed requests, sealed as a node
  seals them (mxps.wire.seal), as fast as the sender's queue takes them (its ``MXPS_HWM``
  messages stay queued at the sender while zmq reconnects and is refused again);
- ``slow``: the same, sending PULLs and 1 MiB PROBEs (which a server echoes to its workers)
  and never reading a reply.

The server's resident memory (RSS, psutil) is sampled every 0.5 s from before the first phase
to after the last; reported per phase: the baseline (median of the samples just before), the
peak during the flood and the value at its end, and the training steps completed during the
flood (timed from the workers' results).  The job must finish with exit 0 and the weights of
an unfuzzed run of the same configuration (1e-6 relative).  Target: peak - baseline < 64 MB.

    python scripts/flood.py                       # the full run: 60 s per mode (docs/ROBUSTNESS.md)
    python scripts/flood.py --seconds 10 --steps 4000 --json out.json    # bounded (CI)

``send`` is one sender process alone (it reads a kit the run makes).  Traffic goes to loopback only.
"""
import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import fuzz  # the script next to this one: ZMTP by hand, the job's helpers

MODES = ("plain", "outsider", "slow")
SENDERS = 4
SAMPLE_SECONDS = 0.5
LIMIT_BYTES = 64 << 20
DEFAULT_SECONDS = 60.0
GAP_SECONDS = 5.0


# =========================================================================== one sender
#
# A sender of the plain mode imports nothing of mxps (importing the runtime imports MXNet,
# which takes seconds on a loaded machine): the run gives it a kit made with the runtime's own
# modules, the requests' header frames.  The modes with the secret seal their messages with
# the runtime's data plane (mxps.wire.tcp, seal), reading the secret from the kit's file.

def make_kit(path, secret_file):
    """Write the senders' kit: well-formed requests as a worker sends them (header frames,
    payload sizes) and where the job's secret is."""
    from mxps_tools import runtime
    wire = runtime.module("wire.frame")
    auth = runtime.module("wire.auth")
    H, T = wire.Header, wire.MsgType
    f32 = wire.dtype_code("float32")
    big = 256 << 10
    n = big // 4
    requests = [(H(T.PUSH, key=0, length=n, dtype=f32, iteration=1), big),
                (H(T.PUSHPULL, key=1, length=n, dtype=f32, iteration=1), big),
                (H(T.PULL, key=0, length=n, iteration=1), None),
                (H(T.INIT, key=9, length=n, dtype=f32), big),
                (H(T.PROBE), big)]
    slow = [(H(T.PULL, key=0, length=n, iteration=1), None), (H(T.PROBE), 1 << 20)]
    with open(secret_file, "rb") as f:
        auth.Credentials(f.read().strip())          # a secret the job can use
    kit = {"requests": [[h.pack().hex(), size] for h, size in requests],
           "slow": [[h.pack().hex(), size] for h, size in slow],
           "secret_file": secret_file}
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(kit, f)


def _frames(specs):
    return [[bytes.fromhex(h)] + ([bytes(size)] if size is not None else [])
            for h, size in specs]


def send_plain(host, port, kit, until, stats):
    """Raw TCP, no secret: a NULL greeting claiming to be worker 0, then requests, until the
    server closes the connection; again and again."""
    msgs = [fuzz.zmtp_message(m) for m in _frames(kit["requests"])]
    hello = fuzz.zmtp_greeting(b"NULL") + fuzz.zmtp_ready(b"worker:0")
    i = 0
    while time.monotonic() < until:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(1.0)
        try:
            s.connect((host, port))
            stats["connections"] += 1
            s.sendall(hello)
            while time.monotonic() < until:
                s.sendall(msgs[i % len(msgs)])
                stats["messages"] += 1
                stats["bytes"] += len(msgs[i % len(msgs)])
                i += 1
        except OSError:
            pass                    # closed by the server: connect again
        finally:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()


def send_zmq(host, port, kit, identity, nonce, seconds, stats, slow):
    """The data plane with the job's secret, a non-member identity: sealed requests as fast as
    the server takes them (``slow``: PULLs and PROBEs, and never a read)."""
    import zmq
    from mxps_tools import runtime
    tcp, auth = runtime.module("wire.tcp"), runtime.module("wire.auth")
    with open(kit["secret_file"], "rb") as f:
        settings = tcp.Settings(auth.Credentials(f.read().strip()))

    def connect():
        s = tcp.connect_data(host, port, settings, identity, nonce)
        s.setsockopt(zmq.LINGER, 0)
        stats["connections"] += 1
        return s

    sock = connect()
    stats["started"] = time.time()            # after the imports
    until = time.monotonic() + seconds
    msgs = _frames(kit["slow" if slow else "requests"])
    i = 0
    try:
        while time.monotonic() < until:
            m = msgs[i % len(msgs)]
            try:
                if not sock.poll(100, zmq.POLLOUT):
                    raise zmq.Again()
                sock.send_multipart(sock.seal.seal(m[0], m[1:]), flags=zmq.DONTWAIT,
                                    copy=False)
                stats["messages"] += 1
                stats["bytes"] += sum(len(f) for f in m)
                i += 1
            except zmq.Again:
                # the queue is full: a server that refused the handshake takes nothing, so
                # the sender connects again (and is refused again), as a flooder would
                stats["blocked_ms"] += 100
                sock.close(0)
                sock = connect()
            if not slow:
                while sock.poll(0):
                    sock.recv_multipart()
                    stats["answers"] += 1
        if slow:                     # what came back without being read
            while sock.poll(200):
                sock.recv_multipart()
                stats["answers"] += 1
    finally:
        sock.close(0)
        # sealed frames go zero-copy: the context is ended (every frame released) before the
        # interpreter is, or zmq's release of a frame can outlive Python
        tcp.context().term()


def send_main(args):
    with open(args.kit) as f:
        kit = json.load(f)
    host, port = args.target.rsplit(":", 1)
    stats = {"connections": 0, "messages": 0, "bytes": 0, "answers": 0, "blocked_ms": 0,
             "started": time.time()}
    until = time.monotonic() + args.seconds
    if args.mode == "plain":
        send_plain(host, int(port), kit, until, stats)
    else:
        # a node's name beyond the job's workers (the server refuses each request of it)
        send_zmq(host, int(port), kit, b"worker:%d" % (100 + os.getpid() % 100000),
                 bytes.fromhex(args.nonce), args.seconds, stats, slow=args.mode == "slow")
    stats["ended"] = time.time()
    with open(args.json, "w") as f:
        json.dump(stats, f)
    return 0


# =========================================================================== the whole run

class RssWatch:
    """Samples the RSS of some processes every SAMPLE_SECONDS (called from the job's poll)."""

    def __init__(self, pids):
        import psutil
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.samples = {name: [] for name in pids}     # (wall time, bytes)
        self.next = 0.0

    def __call__(self, job=None):
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + SAMPLE_SECONDS
        wall = time.time()
        for name, p in self.procs.items():
            try:
                self.samples[name].append((wall, p.memory_info().rss))
            except Exception:            # the process is gone
                pass

    def between(self, name, t0, t1):
        return [v for t, v in self.samples[name] if t0 <= t <= t1]


def spawn_senders(mode, target, nonce, seconds, kit, work, phase):
    procs = []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "MXPS_"))}
    for i in range(SENDERS):
        path = os.path.join(work, "%s-%d.json" % (phase, i))
        argv = [sys.executable, os.path.abspath(__file__), "send", "--mode", mode,
                "--target", target, "--nonce", nonce, "--seconds", str(seconds), "--kit", kit,
                "--json", path]
        procs.append((path, subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                             start_new_session=True)))
    return procs


def run(args):
    from mxps_tools import jobs
    work = tempfile.mkdtemp(prefix="mxps-flood-")
    secret_file = os.path.join(work, "secret")
    with open(secret_file, "w") as f:
        f.write(secrets.token_hex(32))
    os.chmod(secret_file, 0o600)
    kit = os.path.join(work, "kit.json")
    make_kit(kit, secret_file)
    result = {"seconds": args.seconds, "steps": args.steps, "senders": SENDERS, "phases": []}
    senders = []
    try:
        out = os.path.join(work, "flooded")
        job = fuzz.run_job(jobs, args.steps, out, secret_file, os.path.join(work, "logs"),
                           args.timeout)
        with job:
            job.wait(lambda: (job.job_info() or {}).get("servers"), args.timeout,
                     "the rendezvous")
            info = job.job_info()
            by_rank = {s["rank"]: s for s in info["servers"]}
            victim, other = by_rank[0], by_rank[1]
            target = "%s:%d" % (victim["host"], victim["port"])
            result["target"] = "server 0 (%s)" % target
            watch = RssWatch({"server 0": victim["pid"], "server 1": other["pid"]})
            job.on_poll = watch

            def wait_until(t, what):
                job.wait(lambda: time.monotonic() >= t or job.all_exited(),
                         t - time.monotonic() + 30, what)

            wait_until(time.monotonic() + args.warmup, "the warm-up")
            for mode in args.modes:
                if job.all_exited():
                    break
                phase = {"mode": mode}
                procs = spawn_senders(mode, target, victim.get("seal", ""), args.seconds, kit,
                                      work, mode)
                senders += [p for _, p in procs]
                job.wait(lambda: all(p.poll() is not None for _, p in procs) or
                         job.all_exited(), args.seconds + 120, "the %s senders' end" % mode)
                wait_until(time.monotonic() + args.gap, "the pause after %s" % mode)
                job.poll()
                phase["alive_after"] = sorted(n.name for n in job.nodes if n.returncode is None)
                phase["senders"] = []
                for path, p in procs:
                    output = p.communicate()[0].decode(errors="replace")
                    if p.returncode != 0 or not os.path.exists(path):
                        raise SystemExit("a %s sender failed (rc %s):\n%s"
                                         % (mode, p.returncode, output[-3000:]))
                    with open(path) as f:
                        phase["senders"].append(json.load(f))
                # the flood: from the first sender's start to the last one's end (each
                # starts once it has imported what it needs)
                phase["window"] = [min(x["started"] for x in phase["senders"]),
                                   max(x["ended"] for x in phase["senders"])]
                result["phases"].append(phase)
            job.wait(job.all_exited, args.timeout, "the end of the flooded job")
        res = job.result
        result["job"] = {"ok": res.ok, "codes": {n.name: n.returncode for n in res.nodes},
                         "reason": res.reason, "seconds": res.wall_seconds}
        result["logs"] = {n.name: fuzz.log_summary(n.read("err")) for n in res.nodes}
        result["log_tails"] = {n.name: n.read("err")[-1500:] for n in res.nodes
                               if n.returncode != 0 or "Traceback" in n.read("err")}
        spans = fuzz.step_timeline(out) if res.ok else []
        if spans:
            result["training"] = [spans[0][0], spans[-1][1]]
        for phase in result["phases"]:
            t0, t1 = phase["window"]
            for name in watch.samples:
                before = watch.between(name, t0 - 2.0, t0)
                during = watch.between(name, t0, t1)
                if not before or not during:
                    continue
                base = statistics.median(before)
                phase.setdefault("rss", {})[name] = {
                    "baseline": base, "peak": max(during), "end": during[-1],
                    "growth": max(during) - base, "samples": len(during)}
            phase["steps_during"] = fuzz.steps_within(spans, t0, t1)
            phase["seconds"] = t1 - t0
            # training went on through the flood: steps ended during it, and after it
            phase["trained_throughout"] = phase["steps_during"] > 0 and spans[-1][1] >= t1
        result["rss_samples"] = {name: s for name, s in watch.samples.items()}
        ref = args.reference
        if ref is None and res.ok:
            ref = os.path.join(work, "reference")
            r = fuzz.run_job(jobs, args.steps, ref, secret_file, os.path.join(work, "ref-logs"),
                             args.timeout).run()
            if not r.ok:
                raise SystemExit("the reference job failed: %s" % r.describe())
        if res.ok:
            ref_spans = fuzz.step_timeline(ref)
            result["unflooded_steps_per_second"] = len(ref_spans) / (
                ref_spans[-1][1] - ref_spans[0][0])
            diffs = [fuzz.relative_differences(fuzz.load_weights(out, r),
                                               fuzz.load_weights(ref, r)) for r in (0, 1)]
            result["max_relative_difference"] = None if None in diffs else max(
                max(d.values()) for d in diffs)
            result["weights_equal"] = result["max_relative_difference"] is not None and \
                result["max_relative_difference"] <= fuzz.RTOL
        else:
            result["weights_equal"] = False
    finally:
        for p in senders:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if args.keep:
            print("kept %s" % work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return result


def table(result):
    from tabulate import tabulate
    mb = 1 << 20
    rows = []
    for ph in result["phases"]:
        sent = ph["senders"]
        r = ph.get("rss", {}).get("server 0", {})
        o = ph.get("rss", {}).get("server 1", {})
        rows.append([
            ph["mode"], "%.0f" % ph["seconds"], sum(s["messages"] for s in sent),
            "%.0f" % (sum(s["bytes"] for s in sent) / mb),
            sum(s["connections"] for s in sent), sum(s["answers"] for s in sent),
            "%.0f" % (r.get("baseline", 0) / mb), "%.0f" % (r.get("peak", 0) / mb),
            "%.0f" % (r.get("end", 0) / mb), "%+.1f" % (r.get("growth", 0) / mb),
            "%+.1f" % (o.get("growth", 0) / mb),
            "%d (%.0f/s)" % (ph["steps_during"], ph["steps_during"] / max(ph["seconds"], 1e-9))])
    text = tabulate(rows, headers=[
        "flood", "s", "requests sent", "MB sent", "connections", "answers",
        "server 0 RSS before (MB)", "peak", "end", "growth", "server 1 growth",
        "training steps during"], tablefmt="github")
    if result.get("unflooded_steps_per_second"):
        text += "\n\nthe unflooded run trained at %.0f steps/s" % result[
            "unflooded_steps_per_second"]
    job = result.get("job", {})
    summary = [
        ["job result", "ok (every node exit 0)" if job.get("ok") else
         "FAILED: %s" % job.get("reason")],
        ["weights equal to the unflooded run (%.0e)" % fuzz.RTOL,
         "%s (max relative difference %s)" % ("yes" if result.get("weights_equal") else "NO",
                                              result.get("max_relative_difference"))],
        ["training went on through every flood",
         "yes" if all(p.get("trained_throughout") for p in result["phases"]) else "NO"],
        ["tracebacks / fatal errors logged", ", ".join(
            "%s %d/%d" % (n, v["tracebacks"], v["fatal"])
            for n, v in sorted(result.get("logs", {}).items()))],
    ]
    return text + "\n\n" + tabulate(summary, tablefmt="github")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command")
    s = sub.add_parser("send", help="one sender process alone")
    s.add_argument("--mode", choices=MODES, required=True)
    s.add_argument("--target", required=True, help="host:port of the server")
    s.add_argument("--seconds", type=float, default=DEFAULT_SECONDS)
    s.add_argument("--kit", required=True, help="made by the run (make_kit)")
    s.add_argument("--nonce", default="", help="the server's data-plane nonce (hex)")
    s.add_argument("--json", required=True)
    ap.add_argument("--seconds", type=float, default=DEFAULT_SECONDS, help="per flood")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps (default: enough for every flood at 4 ms a step)")
    ap.add_argument("--warmup", type=float, default=5.0,
                    help="seconds of training before the first flood")
    ap.add_argument("--gap", type=float, default=GAP_SECONDS, help="seconds between floods")
    ap.add_argument("--timeout", type=float, default=1800, help="for each job")
    ap.add_argument("--reference", help="an unflooded run's JOB_OUT with the same steps")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    if args.command == "send":
        return send_main(args)
    if args.steps is None:
        span = args.warmup + len(args.modes) * (args.seconds + args.gap)
        args.steps = int(span / 0.004) + 500
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(table(result))
    ok = (result.get("job", {}).get("ok") and result.get("weights_equal") and all(
        p.get("trained_throughout") and p.get("rss", {}).get("server 0", {}).get(
            "growth", LIMIT_BYTES) < LIMIT_BYTES for p in result["phases"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
