"""Jobs that fail on purpose, for tests/test_failures.py.

Run as every node of a job (scheduler and server processes never get past ``import mxps``).
Workers do what FAULT_MODE says and report into FAULT_OUT:

  FAULT_MODE=train      (default) a small gluon MLP trained with ``kvstore='mxps'`` for
                        FAULT_STEPS steps, sleeping FAULT_STEP_SLEEP seconds after each.
                        After FAULT_READY_STEPS steps the worker writes ``ready_rank{R}.json``
                        ({rank, pid, step}); the test may then kill a node.
                        FAULT_EXIT_RANK / FAULT_EXIT_AFTER: that rank calls sys.exit(0) after
                        that many steps (fewer than the others).
                        FAULT_RAISE_RANK / FAULT_RAISE_AFTER: that rank raises RuntimeError.
                        At the end: ``weights_rank{R}.npz``.
                        FAULT_START_TOGETHER=1: workers wait for each other's mxnet import
                        before registering (for a short MXPS_TIMEOUT on busy machines).
                        FAULT_SAVE_STATES=1: the optimizer runs on the servers
                        (update_on_kvstore) and rank 0 saves its states (GET_STATES to every
                        server) after every step from FAULT_READY_STEPS on (the failure
                        matrix's save_states phase).
                        FAULT_ON_SERVERS=1: the optimizer runs on the servers without saving
                        (MXPS_FAILOVER's jobs); FAULT_MOMENTUM: SGD's momentum (default 0);
                        FAULT_OPTIMIZER=adam: Adam (learning rate 0.01) instead of SGD;
                        FAULT_COMPRESSION=2bit: 2-bit gradient compression (threshold 0.5).
  FAULT_MODE=badinput   tries bad requests on ``mx.kv.create('mxps')`` (unknown key, pull
                        before init, wrong shape / dtype, unsupported dtype), records each
                        exception in ``badinput_rank{R}.json``, then checks that the servers
                        still serve: pushpull of a good key (sum of all workers) and FAULT_STEPS
                        gluon training steps on different data per rank (``weights_rank{R}.npz``).
  FAULT_MODE=disagree   rank 0 and rank 1 initialise key 7 with different sizes (only rank 0's
                        value reaches the server).  Rank 1 sends a raw push of its size, which
                        the server refuses (``refused_rank1.json``); both ranks then pull key 8
                        from the same server (``served_rank{R}.json``); then rank 1 pushes key 7
                        through the kvstore, which ends the job with the server's message.
  FAULT_MODE=midstep    three keys initialised; rank 1 calls ``pushpull`` of all three with
                        the third gradient of a wrong shape, which raises ValueError after the
                        first two keys' operations are on MXNet's engine, waiting for the
                        servers (rank 0 pushes only FAULT_STEP_SLEEP seconds later); rank 1
                        writes ``ready_rank1.json`` ({rank, pid, time}) just before the call.
                        The process must end with the script's exception (exit 1).
  FAULT_MODE=config     not a job: one plain process; for each case in FAULT_CASES (JSON list of
                        {name, env: {VAR: value or null}}) sets the variables, calls
                        ``mx.kv.create('mxps')`` and records the outcome in ``config.json``.
"""
import json
import os
import sys
import time

import mxps  # noqa: F401  (must precede mxnet: takes over server/scheduler roles)
import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

MODE = os.environ.get("FAULT_MODE", "train")
OUT = os.environ["FAULT_OUT"]


def _int(name, default):
    v = os.environ.get(name, "").strip()
    return int(v) if v else default


def _write_json(name, obj):
    """Write atomically: the test polls for these files."""
    path = os.path.join(OUT, name)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def _net():
    from mxnet import gluon
    net = gluon.nn.HybridSequential(prefix="net_")
    with net.name_scope():
        net.add(gluon.nn.Dense(16, activation="relu", in_units=8))
        net.add(gluon.nn.Dense(4, in_units=16))
    mx.random.seed(7)
    net.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    return net


