"""A worker whose kvstore operations meet weights that oneDNN left in its own layout.

MXNet 1.9.1 built with oneDNN (the pip wheels) caches a convolution's weight in a oneDNN layout
when it runs a forward outside ``autograd.record()``.  An mxps engine operation holding such an
array once asked MXNet for its data pointer, which converts the array with an engine operation of
its own and waits for it: the two operations waited for each other for ever (the flaky hang of
the SqueezeNet noise-study cell, whose first inference-mode forward left the weights so when a
busy engine let the Trainer's first pushpull in before the training forward's conversion).
Here every case is deterministic: a pull into such a weight, a push of one, a pushpull from one
into another, and a Trainer's first step whose training forward runs only after the step queued
its operations.  Writes ``<out>/onednn.json``: the layouts seen before the operations and whether
each result holds the expected values.

    python tests/jobs/onednn_job.py OUT       (every node of a 1-worker job)
"""
import json
import os
import sys
import threading

import mxps  # noqa: F401  (before mxnet: takes over server/scheduler roles)
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from mxps.kernels import engine, ndview

OUT = sys.argv[1]


def cached_weight(seed):
    """A convolution weight after an inference-mode forward (a oneDNN layout, with oneDNN)."""
    mx.random.seed(seed)
    net = gluon.nn.Conv2D(16, 3, in_channels=4)
    net.initialize(mx.init.Uniform())
    net(mx.nd.ones((1, 4, 8, 8)))
    mx.nd.waitall()
    return net.weight.data()


kv = mx.kv.create("mxps")

# the race of the noise study's first step, made certain: a Trainer's first step queues its
# pull (the broadcast of rank 0's weights) and its pushpull into the weight before the
# training-mode forward has run, which is what converts the weight back to the default layout
# (when it runs, after them); an engine operation holding the input keeps the forward waiting
net = gluon.nn.Conv2D(16, 3, in_channels=4)
net.initialize(mx.init.Uniform())
net(mx.nd.ones((1, 4, 8, 8)))                   # inference: the weight in a oneDNN layout
mx.nd.waitall()
weight = net.weight.data()
trainer_layout = ndview.in_onednn_layout(weight)
before = weight.asnumpy()
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kv)
x = mx.nd.ones((2, 4, 8, 8))
release = threading.Event()


def hold(done):
    threading.Thread(target=lambda: (release.wait(60), done()), daemon=True).start()


engine.push_async(hold, [], [ndview.handle_value(x)], 0, b"hold_input")
with autograd.record():
    loss = net(x).sum()
loss.backward()
trainer.step(2)                                 # keys 0 and 1: the weight and the bias
release.set()
mx.nd.waitall()
after = weight.asnumpy()

# a pull into such a weight, a push of one, a pushpull from one into another
a, b, g, d = (cached_weight(s) for s in (1, 2, 3, 4))
layouts = [trainer_layout] + [ndview.in_onednn_layout(w) for w in (a, b, g, d)]
b_vals, g_vals = b.asnumpy(), g.asnumpy()
shape = a.shape
for key, value in ((10, mx.nd.full(shape, 3.0)), (11, mx.nd.zeros(shape)),
                   (12, mx.nd.zeros(shape))):
    kv.init(key, value)
kv.pull(10, out=a)
kv.push(11, b)      # the Trainer's SGD on the servers: 0 - 0.1 * b / 2 (its rescale_grad)
c = mx.nd.zeros(shape)
kv.pull(11, out=c)
kv.pushpull(12, g, out=d)
mx.nd.waitall()
result = {"onednn_layouts": layouts,
          "trainer": bool(np.all(np.isfinite(after)) and not np.array_equal(after, before)),
          "pull": bool(np.all(a.asnumpy() == 3.0)),
          "push": bool(np.allclose(c.asnumpy(), -0.05 * b_vals)),
          "pushpull": bool(np.allclose(d.asnumpy(), -0.05 * g_vals)),
          "layouts_after": [ndview.in_onednn_layout(w) for w in (weight, a, b, g, d)]}
with open(os.path.join(OUT, "onednn.json"), "w") as f:
    json.dump(result, f)
