"""One node of the server microbenchmark: push + sum + pull of fixed arrays, no compute.

Run as every node of a parameter-server job (scheduler, servers and workers alike, as MXNet's
launcher does); on scheduler and server nodes the import of mxps (or mxnet, for native
kvstores) takes the role over.  Each worker initialises ``--keys`` float32 arrays of
``--elements`` each, then runs ``--warmup`` untimed and ``--rounds`` timed rounds of
``kv.pushpull`` of all of them (the servers sum the workers' pushes; no optimizer), and writes
one JSON line (``--out``) with every round's start and end (unix time) and the bytes it pushed
and pulled per round.

    python -m mxps_tools.wire_job --kvstore mxps --keys 4 --elements 4000000 --rounds 10
"""
import argparse
import json
import os
import time

_p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
_p.add_argument("--kvstore", default="mxps")
_p.add_argument("--keys", type=int, default=4)
_p.add_argument("--elements", type=int, default=4_000_000, help="float32 elements per key")
_p.add_argument("--rounds", type=int, default=10, help="timed rounds")
_p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
_p.add_argument("--out", default=None, help="append the result line to this file")
ARGS = _p.parse_args()

if ARGS.kvstore.startswith("mxps"):
    import mxps  # noqa: F401  (must precede mxnet: takes over server/scheduler roles)

import mxnet as mx  # noqa: E402


def main():
    kv = mx.kv.create(ARGS.kvstore)
    keys = list(range(ARGS.keys))
    shape = (ARGS.elements,)
    kv.init(keys, [mx.nd.zeros(shape) for _ in keys])
    grads = [mx.nd.ones(shape) * (kv.rank + 1) for _ in keys]
    outs = [mx.nd.zeros(shape) for _ in keys]
    starts, ends = [], []
    for r in range(ARGS.warmup + ARGS.rounds):
        t0 = time.time()
        kv.pushpull(keys, grads, out=outs)
        for o in outs:
            o.wait_to_read()
        if r >= ARGS.warmup:
            starts.append(t0)
            ends.append(time.time())
    # every worker must pull the same values: the servers' aggregate of all pushes (mxps:
    # the last round's sum; native ps-lite without an optimizer accumulates over rounds)
    got = float(outs[-1][-1].asscalar())
    line = json.dumps({"kvstore": ARGS.kvstore, "type": kv.type, "rank": kv.rank,
                       "num_workers": kv.num_workers, "keys": ARGS.keys,
                       "elements": ARGS.elements,
                       "round_bytes": 2 * 4 * ARGS.keys * ARGS.elements,
                       "round_start_abs": starts, "round_end_abs": ends, "sum": got,
                       "pid": os.getpid()})
    if ARGS.out:
        with open(ARGS.out, "a") as f:
            f.write(line + "\n")
    else:
        print(line, flush=True)


if __name__ == "__main__":
    main()
