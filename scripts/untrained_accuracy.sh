#!/usr/bin/env bash
# Greedy accuracy of the untrained embedded default on 200 held-out builtin:arithmetic
# problems per difficulty level (the numbers in the README). Usage: scripts/untrained_accuracy.sh [OUT_DIR]
set -euo pipefail
out=${1:-runs/untrained_accuracy}
for level in 1 2 3 4 5; do
  erpo-jax eval --config configs/default.yaml "run.dir=$out/level$level" "data.levels=[$level]" \
    "eval.sets=[builtin:arithmetic]" "eval.temperatures=[0.0]" eval.k=1 eval.builtin_size=200 \
    eval.max_problems=200 eval.max_new_tokens=48 eval.batch_size=50 --out "$out/level$level.json"
done
