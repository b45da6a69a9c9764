#!/usr/bin/env bash
# nanoGPT's shakespeare_char CPU recipe (4 layers, 4 heads, width 128, seq 64, batch 12, 2000 steps, lr 1e-3 with
# warmup then cosine decay, dropout 0) in fp32, bf16, fp16 (dynamic loss scale) and fp8 (bf16 compute, FP8 Dense
# matmuls with delayed scaling; on a CPU with FP8 rounding and no speed), then the results table and plot.
# Usage: bash benchmarks/reference_run.sh [DATA] [OUTDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-../shared/data/tinyshakespeare.txt}
out=${2:-runs/reference}
for precision in fp32 bf16 fp16 fp8; do
  python experiments/train_lm.py --data "$data" --precision "$precision" --layers 4 --heads 4 --width 128 \
    --seq-len 64 --batch-size 12 --steps 2000 --lr 1e-3 --dropout 0 --workdir "$out/$precision" --no-progress
done
python benchmarks/reference_table.py "$out"/fp32 "$out"/bf16 "$out"/fp16 "$out"/fp8 \
  --out benchmarks/results/reference_run.md
python experiments/plot.py "$out"/fp32 "$out"/bf16 "$out"/fp16 "$out"/fp8 --out benchmarks/results/reference_run.png
