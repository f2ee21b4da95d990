#!/usr/bin/env python3
"""How fast a server takes LTP's gradient packets: Gbit/s received and summed per core, on
loopback (target >= 1 Gbit/s per core of the receiver).

One sender process sends DATA packets of a float32 gradient slice (64 MB by default) as fast as
its window allows, round after round, at one receiver process that runs the server's real code
path: ``ltp.receiver.Receiver.receive`` (read a batch, check address and tag, decode, ACK after
the batch) handing every packet to ``roles.server_state.ServerState.take_packet`` (the round's
bookkeeping and the scatter-add into its accumulator, Early Close, the round's completion), the
way ``roles.server`` does; one worker, the acceptance ratio 1 (every packet is waited for), no
optimizer (the server serves the sum).  The sender keeps a window of packets in flight from the
ACKs, so the receiver's socket buffer does not overflow and what is measured is the receiver's
cost per packet, not the kernel's drops, and sends each round's END until it is ACKed, as a
worker does.

Per packet size (the IP MTU: 65535 is 64 KB datagrams, then 9000 and 1500) and per
implementation (``cython``: the compiled kernels; ``python``: MXPS_PURE_PYTHON=1, every twin),
reported: the receiver's CPU time (user + system, ``resource.getrusage``) from its first packet
to its last, gradient bytes summed (payload of DATA packets the server added), Gbit/s of that per
receiver CPU second ("per core") and per wall second, packets/s per receiver CPU second, and the
sender's CPU per packet; ``tx_lost`` (datagrams the receiver never read), ``stalls`` (windows the
sender gave up waiting for) and ``end_resent`` say whether the run was clean.  On loopback the
kernel delivers a datagram into the receiver's socket in the sender's system call, so that work
is the sender's CPU, not the receiver's; everything after it (reading, checking, adding, the
rounds) is the receiver's.  The wall rate depends on what else the machine runs; the per-core
rate much less.  Loopback only (127.0.0.1).

    flock /tmp/mxps-bench.lock python scripts/ltp_loopback.py
    flock /tmp/mxps-bench.lock python scripts/ltp_loopback.py --mtu 1500 --impl cython \\
        --seconds 5 --json out.json

``sender`` and ``receiver`` are the two processes of one measurement (the run starts them).
"""
import argparse
import json
import os
import select
import subprocess
import sys
import time

HOST = "127.0.0.1"
MTUS = (65535, 9000, 1500)
IMPLS = ("cython", "python")
WINDOW_BYTES = 1 << 20        # datagram bytes in flight: far below the receiver's socket
                              # buffer (Receiver.RCVBUF, or net.core.rmem_max if smaller)
BURST = 32                    # packets per send_batch (the worker's sender.BURST)
END_RTO = 0.02                # the END is resent after this long without its ACK
STALL = 0.5                   # no ACK for this long with a full window: count the rest lost
IDLE_END = 0.2                # the receiver stops this long after the sender is done
SETUP_TIMEOUT = 120.0


