"""The table of scripts/incast_tcp_ltp.sh's runs: per point (message, loss), TCP's and LTP's
mean and p99 round over the ideal, the mean over the repetitions with their range, and LTP's
delivered fraction (the lowest repetition's mean) and queue drops.

    python scripts/incast_summary.py OUT_DIR [--json SUMMARY.json]
"""
import argparse
import collections
import glob
import json
import os
import re
import statistics

SIZES = {"4M": 4 << 20, "256K": 256 << 10, "50K": 50 << 10}


def load(out_dir):
    runs = collections.defaultdict(list)        # (transport, message, loss) -> [point]
    for path in sorted(glob.glob(os.path.join(out_dir, "*_r*.json"))):
        m = re.match(r"(tcp|ltp)_(\w+?)_([\d.]+)_r(\d+)\.json$", os.path.basename(path))
        if not m:
            continue
        with open(path) as f:
            rec = json.load(f)
        for p in rec["points"]:
            runs[(m.group(1), m.group(2), float(m.group(3)))].append(p)
    return runs


def cell(points, key):
    xs = [p["summary"][key] for p in points]
    if not xs:
        return "-", None
    return ("%.2f (%.2f-%.2f)" % (statistics.mean(xs), min(xs), max(xs)),
            statistics.mean(xs))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--json", help="write the summary here too")
    a = ap.parse_args()
    runs = load(a.out_dir)
    keys = sorted({(m, l) for _, m, l in runs}, key=lambda k: (-SIZES.get(k[0], 0), k[1]))
    print("| message | loss | TCP mean/ideal | LTP mean/ideal | TCP p99/ideal | LTP p99/ideal "
          "| LTP delivered (lowest rep) | LTP queue drops (mean) | reps |")
    print("|---|---|---|---|---|---|---|---|---|")
    summary = []
    for m, l in keys:
        tcp, ltp = runs.get(("tcp", m, l), []), runs.get(("ltp", m, l), [])
        row = {"message": m, "loss_pct": l}
        cells = []
        for name, pts, key in (("tcp_mean", tcp, "mean_over_ideal"),
                               ("ltp_mean", ltp, "mean_over_ideal"),
                               ("tcp_p99", tcp, "p99_over_ideal"),
                               ("ltp_p99", ltp, "p99_over_ideal")):
            text, value = cell(pts, key)
            cells.append(text)
            row[name] = value
            row[name + "_reps"] = [p["summary"][key] for p in pts]
        delivered = min((p["summary"]["delivered_mean"] for p in ltp), default=None)
        drops = statistics.mean(p["counters"]["queue_drops"] for p in ltp) if ltp else None
        row.update(ltp_delivered_lowest=delivered, ltp_queue_drops_mean=drops)
        summary.append(row)
        print("| %s | %g%% | %s | %s | %s | %s | %s | %s | %d/%d |" % (
            m, l, cells[0], cells[1], cells[2], cells[3],
            "-" if delivered is None else "%.3f" % delivered,
            "-" if drops is None else "%.0f" % drops, len(ltp), len(tcp)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