def _train(kv, steps, on_step=None, step_sleep=0.0, save_after=None):
    """``steps`` SGD steps through gluon.Trainer on ``kv`` with rank-dependent data; with
    ``save_after``, rank 0 saves the optimizer states after every step from that one on."""
    from mxnet import autograd, gluon
    net = _net()
    on_servers = save_after is not None or os.environ.get("FAULT_ON_SERVERS") == "1"
    kwargs = {"update_on_kvstore": True} if on_servers else {}
    opt = {"learning_rate": 0.1}
    momentum = float(os.environ.get("FAULT_MOMENTUM", "0") or 0)
    if momentum:
        opt["momentum"] = momentum
    name = os.environ.get("FAULT_OPTIMIZER", "sgd") or "sgd"
    if name == "adam":
        opt = {"learning_rate": 0.01}
    if os.environ.get("FAULT_COMPRESSION"):
        kwargs["compression_params"] = {"type": os.environ["FAULT_COMPRESSION"],
                                        "threshold": 0.5}
    trainer = gluon.Trainer(net.collect_params(), name, opt, kvstore=kv, **kwargs)
    states = os.path.join(OUT, "states_rank%d" % kv.rank)
    rng = np.random.RandomState(100 + kv.rank)
    loss_fn = gluon.loss.L2Loss()
    for step in range(1, steps + 1):
        x = mx.nd.array(rng.rand(8, 8))
        y = mx.nd.array(rng.rand(8, 4))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(8)
        mx.nd.waitall()
        if save_after is not None and kv.rank == 0 and step >= save_after:
            trainer.save_states(states)
        if on_step is not None:
            on_step(step)
        if step_sleep:
            time.sleep(step_sleep)
    mx.nd.waitall()
    weights = {name: p.data().asnumpy() for name, p in net.collect_params().items()}
    np.savez(os.path.join(OUT, "weights_rank%d.npz" % kv.rank), **weights)
    return weights


def _start_together():
    """FAULT_START_TOGETHER=1: every worker imports mxnet before any registers, so that a short
    MXPS_TIMEOUT (which is also the registration deadline) is not spent on a peer's import."""
    if os.environ.get("FAULT_START_TOGETHER") != "1":
        return
    open(os.path.join(OUT, "imported_%d" % os.getpid()), "w").close()
    want = int(os.environ["DMLC_NUM_WORKER"])
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if sum(f.startswith("imported_") for f in os.listdir(OUT)) >= want:
            return
        time.sleep(0.05)


def run_train():
    _start_together()
    kv = mx.kv.create("mxps")
    rank = kv.rank
    ready_after = _int("FAULT_READY_STEPS", 3)
    exit_rank, exit_after = _int("FAULT_EXIT_RANK", -1), _int("FAULT_EXIT_AFTER", -1)
    raise_rank, raise_after = _int("FAULT_RAISE_RANK", -1), _int("FAULT_RAISE_AFTER", -1)

    def on_step(step):
        if step == ready_after:
            _write_json("ready_rank%d.json" % rank, {"rank": rank, "pid": os.getpid(),
                                                     "step": step})
        if rank == exit_rank and step == exit_after:
            _write_json("exit_rank%d.json" % rank, {"rank": rank, "pid": os.getpid(),
                                                    "step": step, "time": time.time()})
            sys.exit(0)
        if rank == raise_rank and step == raise_after:
            raise RuntimeError("fault_job: injected failure on rank %d at step %d"
                               % (rank, step))

    _train(kv, _int("FAULT_STEPS", 1000000), on_step,
           float(os.environ.get("FAULT_STEP_SLEEP", "0") or 0),
           save_after=ready_after if os.environ.get("FAULT_SAVE_STATES") == "1" else None)


def _attempt(fn):
    try:
        fn()
        mx.nd.waitall()
    except Exception as e:   # record what the user would see
        return {"type": type(e).__name__, "message": str(e),
                "is_mxps_error": isinstance(e, (mxps.ConfigError, mxps.RemoteError))}
    return None


def run_badinput():
    kv = mx.kv.create("mxps")
    rank = kv.rank
    f32 = np.float32
    good = 100       # initialised below with shape (4,), float32
    res = {}
    res["push_unknown_key"] = _attempt(lambda: kv.push(999, mx.nd.ones((4,))))
    res["pull_before_init"] = _attempt(lambda: kv.pull(good, out=mx.nd.zeros((4,))))
    kv.init(good, mx.nd.zeros((4,), dtype=f32))
    res["push_wrong_shape"] = _attempt(lambda: kv.push(good, mx.nd.ones((5,))))
    res["push_wrong_dtype"] = _attempt(lambda: kv.push(good, mx.nd.ones((4,), dtype="float64")))
    res["pushpull_wrong_shape"] = _attempt(
        lambda: kv.pushpull(good, mx.nd.ones((2, 2)), out=mx.nd.zeros((2, 2))))
    res["pushpull_wrong_out_shape"] = _attempt(
        lambda: kv.pushpull(good, mx.nd.ones((4,)), out=mx.nd.zeros((5,))))
    res["pull_wrong_dtype"] = _attempt(
        lambda: kv.pull(good, out=mx.nd.zeros((4,), dtype="float16")))
    res["init_bool"] = _attempt(lambda: kv.init(101, mx.nd.ones((4,), dtype=np.bool_)))
    res["init_not_ndarray"] = _attempt(lambda: kv.init(102, np.ones(4, dtype=f32)))
    # the servers keep serving: a good key sums every worker's push ...
    sums = []
    for i in range(3):
        out = mx.nd.zeros((4,))
        kv.pushpull(good, mx.nd.ones((4,)) * (rank + 1), out=out)
        sums.append(out.asnumpy().tolist())
    res["good_pushpull"] = sums
    _write_json("badinput_rank%d.json" % rank, {"rank": rank, "num_workers": kv.num_workers,
                                                "results": res})
    # ... and training on the same kvstore works
    _train(kv, _int("FAULT_STEPS", 5))


