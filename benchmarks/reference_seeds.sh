#!/usr/bin/env bash
# The 0.3% targets of reference_recipes.sh against seed-to-seed noise: the same CPU recipe in fp32 and fp8-current
# at more seeds (--seed sets the init and the batch order), then a table of each seed's gap to its own fp32 run.
# Usage: bash benchmarks/reference_seeds.sh [DATA] [OUTDIR] [SEEDS...]   (default seeds: 1 2 3 4; seed 1337 is in
# reference_recipes.sh's runs/reference, which the table reads too where it exists)
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-../shared/data/tinyshakespeare.txt}
out=${2:-runs/reference_seeds}
shift $(( $# > 2 ? 2 : $# ))
seeds=${*:-1 2 3 4}
for seed in $seeds; do
  for precision in fp32 fp8-current; do
    python experiments/train_lm.py --data "$data" --precision "$precision" --layers 4 --heads 4 --width 128 \
      --seq-len 64 --batch-size 12 --steps 2000 --lr 1e-3 --dropout 0 --seed "$seed" \
      --workdir "$out/$precision-s$seed" --no-progress
  done
done
python benchmarks/reference_seeds_table.py "$out" --out benchmarks/results/reference_seeds.md
