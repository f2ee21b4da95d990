#!/usr/bin/env python
"""CPU per datagram of a server's LTP intake with W workers interleaved, in one process on
loopback: ``Receiver.receive`` (read, check, open, the path's loss and order, the grant's
arrival windows, ACKs) handing every packet to ``ServerState.take_packet`` (the round's
bookkeeping and scatter-add, Early Close, the round's completion), as ``roles.server`` does.

W worker sockets send their DATA packets of one float32 slice in bursts of ``--burst``
(round-robin over the workers, as paced senders interleave at a server) and a few percent of
them not at all (``--drop``: the server's rounds then close by their ENDs, as under loss);
the receiver reads whenever ``--window`` datagrams are in its socket.  Only the receiver's
calls are timed (``time.thread_time`` around ``receive`` and ``outs``), so the sending does
not count; the ACKs the receiver sends are part of its cost (to sockets nobody reads: the
kernel drops them once their buffers fill).  Unlike scripts/ltp_loopback.py (one sender in
another process, the receiver's whole process CPU), this isolates the per-packet work of the
server's code with as many paths as a job has.

    python scripts/ltp_intake_cpu.py [--workers 8] [--mtu 1500] [--rounds 20] [--json F]

MXPS_PURE_PYTHON=1 measures the twins instead of the compiled kernels.
"""
import argparse
import json
import os
import random
import socket
import time

import numpy as np

from mxps.kernels import ltp as kernels
from mxps.kernels.ltp import send_batch
from mxps.kernels import ltp_packet as pk
from mxps.ltp.receiver import Receiver
from mxps.roles.server_state import LtpSettings, ServerState
from mxps.wire.frame import Header, MsgType, dtype_code

HOST = "127.0.0.1"


def measure(workers, mtu, rounds, burst, window, drop, elements, fast=True, seed=0):
    rx = Receiver(HOST, workers, mtu)
    state = ServerState(0, workers, True, ltp=LtpSettings(rx.budget, loss=lambda: rx.loss,
                                                          reordered=lambda: rx.reordered_at,
                                                          share=rx.share))
    init = np.zeros(elements, dtype=np.float32)
    state.on_request(b"w0", Header(MsgType.INIT, key=0, sender=0, length=elements,
                                   dtype=dtype_code(np.float32), request_id=1), init)
    socks, taggers = [], []
    for w in range(workers):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((HOST, 0))
        s.setblocking(False)
        reply = json.loads(rx.hello(w, json.dumps({"host": HOST, "port": s.getsockname()[1],
                                                   "mtu": mtu}).encode()))
        socks.append(s)
        taggers.append(pk.Tagger(bytes.fromhex(reply["key"])))
    addr = (HOST, rx.port)
    epp = pk.elements_per_packet(rx.budget, 4)
    n = pk.packet_count(elements, epp)
    grad = np.random.default_rng(seed).random(elements, dtype=np.float32)
    data = memoryview(grad).cast("B")
    rng = random.Random(seed)
    pns = [0] * workers
    cpu = 0.0
    datagrams = 0
    take = state.take_packet
    table = state.ltp_fast if fast else None

    def drain():
        nonlocal cpu, datagrams
        c0 = time.thread_time()
        while True:
            got = rx.receive(take, time.monotonic(), table, state.plan_version,
                             state.fast_taken)
            state.outs()
            if not got:
                break
            datagrams += got
        cpu += time.thread_time() - c0

    for r in range(1, rounds + 1):
        queued = 0
        for start in range(0, n, burst):
            for w in range(workers):
                msgs = []
                for seq in range(start, min(n, start + burst)):
                    count = min(epp, elements - seq * epp)
                    pn = pns[w]
                    pns[w] += 1
                    if rng.random() < drop:
                        continue
                    lo = seq * epp * 4
                    msgs.append((pk.encode(taggers[w], pk.DATA, w, 0, pn, 0, 0, r, 0,
                                           elements, seq, count, data[lo:lo + count * 4]),
                                 addr))
                if msgs:
                    send_batch(socks[w], msgs)
                    queued += len(msgs)
                if queued >= window:
                    drain()
                    queued = 0
        for w in range(workers):
            send_batch(socks[w], [(pk.encode(taggers[w], pk.END, w, 0, pns[w], 0, 0, r, 0,
                                             elements, n, 0), addr)])
            pns[w] += 1
        drain()
        state.on_tick(time.monotonic() + 1.0)
    stats = state.ltp_stats
    for s in socks:
        s.close()
    rx.close()
    return {"workers": workers, "mtu": mtu, "implementation": kernels.IMPLEMENTATION,
            "fast": fast, "datagrams": datagrams, "taken_fast": rx.counts["fast"], "rounds": stats["rounds"],
            "closes": {k[6:]: v for k, v in stats.items() if k.startswith("close_")},
            "drops": {k: v for k, v in stats.items() if k.startswith("drop_")},
            "us_per_datagram": cpu / max(1, datagrams) * 1e6, "cpu_s": cpu}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--burst", type=int, default=5, help="packets a worker sends at once")
    ap.add_argument("--window", type=int, default=256, help="datagrams queued before a read")
    ap.add_argument("--drop", type=float, default=0.05, help="fraction never sent")
    ap.add_argument("--mb", type=float, default=2.0, help="slice size, MB of float32")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-fast", action="store_true",
                    help="every packet through ServerState.take_packet (no intake fast path)")
    ap.add_argument("--json")
    args = ap.parse_args()
    out = []
    for _ in range(args.repeat):
        r = measure(args.workers, args.mtu, args.rounds, args.burst, args.window, args.drop,
                    int(args.mb * (1 << 20)) // 4, fast=not args.no_fast)
        out.append(r)
        print("%(implementation)s W=%(workers)d MTU %(mtu)d fast=%(fast)s: %(datagrams)d datagrams"
              " (%(taken_fast)d fast), %(us_per_datagram).2f us each; rounds %(rounds)d "
              "%(closes)s drops %(drops)s" % r,
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
