"""Gradient compression in the tools' training jobs (``bench_job``, ``noise_job``).

A bench system compresses with ``:BENCH_COMPRESSION=2bit`` (and ``:BENCH_THRESHOLD=0.5``, the
default), e.g. ``--systems native:BENCH_COMPRESSION=2bit,mxps-default:BENCH_COMPRESSION=2bit``.
Native MXNet 1.9.1 refuses compression in ``pushpull`` ("Compression not supported with
PushPull"), which Gluon's Trainer calls for every dense key; so on a native kvstore the
Trainer's pushpull becomes a push then a pull, exactly what MXNet's own model.py does for
sparse arrays.  mxps compresses in pushpull itself and keeps it.
"""
import os


def params_from_env(environ=os.environ):
    """``compression_params`` for gluon.Trainer, or None (BENCH_COMPRESSION unset or empty)."""
    kind = environ.get("BENCH_COMPRESSION", "").strip()
    if not kind:
        return None
    return {"type": kind, "threshold": float(environ.get("BENCH_THRESHOLD", "") or 0.5)}


def params_from_arg(text):
    """``TYPE[:THRESHOLD]`` (a job's --compression) as compression_params, or None."""
    if not text:
        return None
    kind, _, threshold = text.partition(":")
    return {"type": kind, "threshold": float(threshold or 0.5)}


def push_then_pull(kv):
    """Make ``kv.pushpull`` a push then a pull on a native kvstore (see the module's note);
    an mxps kvstore is left as it is."""
    if kv is None or type(kv).__module__.startswith("mxps."):
        return

    def pushpull(key, value, out=None, priority=0):
        kv.push(key, value, priority=priority)
        kv.pull(key, out=value if out is None else out, priority=priority)
    kv.pushpull = pushpull
