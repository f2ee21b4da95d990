#!/usr/bin/env python
"""CPU per DATA datagram of a worker's LTP send path (``Sender.pump``: rate model, packets made
and tagged, sendmmsg) on loopback: one path to a socket nobody reads (the kernel still delivers
each datagram to it, or drops it when its buffer is full), pacing far above what is sent, a
4 MB float32 push again and again.  Process CPU time over the DATA packets sent.

    python scripts/ltp_send_cpu.py [--mtu 1500 9000] [--pushes 10] [--profile]
    python scripts/ltp_send_cpu.py --mtu 1500 --paced 6.25e6 [--seconds 5] [--ack-every 8]

``--paced``: the sender as a worker's I/O thread runs it (``measure_paced``): pumped when its
pacing says, ACKs coming back, the CPU of ``pump`` and ``receive`` per DATA datagram.

MXPS_PURE_PYTHON=1 measures the twins instead of the compiled kernels.
"""
import argparse
import cProfile
import json
import os
import pstats
import socket
import time
import types

import numpy as np

from mxps.kernels import ltp as kernels
from mxps.kernels import ltp_packet as pk
from mxps.ltp.rate import PathRate
from mxps.ltp.sender import PUMP_CREDIT, Sender


def measure(mtu, pushes, profile=False):
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    tx = Sender(0, "127.0.0.1")
    budget = pk.payload_budget(mtu)
    fast = 5e9                      # bytes/s: pacing never holds a packet back
    tx.add_path(0, "127.0.0.1", json.dumps({"port": rx.getsockname()[1],
                                             "key": os.urandom(32).hex(),
                                             "budget": budget}).encode(),
                time.monotonic(), initial_rate=fast)
    grad = np.random.default_rng(0).random(1 << 20, dtype=np.float32)      # 4 MB
    path = tx.paths[0]

    def run(n):
        sent = 0
        for r in range(n):
            h = types.SimpleNamespace(length=grad.size, dtype=0, key=3, plan_version=1,
                                      iteration=r, offset=0)
            tx.enqueue(0, h, grad, 4, lambda push: None)
            while path.queue:
                tx.pump(time.monotonic())
            sent += tx.counts["data"]
            tx.counts.clear()
            path.waiting.clear()           # no ACKs come: start the next push afresh
            path.ends.clear()
            path.rate = PathRate(time.monotonic(), initial_rate=fast, mss=budget + pk.OVERHEAD,
                                 burst=PUMP_CREDIT)
        return sent

    run(1)
    c0 = time.process_time()
    n = run(pushes)
    cpu = time.process_time() - c0
    if profile:
        cProfile.runctx("run(max(1, pushes // 2))", globals(), {"run": run, "pushes": pushes},
                        "/tmp/ltp_send_cpu.prof")
        pstats.Stats("/tmp/ltp_send_cpu.prof").sort_stats("tottime").print_stats(12)
    rx.close()
    tx.close()
    return {"mtu": mtu, "implementation": kernels.IMPLEMENTATION, "datagrams": n,
            "us_per_datagram": cpu / n * 1e6, "datagrams_per_s_per_core": n / cpu,
            "payload_gbit_per_s_per_core": n * budget * 8 / cpu / 1e9}


def measure_paced(mtu, rate, seconds, ack_every):
    """The sender as a worker's I/O thread runs it: pumped when its pacing says (the loop's
    whole-millisecond sleeps), at ``rate`` bytes/s (the server's grant), with an ACK of every
    ``ack_every`` packets coming back from the "server" socket, which reads the DATA packets.
    CPU time (this thread) of ``pump`` and ``receive`` only, per DATA datagram."""
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    tx = Sender(0, "127.0.0.1")
    budget = pk.payload_budget(mtu)
    key = os.urandom(32)
    tx.add_path(0, "127.0.0.1", json.dumps({"port": rx.getsockname()[1], "key": key.hex(),
                                             "budget": budget}).encode(),
                time.monotonic(), initial_rate=rate)
    tagger = pk.Tagger(key)
    grad = np.random.default_rng(0).random(1 << 20, dtype=np.float32)      # 4 MB
    me = ("127.0.0.1", tx.port)
    pending, cpu, r = [], 0.0, 0
    end = time.monotonic() + seconds
    data0 = tx.counts["data"]
    while time.monotonic() < end:
        if not tx.paths[0].queue and not tx.paths[0].waiting:
            r += 1
            h = types.SimpleNamespace(length=grad.size, dtype=0, key=3, plan_version=1,
                                      iteration=r, offset=0)
            tx.enqueue(0, h, grad, 4, lambda push: None)
        c0 = time.thread_time()
        wake = tx.pump(time.monotonic())
        tx.receive(time.monotonic())
        cpu += time.thread_time() - c0
        while True:                         # the "server": read, ACK every ack_every
            try:
                dgram = rx.recv(65536)
            except BlockingIOError:
                break
            pending.append(int.from_bytes(dgram[8:12], "little"))
            if len(pending) >= ack_every or dgram[3] == pk.END:
                for ack in pk.encode_acks(tagger, 0, pending, rate, rate):
                    rx.sendto(ack, me)
                pending = []
        if wake is not None:
            time.sleep(max(0.0, min(0.002, wake - time.monotonic())))
    n = tx.counts["data"] - data0
    rx.close()
    tx.close()
    return {"mtu": mtu, "implementation": kernels.IMPLEMENTATION, "datagrams": n,
        "us_per_datagram": cpu / n * 1e6, "datagrams_per_s_per_core": n / cpu,
        "payload_gbit_per_s_per_core": n * budget * 8 / cpu / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mtu", type=int, nargs="+", default=[1500, 9000])
    ap.add_argument("--pushes", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--paced", type=float, metavar="BYTES_PER_S",
                    help="measure_paced at this rate instead (e.g. 6.25e6: an eighth of 400 "
                         "Mbit/s)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--ack-every", type=int, default=8)
    args = ap.parse_args()
    for mtu in args.mtu:
        if args.paced:
            r = measure_paced(mtu, args.paced, args.seconds, args.ack_every)
        else:
            r = measure(mtu, args.pushes, args.profile)
        print("MTU %(mtu)d (%(implementation)s): %(datagrams)d datagrams, %(us_per_datagram).2f us "
              "CPU each, %(datagrams_per_s_per_core).0f/s per core, "
              "%(payload_gbit_per_s_per_core).2f Gbit/s of payload per core" % r)


if __name__ == "__main__":
    main()
