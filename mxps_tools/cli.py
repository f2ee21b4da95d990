"""The ``mxps`` command.

    mxps launch -n 2 -s 2 -- python examples/train_digits.py

runs MXNet's own launcher (``<site-packages>/mxnet/tools/launch.py --launcher local``), unchanged,
inside a private network namespace (mxps_tools.emunet): the local launcher gives every process
this machine's external address as DMLC_PS_ROOT_URI; inside the namespace that address is the
namespace's own 198.18.0.0/15 address, so the job's traffic never leaves the namespace.  Every
job gets a fresh random secret (MXPS_SECRET, in the environment the launcher copies to every
process, never on a command line) unless MXPS_SECRET or MXPS_SECRET_FILE is set already.
Needs root (network namespaces).

    mxps bench --quick
    mxps bench --scenario static            # 4 workers x 4 servers, resnet18_v1
    mxps bench --network loopback -n 2 -s 2

runs native dist_sync and mxps side by side on an emulated heterogeneous network
(mxps_tools.bench).

    mxps bench-server --workers 2 --repeat 3

measures one server on loopback: GB/s per server core and the workers' CPU per GB, mxps with
and without the job secret beside native's server (mxps_tools.server_bench).

    mxps plot metrics-*.jsonl --out-dir plots/
    mxps plot --trace /tmp/trace [--around WALL_TIME] [--window 10] --out-dir plots/
    mxps plot --trace /tmp/trace --summary

    mxps simulate --scenario static -n 256 -s 32 --rate 25000
    mxps simulate --validate

simulates the bench's jobs at any scale on a discrete-event model (mxps_tools.simulate,
docs/SIMULATE.md), validated against mxps bench's measurements.

    mxps study noise --quick --out /tmp/noise-quick

runs the label-noise scalability study (mxps_tools.study_noise, docs/NOISE.md);
``mxps study noise-scale --out DIR`` its statistical efficiency against the number of workers,
with the simulated time to accuracy (mxps_tools.noise_scale).

The command is never a parameter-server role, even when a job's ``DMLC_ROLE=server`` is in the
shell: building the parser imports only the tools (``mxps_tools.bench`` and ``jobs``, which import
no MXNet at import time), and a command that needs the runtime reaches it through
``mxps_tools.runtime`` (tests/test_install.py runs the installed scripts with a job's variables
set).  Plots need matplotlib (``pip install 'mxps[examples]'``), which a plain ``pip install mxps``
does not bring: a command that would draw checks for it before doing anything else.
"""
import argparse
import importlib.util
import os
import secrets
import signal
import subprocess
import sys

from .plot import require_matplotlib


