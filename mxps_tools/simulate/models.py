"""The models the simulator knows: each a list of gradient keys in the order the kvstore numbers
them (Gluon's ``Trainer`` sorts the parameters by name; key i is the i-th name), with their
sizes in elements and each key's position in the network (``layer``: the order of
``collect_params()``, forward order).

Backward makes the gradients ready in the reverse of the layer order (the last layer's first);
only the sizes and those two orders enter the model.

The zoo models (``MODEL_FILE``, ``models.json`` beside this module) are the bench job's own
networks, built once by ``python -m mxps_tools.simulate.models --write`` (MXNet and gluoncv
build each model on a 32x32 input with 10 classes, as ``mxps bench`` does); a parameter whose
``grad_req`` is ``null`` (batch norm's running statistics) is pushed by nobody and left out.
Any other model is a JSON file: ``{"name": ..., "keys": [elements, ...]}`` in key order, with
``"layer"`` optional (without it the key order is taken as the layer order).
"""
import argparse
import json
import os
import subprocess
import sys

from .. import runtime

MODEL_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models.json")
#: what ``--write`` builds: the bench's models and the two larger zoo models users train
ZOO = ("resnet18_v1", "resnet50_v1", "vgg16", "vgg11", "mlp")
ELEMENT_BYTES = 4


class ModelError(ValueError):
    """A model the simulator cannot use (the message says why)."""


class Model:
    """A model as the parameter server sees it: key sizes in elements, in key order."""

    def __init__(self, name, keys, layer=None):
        keys = [int(k) for k in keys]
        if not keys:
            raise ModelError("model %r has no keys" % name)
        if any(k < 0 for k in keys):
            raise ModelError("model %r has a key of negative size" % name)
        layer = list(range(len(keys))) if layer is None else [int(x) for x in layer]
        if sorted(layer) != list(range(len(keys))):
            raise ModelError("model %r: 'layer' must order the %d keys (a permutation of "
                             "0..%d)" % (name, len(keys), len(keys) - 1))
        self.name = name
        self.keys = keys
        self.layer = layer

    def backward_order(self):
        """The keys in the order backward makes their gradients ready (last layer first)."""
        return sorted(range(len(self.keys)), key=lambda k: -self.layer[k])

    @property
    def elements(self):
        return sum(self.keys)

    @property
    def bytes(self):
        return ELEMENT_BYTES * self.elements

    def __repr__(self):
        return "Model(%s, %d keys, %.1f MB)" % (self.name, len(self.keys), self.bytes / 1e6)


def _zoo():
    try:
        with open(MODEL_FILE) as f:
            return json.load(f)["models"]
    except FileNotFoundError:
        return {}


def load(spec, mlp_hidden=None):
    """A model by zoo name (``resnet18_v1``, ``mlp`` ...) or from a JSON file's path.

    ``mlp`` with another ``mlp_hidden`` than the zoo's is built on the fly (its sizes are
    arithmetic: three dense layers over a 3x32x32 input, 10 classes, as the bench's)."""
    if spec == "mlp" and mlp_hidden:
        return mlp(mlp_hidden)
    zoo = _zoo()
    if spec in zoo:
        return Model(spec, zoo[spec]["keys"], zoo[spec].get("layer"))
    if os.path.exists(spec):
        try:
            with open(spec) as f:
                obj = json.load(f)
        except (OSError, ValueError) as e:
            raise ModelError("model file %s: %s" % (spec, e)) from None
        if not isinstance(obj, dict) or not isinstance(obj.get("keys"), list):
            raise ModelError('model file %s: expected {"name": ..., "keys": [elements, ...]}'
                             % spec)
        return Model(obj.get("name", os.path.basename(spec)), obj["keys"], obj.get("layer"))
    raise ModelError("unknown model %r: one of %s, or a JSON file "
                     '{"name": ..., "keys": [elements, ...]}' % (spec, ", ".join(sorted(zoo))))


def mlp(hidden, inputs=3 * 32 * 32, classes=10):
    """The bench's mlp: Dense(hidden) relu, Dense(hidden) relu, Dense(classes)."""
    h = int(hidden)
    # Gluon's names: dense0_bias, dense0_weight, dense1_bias, ... (sorted: bias first)
    return Model("mlp%d" % h, [h, h * inputs, h, h * h, classes, classes * h],
                 [1, 0, 3, 2, 5, 4])


_SCRIPT = r"""
import json, sys
import mxnet as mx
from mxps_tools.bench_job import build
out = {}
for name in sys.argv[1:]:
    net = build(name, 10, 4096)
    net.initialize(mx.init.Xavier(magnitude=2))
    net(mx.nd.zeros((1, 3, 32, 32))).wait_to_read()
    params = net.collect_params()
    layer = [k for k, p in params.items() if p.grad_req != "null"]   # forward order
    names = sorted(layer)                                             # Trainer's key order
    out[name] = {"keys": [int(params[k].data().size) for k in names],
                 "layer": [layer.index(k) for k in names]}
print("SIM_MODELS " + json.dumps(out))
"""


def build_zoo(names=ZOO, timeout=600.0):
    """Build the models with MXNet in a subprocess (the bench job's ``build``, which parses its
    own command line: it gets ``--kvstore local``) and return ``{name: {"keys": [...]}}``."""
    from .. import jobs
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "MXPS_"))}
    env.update(jobs.QUIET_ENV)
    code = "import sys; sys.argv[1:] = ['--kvstore', 'local']; " \
           "import mxps_tools.bench_job; sys.argv[1:] = %r\n" % (list(names),) + _SCRIPT
    p = subprocess.run(runtime.python_argv(["-c", code]), env=env, capture_output=True,
                       text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("SIM_MODELS ")]
    if p.returncode != 0 or not lines:
        raise ModelError("building %s failed (exit %s): %s" % (names, p.returncode,
                                                               p.stderr[-2000:]))
    return json.loads(lines[-1].split(" ", 1)[1])


def main(argv=None):
    ap = argparse.ArgumentParser(description="the simulator's zoo models (key sizes)")
    ap.add_argument("--write", action="store_true", help="build them with MXNet and write %s"
                    % os.path.basename(MODEL_FILE))
    a = ap.parse_args(argv)
    if a.write:
        models = build_zoo()
        with open(MODEL_FILE, "w") as f:
            json.dump({"what": "gradient key sizes (elements) in kvstore key order, built by "
                               "python -m mxps_tools.simulate.models --write (32x32 input, "
                               "10 classes, mlp hidden 4096)", "models": models}, f)
            f.write("\n")
    for name, m in sorted(_zoo().items()):
        mod = Model(name, m["keys"])
        print("%-12s %4d keys %8.1f MB" % (name, len(mod.keys), mod.bytes / 1e6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
