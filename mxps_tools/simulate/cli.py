"""``mxps simulate``'s command line: the bench's vocabulary, the bench's table and plots.

    mxps simulate --scenario static -n 3 -s 3                 # as mxps bench would run it
    mxps simulate -n 256 -s 32 --rate 25000 --scenario homogeneous --steps 100
    mxps simulate --validate                                   # the model against mxps bench
    mxps simulate --predictions docs/sim                       # the prediction plots
    mxps simulate --calibrate                                  # measure the parameters (root)

By default every node is its own machine (``--node-cores``, the cores its I/O gets); with
``--shared-cores N`` every process shares one machine of N cores, as ``mxps bench`` runs them
(the validation uses 2, this machine's).
"""
import os
import sys
import time


def add_arguments(p):
    from .. import bench
    p.add_argument("-n", "--num-workers", type=int, default=4)
    p.add_argument("-s", "--num-servers", type=int, default=4)
    p.add_argument("--model", default="resnet18_v1",
                   help="a zoo model (resnet18_v1, resnet50_v1, vgg16, vgg11, mlp) or a JSON "
                        'file {"name": ..., "keys": [elements, ...]}')
    p.add_argument("--mlp-hidden", type=int, default=None)
    p.add_argument("--rate", type=float, default=400.0, help="every link's Mbit/s")
    p.add_argument("--scenario", choices=bench.SCENARIOS, default="static")
    p.add_argument("--slow-rank", default="all")
    p.add_argument("--slow-factor", type=float, default=4.0)
    p.add_argument("--slow-servers", type=float, default=None, metavar="SHARE",
                   help="this share of the servers (the lowest ranks) at rate / slow-factor, "
                        "with --scenario homogeneous")
    p.add_argument("--period", type=float, default=15.0)
    p.add_argument("--period-steps", type=int, default=None)
    p.add_argument("--schedule", default=None)
    p.add_argument("--loss", type=float, default=0.0, help="percent of packets towards every "
                   "server lost")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--queue-ms", type=float, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compute", type=float, default=None,
                   help="the compute-only step in seconds (default: the bench's measured one, "
                        "scaled by the model's bytes)")
    p.add_argument("--shared-cores", type=float, default=None,
                   help="every process on one machine with this many cores (as mxps bench)")
    p.add_argument("--node-cores", type=float, default=1.0,
                   help="cores each node's communication gets (default 1)")
    p.add_argument("--systems", default=",".join(bench.DEFAULT_SYSTEMS))
    p.add_argument("--out-dir", default=None, help="write simulate.json and the plots here")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--validate", action="store_true",
                   help="simulate every measured scenario and compare (measured.json)")
    p.add_argument("--write-validated", action="store_true",
                   help="with --validate: record the pairs within 10%% (validated.json)")
    p.add_argument("--markdown", action="store_true",
                   help="with --validate: print the table as markdown (docs/bench/RESULTS.md)")
    p.add_argument("--predictions", metavar="OUT_DIR", default=None,
                   help="run the prediction grid and draw its plots into OUT_DIR")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the model's parameters on this machine (root)")


def options_from(a):
    from .scenarios import Options
    systems = tuple(s for s in a.systems.split(",") if s)
    for name in ("num_workers", "num_servers"):
        if getattr(a, name) < 1:
            raise SystemExit("mxps simulate: --%s must be at least 1" % name.replace("_", "-"))
    if a.rate <= 0 or a.slow_factor <= 0:
        raise SystemExit("mxps simulate: --rate and --slow-factor must be positive")
    if not 0 <= a.loss < 100:
        raise SystemExit("mxps simulate: --loss is a percentage in [0, 100)")
    return Options(scenario=a.scenario, num_workers=a.num_workers, num_servers=a.num_servers,
                   model=a.model, mlp_hidden=a.mlp_hidden, rate=a.rate, slow_rank=a.slow_rank,
                   slow_factor=a.slow_factor, slow_servers=a.slow_servers, period=a.period,
                   period_steps=a.period_steps, schedule=a.schedule, loss=a.loss, mtu=a.mtu,
                   queue_ms=a.queue_ms, steps=a.steps, warmup=a.warmup, compute=a.compute,
                   shared_cores=a.shared_cores, node_cores=a.node_cores, systems=systems)


def main(a):
    from .. import bench
    from .models import ModelError
    from .scenarios import ScenarioError
    from .systems import SystemError_
    if a.calibrate:
        from . import calibrate
        return calibrate.main()
    if a.validate:
        from . import validate
        rows = validate.validate()
        print(validate.format_markdown(rows) if a.markdown else validate.format_rows(rows))
        ok = [r for r in rows if validate.within(r)]
        sim = [r for r in rows if r.get("simulated") is not None]
        print("\n%d of %d simulated (scenario, system) pairs within %d%% of mxps bench "
              "(mean step time and speedup over the better baseline)"
              % (len(ok), len(sim), 100 * validate.TOLERANCE))
        if a.write_validated:
            validate.write_validated(rows)
        return 0
    if a.predictions:
        from . import predictions
        return predictions.main(a.predictions)
    try:
        o = options_from(a)
        from .run import simulate, write
        t0 = time.time()
        summary = simulate(o)
    except (ModelError, ScenarioError, SystemError_) as e:
        raise SystemExit("mxps simulate: %s" % e)
    print("simulated (not measured): %s" % ", ".join(o.systems))
    print(bench.format_table(summary))
    print("\nsimulated in %.1f s (%d workers x %d servers)" % (time.time() - t0,
                                                               o.num_workers, o.num_servers))
    if a.out_dir:
        print(write(summary, a.out_dir))
        if not a.no_plots:
            from ..plot import require_matplotlib
            require_matplotlib("mxps simulate --out-dir (without --no-plots)")
            for p in bench.plot(summary, a.out_dir):
                print(p)
    return 0


if __name__ == "__main__":
    sys.exit(os.EX_USAGE)
