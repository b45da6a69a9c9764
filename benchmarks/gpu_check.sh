#!/usr/bin/env bash
# The GPU check: one command, cheapest stage first, each stage's results written as soon as it finishes.
#
#   benchmarks/gpu_check.sh --prepare          # on the CPU machine: wheels the GPU box lacks -> .gpu-wheels/
#   benchmarks/gpu_check.sh [OUTDIR]           # on the GPU box (default OUTDIR: $OUT, else benchmarks/results/gpu_check)
#   benchmarks/gpu_check.sh --dry-run [OUTDIR] # on a CPU: the same stages at --tiny sizes (CI runs this); default
#                                              # OUTDIR: a new temporary folder, never benchmarks/results/gpu_check
#   JAXAMP_DATA=DIR benchmarks/gpu_check.sh    # throughput on real tokens: DIR holds nanoGPT's train.bin/val.bin
#
# Stages (timeouts in seconds, scaled by the rows asked for; the default stages took 6.5 minutes on one H100 on 12-05:
# tests 107 s, ~53 s per 124M throughput row, ~21 s per gpt2-xl row scanned, where unrolled bf16 compiled in 78 s).
# xl runs scanned with --remat elementwise: on the H100, peak 37,033 MiB (bf16), 38,162 (fp8-current), 32,220
# (fp8-moments); 49,206 and 60,675 MiB temp scanned without remat (compiled, gpu_compile_xl_scanned*.md):
#   0 env         nvidia-smi, jax/flax/optax versions and devices                      -> env.txt
#   1 tests       pytest -m gpu tests/test_gpu.py: cuDNN attention, FP8 GEMMs (bf16 outputs under power-of-2
#                 scales), bitwise skip, one compile, checkpoint round trip, 20 LM steps against fp32 (highest)
#   2 throughput  benchmarks/gpu_throughput.py --model gpt2-124m (train_lm.py's preset),
#                 seq 1024; random tokens, or $JAXAMP_DATA's                           -> gpu_throughput.{md,json}
#   3 xl          the same at --model gpt2-xl, batch 8, scanned, --remat elementwise   -> gpu_throughput_xl.{md,json}
#   4 paired      benchmarks/gpu_paired.py, fp16 against bf16 interleaved in one process -> gpu_paired.md
#   5 moe         benchmarks/gpu_moe.py: an MoE layer's step (experts as batched einsums and as lax.ragged_dot;
#                 4,096 tokens, width 1024, 8 experts of 4096) per policy against bf16 autocast, interleaved
#                 (not yet run on a GPU; deviceless, XLA expands ragged_dot 7.96x)           -> gpu_moe.md
#   6 profile     benchmarks/gpu_profile.py, kernel time by kind (default: 124M, bf16 and fp8-current-pow2;
#                 GPU_CHECK_PROFILE_ARGS replaces its flags, e.g. "--model gpt2-xl --batch-size 8 --scan-layers
#                 --remat elementwise --steps 2 --precisions bf16 fp8-current-pow2")  -> gpu_profile.md
# Every stage's output also goes to OUTDIR/check.log (8 files with every stage but moe, 9 with all: the device tool
# returns at most 8).
# GPU_CHECK_PRECISIONS picks the throughput rows (default: bf16 fp8-current fp8-current-pow2 fp8, the rows issue 23
# measures; any of gpu_throughput.py's, e.g. "bf16 bf16-autocast bf16-autocast-bf16-logits" for issue 21: what
# autocast's float32 logits cost against torch.amp's bf16 ones), GPU_CHECK_XL_PRECISIONS the xl rows
# (default: bf16 fp8-current fp8-current-pow2 fp8-moments), GPU_CHECK_XL_LAYOUT their layout flags (default:
# --scan-layers --remat elementwise; "" runs unrolled, as on 12-04: bf16 216 ms/step on an H200) and GPU_CHECK_STAGES
# the stages (default: tests throughput xl; paired, moe and profile when asked). With little device time left, measure
# what is new first, e.g.
#   GPU_CHECK_STAGES=throughput GPU_CHECK_PRECISIONS="bf16 fp8-current-pow2" benchmarks/gpu_check.sh
# Before a GPU session, benchmarks/gpu_compile.py (no GPU needed: XLA:GPU compiles for an H200 deviceless) shows
# what the compiled steps will hold (cuDNN attention, FP8 GEMMs, memory; --cublas as a GPU's autotuner picks).
# The exit status is that of the first stage that failed (0 if none).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
WHEELS=.gpu-wheels
PY=${PYTHON:-python3}

