"""The model against ``mxps bench``: every scenario of ``measured.json`` (the bench's measured
means, copied from docs/bench with their commands and commits) simulated as it ran there, on
one 2-core machine (``shared_cores=2``) with the compute-only step that run measured, and
compared system by system: the mean step time's error and the error of the speedup over the
better baseline.

``VALIDATED`` (``validated.json``) lists the (scenario, system) pairs within ``TOLERANCE``
when it was last written (``mxps simulate --validate --write-validated``); the test suite
fails when one of them drifts beyond it (tests/test_simulate.py).
"""
import json
import os

from . import models, scenarios
from .calibration import Calibration
from .run import simulate
from .systems import SystemError_, system as sim_system

HERE = os.path.dirname(os.path.abspath(__file__))
MEASURED_FILE = os.path.join(HERE, "measured.json")
VALIDATED_FILE = os.path.join(HERE, "validated.json")
TOLERANCE = 0.10
BASELINES = ("native", "native-p3")


def load_measured(path=MEASURED_FILE):
    with open(path) as f:
        return json.load(f)["scenarios"]


def options_of(sc, systems):
    o = sc["options"]
    slow = o.get("slow_rank")
    return scenarios.Options(
        scenario=o["scenario"], num_workers=o["num_workers"], num_servers=o["num_servers"],
        model=o["model"], mlp_hidden=o.get("mlp_hidden"), rate=o["rate"],
        slow_rank="all" if slow is None else str(slow), slow_factor=o.get("slow_factor") or 4.0,
        period=o.get("period") or 15.0, loss=o.get("loss") or 0.0, mtu=o.get("mtu") or 1500,
        queue_ms=o.get("queue_ms"), steps=o.get("steps"), compute=sc.get("compute_seconds_median"),
        shared_cores=2.0, systems=tuple(systems))


def modelled(name):
    try:
        sim_system(name)
        return True
    except SystemError_:
        return False


def _speedup(means, name):
    base = [means[b] for b in BASELINES if means.get(b)]
    return min(base) / means[name] if base and means.get(name) else None


def validate_one(sc, calib=None):
    """Rows ``{scenario, system, measured, simulated, error, speedup_measured,
    speedup_simulated, speedup_error}`` for one scenario (systems the model does not cover:
    ``simulated`` None and ``note``)."""
    measured = {k: v["mean"] for k, v in sc["measured"].items() if v and v.get("mean")}
    names = [n for n in measured if modelled(n)]
    rows = []
    if not names:
        return [dict(scenario=sc["name"], system=n, measured=m, simulated=None,
                     note="not modelled") for n, m in measured.items()]
    o = options_of(sc, names)
    summary = simulate(o, calib)
    sim = {a["name"]: a["mean_s"] for a in summary["variants"][0]["systems"]}
    for n, m in measured.items():
        if n not in sim:
            rows.append(dict(scenario=sc["name"], system=n, measured=m, simulated=None,
                             note="not modelled"))
            continue
        sm, ss = _speedup(measured, n), _speedup(sim, n)
        rows.append(dict(scenario=sc["name"], system=n, measured=m, simulated=sim[n],
                         error=sim[n] / m - 1.0, speedup_measured=sm, speedup_simulated=ss,
                         speedup_error=(ss / sm - 1.0) if sm and ss else None))
    return rows


def validate(names=None, calib=None):
    calib = calib or Calibration.load()
    rows = []
    for sc in load_measured():
        if names and sc["name"] not in names:
            continue
        rows.extend(validate_one(sc, calib))
    return rows


def format_rows(rows, tolerance=TOLERANCE):
    from ..bench import _table
    out = []
    for r in rows:
        if r.get("simulated") is None:
            out.append([r["scenario"], r["system"], "%.3f" % r["measured"], "-", "-", "-", "-",
                        r.get("note", "")])
            continue
        ok = abs(r["error"]) <= tolerance and (r["speedup_error"] is None or
                                               abs(r["speedup_error"]) <= tolerance)
        out.append([r["scenario"], r["system"], "%.3f" % r["measured"], "%.3f" % r["simulated"],
                    "%+.1f%%" % (100 * r["error"]),
                    "-" if r["speedup_measured"] is None else "%.2fx" % r["speedup_measured"],
                    "-" if r["speedup_simulated"] is None else "%.2fx / %+.1f%%" % (
                        r["speedup_simulated"], 100 * r["speedup_error"]),
                    "within %d%%" % (100 * tolerance) if ok else "OUT"])
    return _table(out, ["scenario", "system", "measured s", "simulated s", "error",
                        "speedup measured", "simulated / error", ""])


def format_markdown(rows, tolerance=TOLERANCE):
    """The same rows as a markdown table (docs/bench/RESULTS.md), within ``tolerance`` in
    bold."""
    out = ["| scenario | system | measured s | simulated s | error | speedup measured / "
           "simulated (error) |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("simulated") is None:
            out.append("| %s | %s | %.3f | %s | | |" % (r["scenario"], r["system"],
                                                       r["measured"], r.get("note", "")))
            continue
        err = "%+.1f%%" % (100 * r["error"])
        if within(r, tolerance):
            err = "**%s**" % err
        sp = "-" if r["speedup_measured"] is None or r["speedup_simulated"] is None else \
            "%.2fx / %.2fx (%+.0f%%)" % (r["speedup_measured"], r["speedup_simulated"],
                                         100 * r["speedup_error"])
        out.append("| %s | %s | %.3f | %.3f | %s | %s |" % (
            r["scenario"], r["system"], r["measured"], r["simulated"], err, sp))
    return "\n".join(out)


def within(r, tolerance=TOLERANCE):
    return r.get("simulated") is not None and abs(r["error"]) <= tolerance and (
        r.get("speedup_error") is None or abs(r["speedup_error"]) <= tolerance)


def write_validated(rows, path=VALIDATED_FILE):
    keep = [{"scenario": r["scenario"], "system": r["system"]} for r in rows if within(r)]
    with open(path, "w") as f:
        json.dump({"what": "the (scenario, system) pairs of measured.json the model predicts "
                           "within %d%% (mean step time and speedup over the better "
                           "baseline); tests/test_simulate.py fails when one drifts beyond"
                           % (100 * TOLERANCE), "tolerance": TOLERANCE, "pairs": keep}, f,
                  indent=1)
    return keep


def load_validated(path=VALIDATED_FILE):
    with open(path) as f:
        return json.load(f)
