"""Train, save and restore optimizer states through the kvstore (tests/test_states.py).

Environment: STATES_KVSTORE (mxps or dist_sync), STATES_OPTIMIZER (sgd | adam),
STATES_UPDATE_ON_KVSTORE (1 | 0), STATES_START / STATES_STOP (the steps this run trains,
data is a fixed function of (rank, step)), STATES_LOAD (directory with params + states of a
previous run to restore before training; empty = fresh start; STATES_LOAD_STATES=0 restores
the parameters only), STATES_OUT (directory: rank 0
writes params.npz, states, and weights_rank{R}.npz for every rank).
"""
import os

KV = os.environ.get("STATES_KVSTORE", "mxps")
if KV.startswith("mxps"):
    import mxps  # noqa: F401

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

start, stop = int(os.environ["STATES_START"]), int(os.environ["STATES_STOP"])
load, out = os.environ.get("STATES_LOAD", ""), os.environ["STATES_OUT"]
opt = os.environ.get("STATES_OPTIMIZER", "adam")
uok = os.environ.get("STATES_UPDATE_ON_KVSTORE", "1") == "1"

mx.random.seed(3)
net = gluon.nn.Dense(16, in_units=8)
net.initialize(mx.init.Xavier())
if load:
    net.load_parameters(os.path.join(load, "params.params"))
params = {"learning_rate": 0.05, "wd": 1e-4}
if opt == "sgd":
    params["momentum"] = 0.9
kv = mx.kv.create(KV)
trainer = gluon.Trainer(net.collect_params(), opt, params, kvstore=kv, update_on_kvstore=uok)
if load and os.environ.get("STATES_LOAD_STATES", "1") == "1":
    trainer.load_states(os.path.join(load, "trainer.states"))
for step in range(start, stop):
    rng = np.random.RandomState(1000 * kv.rank + step)
    x = mx.nd.array(rng.randn(4, 8))
    with autograd.record():
        loss = (net(x) ** 2).mean()
    loss.backward()
    trainer.step(4)
mx.nd.waitall()
kv.barrier()                 # every worker's pushes are in (matters for async)
os.makedirs(out, exist_ok=True)
if kv.rank == 0:
    net.save_parameters(os.path.join(out, "params.params"))
    trainer.save_states(os.path.join(out, "trainer.states"))
np.savez(os.path.join(out, "weights_rank%d.npz" % kv.rank),
         **{k: v.data().asnumpy() for k, v in net.collect_params().items()})
