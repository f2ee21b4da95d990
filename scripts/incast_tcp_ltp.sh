#!/usr/bin/env bash
# The push alone on the emulated incast, TCP and LTP side by side: for each repetition, each
# point (message and loss; 2 ms queue, 8 -> 1, 400 Mbit/s, MTU 1500), TCP then LTP, one
# `python -m mxps_tools.incast` run each, its JSON into OUT_DIR (needs root; run one benchmark
# at a time, e.g. under flock /tmp/mxps-bench.lock).  The grid: 4 MB, 256 KB and 50 KB
# at 0, 1, 5 and 10% loss, with the rounds `--grid` takes per message (50, 200, 500).
# `python scripts/incast_summary.py OUT_DIR` makes the table.
#
#   bash scripts/incast_tcp_ltp.sh OUT_DIR [REPS] [POINTS...]     (a point: "50K 10")
set -euo pipefail
out=${1:?usage: incast_tcp_ltp.sh OUT_DIR [REPS] [POINTS...]}
reps=${2:-3}
shift $(( $# < 2 ? $# : 2 ))
points=("$@")
if [ ${#points[@]} -eq 0 ]; then
  for m in 4M 256K 50K; do for l in 0 1 5 10; do points+=("$m $l"); done; done
fi
mkdir -p "$out"
for rep in $(seq 1 "$reps"); do
  for point in "${points[@]}"; do
    set -- $point
    case "$1" in 4M) rounds=50;; 256K) rounds=200;; *) rounds=500;; esac
    for tr in tcp ltp; do
      f="$out/${tr}_$1_$2_r$rep"
      echo "$(date +%T) $tr $1 loss $2% rep $rep"
      python -m mxps_tools.incast --transport "$tr" --message "$1" --queue-ms 2 --loss "$2" \
        --rounds "$rounds" --out "$f.json" > "$f.log" 2>&1 || echo "FAILED: $f.log"
    done
  done
done