def mxnet_launcher():
    """Path of MXNet's launch.py, found without importing mxnet."""
    spec = importlib.util.find_spec("mxnet")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("mxps: mxnet is not installed (pip install mxnet==1.9.1)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "tools", "launch.py")
    if not os.path.exists(path):
        raise SystemExit("mxps: MXNet's launcher is missing: %s" % path)
    return path


def launch_env(environ):
    """The launched command's environment: ``environ`` with a fresh random job secret, unless
    it names one already (MXPS_SECRET or MXPS_SECRET_FILE: the user's choice stands)."""
    env = dict(environ, PYTHONUNBUFFERED="1")
    if not env.get("MXPS_SECRET") and not env.get("MXPS_SECRET_FILE"):
        env["MXPS_SECRET"] = secrets.token_hex(32)
    return env


def cmd_launch(args):
    from . import emunet, patching
    try:
        patched = patching.check()
    except patching.PatchError as exc:
        raise SystemExit("mxps launch: %s" % exc)
    if not patched:
        raise SystemExit("mxps: MXNet's launcher is not patched for Python 3.9+ (its "
                         "dmlc_tracker calls Thread.isAlive). Run: mxps-patch apply")
    if not args.command:
        raise SystemExit("mxps launch: give the training command after --")
    command = args.command[1:] if args.command[0] == "--" else args.command
    emunet.check_prerequisites()
    emunet.cleanup_stale()
    argv = [sys.executable, mxnet_launcher(), "-n", str(args.num_workers),
            "-s", str(args.num_servers), "--launcher", "local"] + command
    with emunet.Topology(["job"]) as topo:
        proc = topo.popen("job", argv, env=launch_env(os.environ))
        try:
            return proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            return 130


def cmd_plot(parser, args):
    if bool(args.metrics) == bool(args.trace):
        parser.error("give either metrics files or --trace PATH_PREFIX")
    if not args.trace and (args.summary or args.around is not None):
        parser.error("--summary and --around go with --trace")
    if args.window <= 0:
        parser.error("--window must be positive, got %s" % args.window)
    from . import plot
    if args.trace:
        try:
            trace = plot.Trace.find(args.trace)
        except plot.TraceError as e:
            raise SystemExit("mxps plot: %s" % e)
        if args.summary:
            print(plot.format_summary(trace, plot.trace_summary(trace, args.around,
                                                                args.window)))
            return 0
        require_matplotlib("mxps plot --trace")
        print(plot.plot_trace(trace, args.out_dir, args.around, args.window))
        return 0
    require_matplotlib("mxps plot")
    print(plot.plot(args.metrics, args.out_dir))
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="mxps", description="mxps parameter server tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("launch", help="run MXNet's launcher (--launcher local) in a private "
                        "network namespace")
    la.add_argument("-n", "--num-workers", type=int, default=2)
    la.add_argument("-s", "--num-servers", type=int, default=2)
    la.add_argument("command", nargs=argparse.REMAINDER)
    be = sub.add_parser("bench", help="native dist_sync vs mxps on an emulated heterogeneous "
                        "network (or loopback)")
    from . import bench
    bench.add_arguments(be)
    sb = sub.add_parser("bench-server", help="one server, N workers on loopback: GB/s per "
                        "server core and worker CPU per GB, mxps (with and without the job "
                        "secret) beside native")
    from . import server_bench
    server_bench.add_arguments(sb)
    pl = sub.add_parser("plot", help="PNGs from MXPS_METRICS files, or an MXPS_TRACE "
                        "timeline and summary")
    pl.add_argument("metrics", nargs="*", help="the workers' metrics files")
    pl.add_argument("--trace", nargs="+", metavar="PATH_PREFIX",
                    help="an MXPS_TRACE prefix (its PREFIX.worker<rank> and PREFIX.server<rank> "
                    "files) or trace files: draw trace.png (a timeline of every request)")
    pl.add_argument("--around", type=float, metavar="SECONDS",
                    help="with --trace: centre a --window on this wall time (time.time(), e.g. a "
                    "rate change from bench.json; below 1e9: seconds since the trace's start)")
    pl.add_argument("--window", type=float, default=10.0, metavar="S",
                    help="with --around: seconds shown (default 10)")
    pl.add_argument("--summary", action="store_true",
                    help="with --trace: print the per-round, per-server table instead of "
                    "drawing")
    pl.add_argument("--out-dir", default=".")
    si = sub.add_parser("simulate", help="a discrete-event model of the bench's jobs: any "
                        "number of workers and servers, validated against mxps bench")
    from .simulate import cli as simulate_cli
    simulate_cli.add_arguments(si)
    st = sub.add_parser("study", help="studies that run real jobs (noise: label noise vs "
                        "scalability)")
    studies = st.add_subparsers(dest="study", required=True)
    no = studies.add_parser("noise", help="label noise x consistency x workers (docs/NOISE.md)")
    from . import study_noise
    study_noise.add_arguments(no)
    ns = studies.add_parser("noise-scale", help="steps to a target accuracy against the "
                            "number of workers under label noise, and the simulated time to "
                            "it (docs/SIMULATE.md)")
    from . import noise_scale
    noise_scale.add_arguments(ns)
    args = p.parse_args(argv)
    if args.cmd == "launch":
        return cmd_launch(args)
    if args.cmd == "bench":
        if not args.no_plots:
            require_matplotlib("mxps bench (without --no-plots)")
        return bench.main(args)
    if args.cmd == "bench-server":
        return server_bench.main(args, sb)
    if args.cmd == "plot":
        return cmd_plot(pl, args)
    if args.cmd == "simulate":
        return simulate_cli.main(args)
    if args.cmd == "study" and args.study == "noise-scale":
        return noise_scale.run(args)
    if args.cmd == "study":
        return study_noise.run(no, args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
