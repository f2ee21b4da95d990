#!/usr/bin/env bash
# The push alone on the emulated incast, TCP and LTP side by side: for each repetition, each
# point (message and loss; 2 ms queue, 8 -> 1, 400 Mbit/s, MTU 1500), TCP then LTP, one
# `python -m mxps_tools.incast` run each, its JSON into OUT_DIR (needs root; run one benchmark
# at a time, e.g. under flock /tmp/mxps-bench.lock).
#
#   bash scripts/incast_tcp_ltp.sh OUT_DIR [REPS]
set -euo pipefail
out=${1:?usage: incast_tcp_ltp.sh OUT_DIR [REPS]}
reps=${2:-3}
mkdir -p "$out"
for rep in $(seq 1 "$reps"); do
  for point in "4M 0" "4M 1" "4M 5" "4M 10" "256K 1" "256K 5"; do
    set -- $point
    rounds=50; [ "$1" = "256K" ] && rounds=200
    for tr in tcp ltp; do
      f="$out/${tr}_$1_$2_r$rep"
      echo "$(date +%T) $tr $1 loss $2% rep $rep"
      python -m mxps_tools.incast --transport "$tr" --message "$1" --queue-ms 2 --loss "$2" \
        --rounds "$rounds" --out "$f.json" > "$f.log" 2>&1 || echo "FAILED: $f.log"
    done
  done
done
