#!/usr/bin/env bash
# nanoGPT's shakespeare_char CPU recipe (as reference_run.sh) in fp32 and under the FP8-recipes issue's settings:
# fp8-current (also with power-of-2 scales), fp8-block and mxfp8 (numerics on a CPU: 1x32 blocks, e8m0 scales)
# (stateless FP8 weight matmuls under autocast, the tied
# head (float32 logits) and attention bf16) and bf16 with Adam's moments stored in bfloat16; then the table (0.3% of
# fp32 targets) and the plot.
# Usage: bash benchmarks/reference_recipes.sh [DATA] [OUTDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-../shared/data/tinyshakespeare.txt}
out=${2:-runs/reference}
for precision in fp32 fp8-current fp8-current-pow2 fp8-block mxfp8 "bf16;opt_state=bf16"; do
  dir=${precision/bf16;opt_state=bf16/bf16-moments}
  python experiments/train_lm.py --data "$data" --precision "$precision" --layers 4 --heads 4 --width 128 \
    --seq-len 64 --batch-size 12 --steps 2000 --lr 1e-3 --dropout 0 --workdir "$out/$dir" --no-progress
done
python benchmarks/reference_table.py "$out"/fp32 "$out"/fp8-current "$out"/fp8-current-pow2 "$out"/fp8-block \
  "$out"/mxfp8 "$out"/bf16-moments --out benchmarks/results/reference_recipes.md
python experiments/plot.py "$out"/fp32 "$out"/fp8-current "$out"/fp8-current-pow2 "$out"/fp8-block "$out"/mxfp8 \
  "$out"/bf16-moments \
  --out benchmarks/results/reference_recipes.png