def _line(stream, deadline, what):
    """One JSON line from a child's pipe before ``deadline`` (monotonic), or RuntimeError."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError("no %s within %.0f s" % (what, SETUP_TIMEOUT))
        r, _, _ = select.select([stream], [], [], left)
        if r:
            line = stream.readline()
            if not line:
                raise RuntimeError("the %s process ended before its %s" % (what.split()[0], what))
            return json.loads(line)


def _rusage_cpu():
    import resource
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# ================================================================================ sender

def sender(args):
    """Send rounds of DATA packets + END of one float32 slice for ``--seconds``."""
    import numpy as np

    from mxps.kernels import ltp as kernels
    from mxps.kernels import ltp_packet as pk
    from mxps.ltp.sender import Sender

    length = args.mb * (1 << 20) // 4
    grad = np.random.default_rng(1).standard_normal(length).astype(np.float32)
    data = memoryview(grad).cast("B")
    s = Sender(0, HOST)
    print(json.dumps({"host": s.host, "port": s.port}), flush=True)
    reply = json.loads(sys.stdin.readline())
    addr = (HOST, reply["port"])
    tagger = pk.Tagger(bytes.fromhex(reply["key"]))
    epp = pk.elements_per_packet(reply["budget"], 4)
    n = pk.packet_count(length, epp)
    window = max(BURST, WINDOW_BYTES // (epp * 4 + pk.OVERHEAD))
    sock = s.sock
    ring = bytearray(16 * 65536)
    st = {"pn": 0, "acked": 0, "last_ack": time.monotonic(), "ends": set(), "done_end": False,
          "stalls": 0, "end_resent": 0}

    def read_acks(timeout):
        if timeout > 0:
            select.select([sock], [], [], timeout)
        got = kernels.recv_batch(sock, ring, 65536, 16)
        for i, (size, _) in enumerate(got):
            for first, k in pk.decode_ack(memoryview(ring)[i * 65536:i * 65536 + size],
                                          tagger, 0):
                st["acked"] += k
                if any(first <= e < first + k for e in st["ends"]):
                    st["done_end"] = True
        if got:
            st["last_ack"] = time.monotonic()

    def send_all(msgs):
        while msgs:
            k = kernels.send_batch(sock, msgs)
            msgs = msgs[k:]
            if msgs:
                select.select([], [sock], [], 0.01)

    cpu0, t0 = _rusage_cpu(), time.monotonic()
    stop = t0 + args.seconds
    rounds = packets = 0
    r = 0
    while time.monotonic() < stop:
        r += 1
        seq = 0
        while seq < n:
            while st["pn"] - st["acked"] >= window:
                read_acks(0.005)
                if time.monotonic() - st["last_ack"] > STALL:      # lost: do not wait for them
                    st["acked"] = st["pn"]
                    st["stalls"] += 1
            msgs = []
            hi = min(n, seq + BURST, seq + window - (st["pn"] - st["acked"]))
            for i in range(seq, hi):
                count = min(epp, length - i * epp)
                payload = data[i * epp * 4:(i * epp + count) * 4]
                msgs.append((pk.encode(tagger, pk.DATA, 0, 0, st["pn"], 0, 0, r, 0, length, i,
                                       count, payload), addr))
                st["pn"] += 1
            seq = hi
            send_all(msgs)
            packets += len(msgs)
            read_acks(0)
        st["ends"], st["done_end"] = set(), False
        deadline = time.monotonic() + 10.0
        tries = 0
        while not st["done_end"]:
            if time.monotonic() > deadline:
                raise RuntimeError("round %d: the receiver never ACKed its END" % r)
            st["ends"].add(st["pn"])
            tries += 1
            send_all([(pk.encode(tagger, pk.END, 0, 0, st["pn"], 0, 0, r, 0, length, n, 0),
                       addr)])
            st["pn"] += 1
            t_end = time.monotonic() + END_RTO
            while not st["done_end"] and time.monotonic() < t_end:
                read_acks(0.002)
        st["end_resent"] += tries - 1
        rounds += 1
    cpu, wall = _rusage_cpu() - cpu0, time.monotonic() - t0
    print(json.dumps({"rounds": rounds, "packets": packets, "cpu": cpu, "wall": wall,
                      "datagrams": st["pn"], "stalls": st["stalls"],
                      "end_resent": st["end_resent"], "implementation": kernels.IMPLEMENTATION}),
          flush=True)


# ============================================================================== receiver

def receiver(args):
    """Take packets through Receiver.receive -> ServerState.on_packet until told to stop."""
    import numpy as np

    from mxps.kernels import accum, ltp as kernels
    from mxps.ltp.receiver import BATCH, Receiver
    from mxps.roles.server_state import LtpSettings, ServerState
    from mxps.wire.frame import Header, MsgType, dtype_code

    length = args.mb * (1 << 20) // 4
    rx = Receiver(HOST, 1, args.mtu)
    state = ServerState(0, 1, True, ltp=LtpSettings(rx.budget, ratio=1.0, deadline=0.0,
                                                    loss=lambda: rx.loss))
    init = np.zeros(length, dtype=np.float32)
    outs = state.on_request(b"w0", Header(MsgType.INIT, key=0, sender=0, length=length,
                                          dtype=dtype_code(np.float32), request_id=1), init)
    assert [o.header.type for o in outs] == [MsgType.ACK], outs
    peer = json.loads(sys.stdin.readline())
    reply = rx.hello(0, json.dumps({"host": peer["host"], "port": peer["port"],
                                    "mtu": args.mtu}).encode())
    print(reply.decode(), flush=True)

    summed = [0]
    take = state.take_packet

    def handle(f, payload, now):      # as roles.server, which sends state.outs() per batch
        take(f, payload, now)
        summed[0] += payload.nbytes   # END: 0; dropped packets are counted in state_drops

    poll = select.poll()
    poll.register(rx.sock, select.POLLIN)
    poll.register(sys.stdin, select.POLLIN)
    first = last = None
    cpu_first = cpu_last = 0.0
    stopping = None
    datagrams = 0
    while True:
        wake = state.next_wake()
        timeout = 50 if wake is None else max(0, min(50, int((wake - time.monotonic()) * 1e3)))
        events = dict(poll.poll(timeout))
        now = time.monotonic()
        if sys.stdin.fileno() in events and stopping is None:
            sys.stdin.readline()
            stopping = now
        if rx.sock.fileno() in events:
            if first is None:
                first, cpu_first = now, _rusage_cpu()
            for _ in range(BATCH):
                got = rx.receive(handle, now)
                state.outs()
                if not got:
                    break
                datagrams += got
                now = time.monotonic()
            last, cpu_last = time.monotonic(), _rusage_cpu()
        state.on_tick(time.monotonic())
        if stopping is not None and time.monotonic() - max(stopping, last or 0) > IDLE_END:
            break
    stats = state.ltp_stats
    print(json.dumps({"cpu": cpu_last - cpu_first, "wall": (last or 0) - (first or 0),
                      "datagrams": datagrams, "verified": rx.counts["packets"],
                      "summed_bytes": summed[0], "rounds": stats["rounds"],
                      "closes": {k[6:]: v for k, v in stats.items() if k.startswith("close_")},
                      "drops": dict(rx.drops.counts),
                      "state_drops": {k: v for k, v in stats.items() if k.startswith("drop_")},
                      "budget": rx.budget, "rcvbuf": rx.rcvbuf,
                      "implementation": [kernels.IMPLEMENTATION, accum.IMPLEMENTATION]}),
          flush=True)


# =================================================================================== run

def measure(impl, mtu, args):
    """One sender/receiver pair; the two processes' reports."""
    env = dict(os.environ)
    env.pop("MXPS_PURE_PYTHON", None)
    if impl == "python":
        env["MXPS_PURE_PYTHON"] = "1"
    me = [sys.executable, os.path.abspath(__file__)]
    common = ["--mtu", str(mtu), "--mb", str(args.mb), "--seconds", str(args.seconds)]
    deadline = time.monotonic() + SETUP_TIMEOUT
    procs = []
    try:
        snd = subprocess.Popen(me + ["sender"] + common, env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        procs.append(snd)
        rcv = subprocess.Popen(me + ["receiver"] + common, env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        procs.append(rcv)
        peer = _line(snd.stdout, deadline, "sender address")
        rcv.stdin.write(json.dumps(peer) + "\n")
        rcv.stdin.flush()
        reply = _line(rcv.stdout, deadline, "receiver hello reply")
        snd.stdin.write(json.dumps(reply) + "\n")
        snd.stdin.flush()
        done = time.monotonic() + args.seconds + SETUP_TIMEOUT
        s_rep = _line(snd.stdout, done, "sender report")
        rcv.stdin.write("stop\n")
        rcv.stdin.flush()
        r_rep = _line(rcv.stdout, time.monotonic() + SETUP_TIMEOUT, "receiver report")
        for p in procs:
            p.wait(timeout=SETUP_TIMEOUT)
            if p.returncode:
                raise RuntimeError("a %s process exited with %d" % (impl, p.returncode))
        return s_rep, r_rep
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def row(impl, mtu, s, r):
    gbits = r["summed_bytes"] * 8 / 1e9
    return {"impl": impl, "mtu": mtu, "payload_B": r["budget"],
            "Gbit/s/core": gbits / r["cpu"] if r["cpu"] else 0.0,
            "Gbit/s wall": gbits / r["wall"] if r["wall"] else 0.0,
            "kpkt/s/core": r["verified"] / r["cpu"] / 1e3 if r["cpu"] else 0.0,
            "us/pkt": 1e6 * r["cpu"] / r["verified"] if r["verified"] else 0.0,
            "summed_MB": r["summed_bytes"] / 2 ** 20, "rx_cpu_s": r["cpu"],
            "rounds": r["rounds"], "tx_us/pkt": 1e6 * s["cpu"] / max(1, s["datagrams"]),
            "tx_lost": s["datagrams"] - r["datagrams"], "stalls": s["stalls"],
            "end_resent": s["end_resent"],
            "drops": sum(r["drops"].values()) + sum(r["state_drops"].values())}


def run(args):
    from tabulate import tabulate
    rows, raw = [], []
    for mtu in args.mtu:
        for impl in args.impl:
            s, r = measure(impl, mtu, args)
            if r["implementation"] != [impl, impl] or s["implementation"] != impl:
                raise RuntimeError("asked for %s, ran %s / %s" % (impl, r["implementation"],
                                                                 s["implementation"]))
            rows.append(row(impl, mtu, s, r))
            raw.append({"impl": impl, "mtu": mtu, "sender": s, "receiver": r})
            print(tabulate([rows[-1]], headers="keys", floatfmt=".3g"), flush=True)
    print()
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "raw": raw, "mb": args.mb, "seconds": args.seconds}, f,
                      indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", nargs="?", default="run", choices=("run", "sender", "receiver"))
    ap.add_argument("--mtu", type=int, nargs="+", default=list(MTUS),
                    help="IP MTUs (65535: 64 KB datagrams)")
    ap.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--seconds", type=float, default=4.0, help="sending time per measurement")
    ap.add_argument("--mb", type=int, default=64, help="the gradient slice, MB of float32")
    ap.add_argument("--json", help="write rows and raw reports here")
    args = ap.parse_args(argv)
    if args.role == "sender":
        args.mtu = args.mtu[0]
        sender(args)
    elif args.role == "receiver":
        args.mtu = args.mtu[0]
        receiver(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
