#!/usr/bin/env bash
# nanoGPT's shakespeare_char CPU recipe (4 layers, 4 heads, width 128, seq 64, batch 12, lr 1e-3 with warmup then
# cosine decay, dropout 0) on tinyshakespeare in a 1024-token byte-level BPE trained locally, in fp32, bf16 and fp16
# (dynamic loss scale), then the table (val loss in nats per token and per character, beside the character-level
# reference run). Usage: bash benchmarks/reference_bpe.sh [DATA] [OUTDIR] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-../shared/data/tinyshakespeare.txt}
out=${2:-runs/reference_bpe}
steps=${3:-2000}
for precision in fp32 bf16 fp16; do
  python experiments/train_lm.py --data "$data" --tokenizer bpe --vocab-size 1024 --precision "$precision" \
    --model small --batch-size 12 --steps "$steps" --lr 1e-3 --dropout 0 --workdir "$out/$precision" --no-progress
done
python benchmarks/reference_bpe_table.py "$out"/fp32 "$out"/bf16 "$out"/fp16 --out benchmarks/results/reference_bpe.md
python experiments/plot.py "$out"/fp32 "$out"/bf16 "$out"/fp16 --out benchmarks/results/reference_bpe.png