def run_disagree():
    from mxps.wire.frame import Header, MsgType
    kv = mx.kv.create("mxps")
    rank = kv.rank
    _write_json("ready_rank%d.json" % rank, {"rank": rank, "pid": os.getpid(), "step": 0})
    size7 = 4 if rank == 0 else 6
    kv.init(7, mx.nd.zeros((size7,)))           # only rank 0's value is sent to the server
    kv.init(8, mx.nd.arange(3))
    if rank == 0:
        kv.push(7, mx.nd.ones((size7,)))         # accepted: waits in round 1 for rank 1
        mx.nd.waitall()
    else:
        # 1. a refused request the worker can catch: the server answers with an error naming
        #    the key and the ranges, and keeps serving
        try:
            kv._client.call(0, Header(MsgType.PUSH, key=7, iteration=1, offset=0, length=6,
                                      dtype=0), np.ones(6, np.float32), what="raw push")
            refused = None
        except mxps.RemoteError as e:
            refused = str(e)
        _write_json("refused_rank1.json", {"message": refused})
    out = mx.nd.zeros((3,))
    kv.pull(8, out=out)                          # the same server, after the refusal
    _write_json("served_rank%d.json" % rank, {"key8": out.asnumpy().tolist()})
    if rank != 0:
        deadline = time.monotonic() + 60         # let rank 0 record its pull first
        while not os.path.exists(os.path.join(OUT, "served_rank0.json")) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        # 2. the same refusal inside training (an engine op): nothing to raise into, so the
        #    worker ends the job with the server's message
        kv.push(7, mx.nd.ones((size7,)))
        mx.nd.waitall()
        time.sleep(60)                           # should never get here: the refusal is fatal
        _write_json("survived_rank%d.json" % rank, {"rank": rank})
        return
    time.sleep(60)          # the scheduler ends the job (rank 1 failed)


def run_midstep():
    kv = mx.kv.create("mxps")
    shape = (64, 32)
    keys = [0, 1, 2]
    kv.init(keys, [mx.nd.zeros(shape) for _ in keys])
    grads = [mx.nd.ones(shape) for _ in keys]
    outs = [mx.nd.zeros(shape) for _ in keys]
    if kv.rank == 1:
        grads[2] = mx.nd.ones((3, 3))            # refused by the kvstore's shape check
        _write_json("ready_rank1.json", {"rank": 1, "pid": os.getpid(), "time": time.time()})
        kv.pushpull(keys, grads, out=outs)       # raises after keys 0 and 1 are in flight
        raise AssertionError("pushpull of a wrong shape did not raise")
    time.sleep(float(os.environ.get("FAULT_STEP_SLEEP", "5")))
    kv.pushpull(keys, grads, out=outs)
    mx.nd.waitall()                              # the job is ended by rank 1's failure
    time.sleep(60)


def run_config():
    cases = json.loads(os.environ["FAULT_CASES"])
    saved = dict(os.environ)
    results = {}
    for case in cases:
        os.environ.clear()
        os.environ.update(saved)
        for k, v in case["env"].items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        t0 = time.monotonic()
        try:
            kv = mx.kv.create("mxps")
            results[case["name"]] = {"type": None, "message": "created %r" % (kv,)}
        except Exception as e:
            results[case["name"]] = {"type": type(e).__name__, "message": str(e),
                                     "is_config_error": isinstance(e, mxps.ConfigError)}
        results[case["name"]]["seconds"] = time.monotonic() - t0
    _write_json("config.json", results)


if __name__ == "__main__":
    {"train": run_train, "badinput": run_badinput, "disagree": run_disagree,
     "midstep": run_midstep, "config": run_config}[MODE]()