if [[ ${1:-} == --prepare ]]; then
  mkdir -p "$WHEELS"
  # Pure-Python wheels of the two dependencies the GPU box lacks (it has no network); falls back to ../shared/wheels.
  $PY -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "jmp==0.0.4" "tensorboardX==2.6.5" \
    || cp ../shared/wheels/*.whl "$WHEELS"/
  ls -l "$WHEELS"
  exit 0
fi

DRY=0
if [[ ${1:-} == --dry-run ]]; then DRY=1; shift; fi
if [[ $DRY == 1 ]]; then  # a rehearsal's tiny figures never overwrite the committed GPU results
  OUTDIR=${1:-$(mktemp -d "${TMPDIR:-/tmp}/jaxamp-gpu-check-dry-run.XXXXXX")}
else
  OUTDIR=${1:-${OUT:-$REPO/benchmarks/results/gpu_check}}
fi
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)

if ! $PY -c "import jmp, tensorboardX" 2>/dev/null; then
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/jaxamp-gpu-deps "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/jaxamp-gpu-deps
  else
    echo "jmp or tensorboardX missing and no $WHEELS/: run 'benchmarks/gpu_check.sh --prepare' first" >&2
    exit 2
  fi
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DATA=()
if [[ -n ${JAXAMP_DATA:-} ]]; then DATA=(--data "$JAXAMP_DATA"); fi
status=0
: >"$OUTDIR/check.log"
stage() {  # stage NAME TIMEOUT_S COMMAND...: runs, logs to OUTDIR/check.log too, keeps the first failure's status
  local name=$1 limit=$(($2 * TIMEOUT_SCALE)); shift 2
  echo "=== [$(date -u +%H:%M:%S)] $name (timeout ${limit}s): $*" | tee -a "$OUTDIR/check.log"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUTDIR/check.log"
  local rc=${PIPESTATUS[0]}
  echo "=== [$(date -u +%H:%M:%S)] $name exit $rc" | tee -a "$OUTDIR/check.log"
  if [[ $rc -ne 0 && $status -eq 0 ]]; then status=$rc; fi
}

TESTS=(-m gpu tests/test_gpu.py)
TIMEOUT_SCALE=1  # the stages' timeouts are the GPU box's; a CPU rehearsal on a loaded shared machine gets 4x
if [[ $DRY == 1 ]]; then
  TIMEOUT_SCALE=4
  export JAXAMP_GPU_TESTS_ON_CPU=1 JAX_PLATFORMS=cpu
  TESTS+=(-k "not twenty")  # the 20-step precision comparison: the slowest on a CPU, and GPU numerics only
  SIZE=(--tiny --steps 1 --warmup 0)
  XL=(--tiny --steps 1 --warmup 0 --scan-layers --remat elementwise)
  PROFILE=(--tiny --steps 1 --warmup 0 --precisions fp16)
  PAIRED=(--tiny --rounds 2 --steps 1 --warmup 0)
  MOE=(--tokens 128 --width 32 --hidden 64 --experts 4 --capacity 64 --rounds 2 --steps 1 --warmup 0)
else
  SIZE=(--model gpt2-124m --batch-size 32 --steps 10 --warmup 3)
  read -r -a LAYOUT <<<"${GPU_CHECK_XL_LAYOUT---scan-layers --remat elementwise}"
  XL=(--model gpt2-xl --batch-size 8 --steps 5 --warmup 2 ${LAYOUT[@]+"${LAYOUT[@]}"})
  read -r -a PROFILE <<<"${GPU_CHECK_PROFILE_ARGS:---batch-size 32 --steps 3 --warmup 2 --precisions bf16 fp8-current-pow2}"
  PAIRED=(--batch-size 32 --rounds 8 --steps 5 --warmup 2)
  MOE=(--rounds 5 --steps 10 --warmup 3)
fi

{
  date -u
  nvidia-smi 2>&1 || echo "(no nvidia-smi)"
  $PY -c "import sys, jax, jaxlib, flax, optax, orbax.checkpoint as ocp, jmp
print('python', sys.version.split()[0], '| jax', jax.__version__, '| jaxlib', jaxlib.__version__, '| flax',
      flax.__version__, '| optax', optax.__version__, '| orbax-checkpoint', ocp.__version__)
print('backend', jax.default_backend(), [(d.device_kind, getattr(d, 'compute_capability', None)) for d in jax.devices()])"
} >"$OUTDIR/env.txt" 2>&1
cat "$OUTDIR/env.txt"

STAGES=" ${GPU_CHECK_STAGES:-tests throughput xl} "
wanted() { [[ $STAGES == *" $1 "* ]]; }
wanted tests && stage tests 120 $PY -m pytest -q "${TESTS[@]}" -rs -s -p no:cacheprovider
read -r -a PRECISIONS <<<"${GPU_CHECK_PRECISIONS:-bf16 fp8-current fp8-current-pow2 fp8}"
wanted throughput && stage throughput $((60 * ${#PRECISIONS[@]} + 30)) $PY benchmarks/gpu_throughput.py "${SIZE[@]}" ${DATA[@]+"${DATA[@]}"} \
  --precisions "${PRECISIONS[@]}" --out "$OUTDIR/gpu_throughput.md" --json "$OUTDIR/gpu_throughput.json"
read -r -a XL_PRECISIONS <<<"${GPU_CHECK_XL_PRECISIONS:-bf16 fp8-current fp8-current-pow2 fp8-moments}"
wanted xl && stage xl $((80 * ${#XL_PRECISIONS[@]} + 30)) $PY benchmarks/gpu_throughput.py "${XL[@]}" ${DATA[@]+"${DATA[@]}"} \
  --precisions "${XL_PRECISIONS[@]}" --out "$OUTDIR/gpu_throughput_xl.md" --json "$OUTDIR/gpu_throughput_xl.json"
wanted paired && stage paired 120 $PY benchmarks/gpu_paired.py "${PAIRED[@]}" --precisions bf16 fp16 \
  --out "$OUTDIR/gpu_paired.md"
wanted moe && stage moe 240 $PY benchmarks/gpu_moe.py "${MOE[@]}" --out "$OUTDIR/gpu_moe.md"
wanted profile && stage profile 150 $PY benchmarks/gpu_profile.py "${PROFILE[@]}" --out "$OUTDIR/gpu_profile.md"
echo "gpu_check: results in $OUTDIR; exit $status"
exit $status
