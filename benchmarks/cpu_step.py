"""The CPU step at the nanoGPT recipe's size: jaxamp's model against plain Flax of the same math, and the full fp32
training step against nanoGPT's step in eager PyTorch.

    python benchmarks/cpu_step.py                        # 4 layers, width 128, seq 64, batch 12 (~4 min on 2 cores)
    python benchmarks/cpu_step.py --profile              # + where the jaxamp step's time goes (XLA:CPU trace)
    python benchmarks/cpu_step.py --layers 1 --width 32 --heads 2 --seq-len 16 --rounds 2 --steps 2 \\
        --gelu-points 1000 --out /tmp/cpu_step.md         # smoke test

What it measures, all in one process:

1. Model forward + backward (`jax.value_and_grad` of the mean cross-entropy, jitted), jaxamp's `TransformerLM`
   against `PlainGPT` (`benchmarks/plain_gpt.py`): the same computation from stock linen modules (`nn.Embed`,
   `nn.Dense`, `nn.LayerNorm` with two-pass variance and epsilon 1e-5, einsum attention masked with
   `jax.nn.dot_product_attention`'s finite value, exact GELU, tied head via `nn.Embed.attend`), with the same
   parameter tree, so both run on jaxamp's initial weights (their losses and gradients are compared first). Two
   more Flax rows for context: stock `nn.LayerNorm` (one-pass variance, `E[x^2] - E[x]^2`), and that with the tanh
   GELU (the baseline of issue 14).
   Interleaved rounds (`benchmarks.harness.interleaved`); medians, and the per-round paired ratios.
2. The full fp32 training step (`jaxamp.lm.setup.build(TrainConfig(precision="fp32")).step_fn`: AdamW, clipping,
   metrics) against nanoGPT's step in eager PyTorch (`benchmarks.nanogpt_compare.time_throughput`, same batches),
   or the "PyTorch not installed" line.
3. Exact-GELU forms (`--gelu-points`, 0 = skip): ulp distance of cheaper forms from `nn.gelu(approximate=False)` and
   from a float64 reference over a dense sweep of [-10, 10] plus extremes, and their forward + backward time.
4. `--profile`: the jaxamp training step's time by kind of work, from XLA:CPU's per-thunk trace (median per op).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

if "--profile" in sys.argv[1:]:  # XLA:CPU names each executed thunk in the trace only with this flag, read at start
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks import nanogpt_compare as ngc  # noqa: E402
from benchmarks.nanogpt_torch import NO_TORCH, torch  # noqa: E402
from benchmarks.plain_gpt import PlainGPT  # noqa: E402
from jaxamp.lm.config import ConfigError, TrainConfig  # noqa: E402
from jaxamp.lm.data import DataError, batch_at  # noqa: E402
from jaxamp.lm.model import TransformerConfig, TransformerLM, count_params, cross_entropy_loss  # noqa: E402
from jaxamp.lm.setup import build

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "cpu_step.md"
GOAL = 1.05  # issue 14: jaxamp's model step at most this multiple of plain Flax's of the same math
FLAX_ROWS = {
    "flax": "plain Flax, same math (two-pass LayerNorm, exact GELU)",
    "flax_stock_ln": "plain Flax, stock nn.LayerNorm (one-pass variance), exact GELU",
    "flax_stock_ln_tanh": "plain Flax, stock nn.LayerNorm, tanh GELU (issue 14's baseline)",
}


# ---------------------------------------------------------------------------------------------------------------------
# Measurements


def model_steps(cfg: TransformerConfig, batch) -> tuple[dict, dict]:
    """Jitted `params -> (loss, grads)` of jaxamp's model and of each Flax row, and jaxamp's initial parameters."""
    x, y = batch
    models = {"jaxamp": TransformerLM(cfg), "flax": PlainGPT(cfg), "flax_stock_ln": PlainGPT(cfg, fast_variance=True),
              "flax_stock_ln_tanh": PlainGPT(cfg, fast_variance=True, tanh_gelu=True)}
    params = models["jaxamp"].init(jax.random.key(0), x)["params"]
    fns = {}
    for name, model in models.items():
        tree = jax.tree.structure(jax.eval_shape(model.init, jax.random.key(0), x)["params"])
        assert tree == jax.tree.structure(params), f"{name}: parameter tree differs from jaxamp's"
        fns[name] = jax.jit(jax.value_and_grad(lambda p, m=model: cross_entropy_loss(m.apply({"params": p}, x), y)))
    return fns, params


def agreement(fns: dict, params) -> dict:
    """Each row's loss and gradients against jaxamp's on the same weights: max |difference| (gradients: over all
    leaves, relative to the largest |gradient| of that leaf)."""
    ref_loss, ref_grads = fns["jaxamp"](params)
    out = {}
    for name, fn in fns.items():
        loss, grads = fn(params)
        rel = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30)),
                           grads, ref_grads)
        out[name] = {"loss": abs(float(loss) - float(ref_loss)), "grad_rel": max(jax.tree.leaves(rel))}
    return out


def time_models(fns: dict, params, args) -> dict:
    """Interleaved rounds of `args.steps` forward + backward calls per row: seconds per call, by round."""
    def window(fn):
        def run(idx):
            out = None
            for _ in idx:
                out = fn(params)
            jax.block_until_ready(out)
        return run

    _, seconds = harness.interleaved({n: window(f) for n, f in fns.items()}, rounds=args.rounds, steps=args.steps,
                                 warmup=args.warmup, pause=args.pause)
    return {n: [s / args.steps for s in v] for n, v in seconds.items()}


def full_step(run, train_cfg: TrainConfig, args) -> dict:
    """jaxamp's fp32 training step and nanoGPT's eager PyTorch step, interleaved on the same batches (tokens/s)."""
    opts = SimpleNamespace(rounds=args.rounds, steps=args.steps, warmup=args.warmup, pause=args.pause,
                           threads=args.threads)
    return ngc.time_throughput(run, train_cfg, opts)


# ---------------------------------------------------------------------------------------------------------------------
# Exact-GELU forms


_SQRT_HALF = np.float32(math.sqrt(0.5))
GELU_FORMS = {
    "exact": ("`nn.gelu(approximate=False)`: 0.5 x erfc(-x/sqrt2) (jaxamp, the reference)",
              lambda x: nn.gelu(x, approximate=False)),
    "erf": ("0.5 x (1 + erf(x/sqrt2)): PyTorch's formula, XLA's cheap `erf`",
            lambda x: 0.5 * x * (1.0 + jax.lax.erf(x * _SQRT_HALF))),
    "tanh": ("`nn.gelu(approximate=True)`: tanh approximation (not exact; for scale)",
             lambda x: nn.gelu(x, approximate=True)),
}
GELU_REGIONS = {"x >= 0": (0.0, np.inf), "-3 <= x < 0": (-3.0, 0.0), "x < -3": (-np.inf, -3.0)}


def gelu_inputs(points: int) -> np.ndarray:
    """`points` evenly spaced float32 in [-10, 10] plus extremes (zeros, subnormals, huge, infinities)."""
    tiny, big = np.finfo(np.float32).tiny, np.finfo(np.float32).max
    extremes = [0.0, -0.0, tiny, -tiny, tiny / 8, -tiny / 8, 1e-30, -1e-30, 1e-7, -1e-7, 13.0, -13.0, 20.0, -20.0,
                50.0, -50.0, 1e30, -1e30, big, -big, np.inf, -np.inf]
    return np.concatenate([np.linspace(-10.0, 10.0, points, dtype=np.float32), np.array(extremes, np.float32)])


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| in float32 units in the last place (0 between +0 and -0 and between two NaNs; NaN vs number: 2^32).

    Subnormal values count as zero: XLA:CPU flushes them (a subnormal result against XLA's 0 is not an error of the
    formula).
    """
    def line(v):
        v = np.where(np.abs(v) < np.finfo(np.float32).tiny, np.float32(0.0), v.astype(np.float32))
        k = v.view(np.int32).astype(np.int64)
        return np.where(k < 0, -(k & 0x7FFFFFFF), k)  # monotonic integer line through 0

    d = np.abs(line(a) - line(b))
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    return np.where(nan_a & nan_b, 0, np.where(nan_a | nan_b, 2**32, d))


def gelu_accuracy(points: int) -> dict:
    """Max ulp distance of each form from `exact` and from a float64 reference, by region of x."""
    from scipy.special import erfc  # pylint: disable=import-outside-toplevel  (scipy: a jax dependency)

    xs = gelu_inputs(points)
    x64 = xs.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        truth = (0.5 * x64 * erfc(-x64 * math.sqrt(0.5))).astype(np.float32)
    values = {name: np.asarray(jax.jit(fn)(jnp.asarray(xs))) for name, (_, fn) in GELU_FORMS.items()}
    if torch is not None:
        values["torch"] = torch.nn.functional.gelu(torch.from_numpy(xs)).numpy()
    out = {}
    for name, v in values.items():
        d_exact, d_truth = ulp_distance(v, values["exact"]), ulp_distance(v, truth)
        out[name] = {region: (int(d_exact[m].max()), int(d_truth[m].max()))
                     for region, (lo, hi) in GELU_REGIONS.items() for m in [(xs >= lo) & (xs < hi)]}
    return {"points": len(xs), "by_form": out}


def gelu_timing(shape: tuple, args) -> dict:
    """Forward + backward (`jax.vjp`) of each form on `f32[shape]`, interleaved: seconds per call, by round."""
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
    g = jax.random.normal(jax.random.key(1), shape, jnp.float32)
    windows = {}
    for name, (_, fn) in GELU_FORMS.items():
        f = jax.jit(lambda x, g, fn=fn: jax.vjp(fn, x)[1](g)[0])

        def run(idx, f=f):
            out = None
            for _ in range(len(idx) * 10):
                out = f(x, g)
            jax.block_until_ready(out)

        windows[name] = run
    _, seconds = harness.interleaved(windows, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                                     pause=args.pause)
    return {n: [s / (10 * args.steps) for s in v] for n, v in seconds.items()}


# ---------------------------------------------------------------------------------------------------------------------
# Where the jaxamp step's time goes (--profile)


def kind_of(op_name: str, opcode: str, transposes: bool) -> str:
    """The kind of work of one compiled op, from its opcode, whether it (or its fused computation) transposes, and
    the op_name metadata JAX gives it."""
    if opcode == "dot" or "dot_general" in op_name:
        return "matmuls (Dense layers, attention, tied head; forward and backward)"
    if transposes:
        return "layout transposes (mostly of gradients for the weight-gradient matmuls), with the elementwise work " \
               "XLA fused into them"
    if "/mlp/" in op_name:
        return "GELU (exact erf) forward and backward"
    if "/attn/" in op_name:
        return "attention core: softmax, mask, scale"
    if "/ln_" in op_name:
        return "LayerNorm forward and backward, and the residual-gradient sums fused into it"
    if "TransformerLM" in op_name:
        return "embeddings, residual adds, tied head's other ops"
    return "loss, AdamW, gradient clipping, metrics"


def hlo_ops(text: str) -> dict:
    """`{op name: (opcode, op_name metadata, transposes)}` for the entry computation of a compiled module's text;
    `transposes`: the op is a transpose or a fusion whose computation contains one."""
    import re  # pylint: disable=import-outside-toplevel

    bodies = {m.group(1): m.group(2) for m in re.finditer(r"\n%(\S+) \([^\n]*\{\n(.*?)\n\}", text, re.S)}
    ops = {}
    for line in text[text.index("\nENTRY"):].splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = \S+ (\w[\w-]*)\(", line)
        if m:
            meta, calls = re.search(r'op_name="([^"]*)"', line), re.search(r"calls=%([^,\s]+)", line)
            body = bodies.get(calls.group(1), "") if calls else ""
            transposes = m.group(2) == "transpose" or " transpose(" in body
            ops[m.group(1)] = (m.group(2), meta.group(1) if meta else "", transposes)
    return ops


def profile_step(run, batches: list, steps: int) -> dict:
    """Traces `steps` jaxamp training steps; ms per step by kind of work (median per op over the steps)."""
    import glob  # noqa: E401  pylint: disable=import-outside-toplevel,multiple-imports
    import gzip
    import json
    import tempfile

    state = harness.copy_tree(run.state)
    ops = hlo_ops(run.step_fn.lower(state, batches[0]).compile().as_text())
    for b in batches[:3]:
        state, _ = run.step_fn(state, b)
    jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for i in range(steps):
                state, metrics = run.step_fn(state, batches[i % len(batches)])
            jax.block_until_ready((state, metrics))
            wall = (time.perf_counter() - t0) / steps
        events = json.load(gzip.open(glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True)[0]))["traceEvents"]
    durations: dict = {}
    for e in events:
        if e.get("ph") == "X" and e.get("name") in ops:
            durations.setdefault(e["name"], []).append(e.get("dur", 0) / 1e3)  # ms
    kinds: dict = {}
    for name, ds in durations.items():
        kind = kind_of(ops[name][1], ops[name][0], ops[name][2])
        kinds[kind] = kinds.get(kind, 0.0) + statistics.median(ds)
    return {"steps": steps, "wall_ms": 1e3 * wall, "ops": len(durations), "kinds": kinds}


# ---------------------------------------------------------------------------------------------------------------------
# Report


def model_section(res: dict, args) -> list:
    """The model forward + backward table and the goal line."""
    t, agree, tokens = res["model_s"], res["agree"], res["tokens"]
    labels = {"jaxamp": "jaxamp `TransformerLM`", **FLAX_ROWS}
    lines = ["## Model forward + backward (fp32)", "",
             f"`jax.value_and_grad` of the mean cross-entropy, jitted, on jaxamp's initial weights and one batch; "
             f"{args.rounds} interleaved rounds of {args.steps} calls per row after {args.warmup} warm-up call(s). "
             "Ratios against the same-math Flax row: of the medians, then the per-round paired ratios. The last two "
             "columns compare each row's loss and gradients with jaxamp's on the same weights.", "",
             "| model | median ms/step | min-max ms/step | tokens/s | vs same-math Flax: medians | paired: median "
             "(min-max) | loss diff vs jaxamp | max grad diff vs jaxamp (relative) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, label in labels.items():
        med = statistics.median(t[name])
        lines.append(f"| {label} | {1e3 * med:.2f} | {harness.spread(t[name], 1e3, '.2f')} | {tokens / med:,.0f} | "
                     f"{harness.ratio_cells(t[name], t['flax'])} | {agree[name]['loss']:.1e} | "
                     f"{agree[name]['grad_rel']:.1e} |")
    ratio = harness.ratio_of_medians(t["jaxamp"], t["flax"])
    paired = statistics.median(harness.paired_ratios(t["jaxamp"], t["flax"]))
    met = "met" if max(ratio, paired) <= GOAL else "**not met**"
    lines += ["", f"Goal (issue 14), jaxamp's model step at most {GOAL}x plain Flax's of the same math: {met} "
              f"({ratio:.3f}x by medians, {paired:.3f}x paired)."]
    return lines


def step_section(res: dict) -> list:
    """The full training step table: jaxamp against PyTorch."""
    thr = res["step"]
    per = thr["per_round"]
    lines = ["## Full fp32 training step against nanoGPT in eager PyTorch", "",
             "jaxamp: `build(TrainConfig(precision=\"fp32\")).step_fn` (AdamW, clipping at 1.0, metrics; jitted, state "
             "donated). PyTorch: nanoGPT's train.py step on its model.py (`benchmarks/nanogpt_compare.py`), eager, "
             "same batches; interleaved with jaxamp's step.", "",
             "| step | median tokens/s | min-max tokens/s | median ms/step | PyTorch / jaxamp: medians | paired: "
             "median (min-max) |", "| --- | --- | --- | --- | --- | --- |"]
    med = statistics.median(per["jaxamp"])
    lines.append(f"| jaxamp fp32 | {med:,.0f} | {harness.spread(per['jaxamp'], 1, ',.0f')} | "
                 f"{1e3 * thr['tokens_per_step'] / med:.1f} | | |")
    torch_names = [n for n in per if n.startswith("torch@")]
    for name in torch_names:
        n = int(name[6:])
        v = statistics.median(per[name])
        lines.append(f"| PyTorch {torch.__version__} fp32 eager, {n} thread{'s' if n > 1 else ''} | {v:,.0f} | "
                     f"{harness.spread(per[name], 1, ',.0f')} | {1e3 * thr['tokens_per_step'] / v:.1f} | "
                     f"{harness.ratio_cells(per[name], per['jaxamp'])} |")
    if not torch_names:
        lines.append(f"| PyTorch fp32 eager | {NO_TORCH} | | | | |")
    return lines


def gelu_section(res: dict, args) -> list:
    """The exact-GELU forms table: ulp distances and time."""
    acc, t = res["gelu_acc"], res["gelu_s"]
    regions = list(GELU_REGIONS)
    head = " | ".join(f"vs exact, {r}" for r in regions) + " | " + " | ".join(f"vs float64, {r}" for r in regions)
    lines = ["## Exact-GELU forms", "",
             f"Max distance in float32 ulps over {acc['points']:,} inputs ({args.gelu_points:,} evenly spaced in "
             "[-10, 10], plus zeros, subnormals, +-13, +-20, +-50, +-1e30, +-max, +-inf), from jaxamp's exact GELU and "
             "from a float64 reference (scipy's erfc, rounded to float32; subnormal results count as 0, as XLA:CPU "
             "flushes them); forward + backward time on "
             f"f32{list(res['gelu_shape'])} (the MLP's hidden activation), interleaved, per call.", "",
             f"| form | {head} | fwd+bwd us (median) | vs exact |",
             "| --- | " + " | ".join(["---"] * (2 * len(regions))) + " | --- | --- |"]
    for name, by_region in acc["by_form"].items():
        desc = GELU_FORMS[name][0] if name in GELU_FORMS else "`torch.nn.functional.gelu` (exact, float32 CPU)"
        cells = [str(by_region[r][0]) for r in regions] + [str(by_region[r][1]) for r in regions]
        timing = (f"{1e6 * statistics.median(t[name]):.0f} | "
                  f"{statistics.median(t[name]) / statistics.median(t['exact']):.2f}x" if name in t else "| ")
        lines.append(f"| {desc} | " + " | ".join(cells) + f" | {timing} |")
    return lines


def profile_section(prof: dict) -> list:
    """The `--profile` table: ms per step by kind of work."""
    total = sum(prof["kinds"].values())
    lines = ["## Where the jaxamp training step's time goes", "",
             f"XLA:CPU's trace of {prof['steps']} steps (`--profile`): {prof['ops']} compiled ops per step; for each "
             "op its median time over the steps, summed by kind of work. The ops' sum is "
             f"{total:.1f} ms per step against {prof['wall_ms']:.1f} ms wall time per traced step (ops of one step may "
             "overlap on the two cores; dispatch, waits and tracing add the rest).", "",
             "| kind of work | ms per step | share of the ops' sum |", "| --- | --- | --- |"]
    for kind, ms in sorted(prof["kinds"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {ms:.2f} | {100 * ms / total:.0f}% |")
    return lines


NOTES = [
    "- The same-math Flax row is what jaxamp computes in fp32, from stock modules; its parameter tree is jaxamp's, "
    "so both run on the same weights, and the loss and gradient columns show they compute the same function (up to "
    "float32 rounding: `nn.LayerNorm` multiplies scale and rsqrt first, jaxamp the centred input first). The two "
    "stock rows change the math: one-pass variance cancels for rows with a large mean (the reason jaxamp computes "
    "two-pass statistics), and the tanh GELU is not nanoGPT's `nn.GELU()`.",
    "- jaxamp's `layers.Dense`/`Embed`/`attend`/`add_bias` are custom-VJP pieces for half precision; in fp32 they "
    "compile to the ops of `nn.Dense`/`nn.Embed` (checked in `tests/test_model.py`).",
    "- A cheaper exact GELU would have to match `nn.gelu(approximate=False)` to float32 rounding; the GELU table "
    "says how far the erf form is from it. XLA's `erf` is one rational function; its `erfc` (in jaxamp's exact "
    "GELU) evaluates an `exp`, two divisions and three polynomials for every element.",
    "- The profile's transpose row: XLA:CPU (jax 0.10.2) runs the weight-gradient matmuls `x^T g` through Eigen "
    "with the gradient `g` transposed first, and when `g` is still an unmaterialised elementwise expression (the GELU "
    "backward without a bias-gradient reduction to materialise it, or the residual stream's gradient: a running sum "
    "of LayerNorm-backward terms) XLA fuses that expression into the transpose, which then reads its inputs with a "
    "stride of a whole row. Those transposes exist in the plain Flax model too.",
    "- PyTorch's multi-threaded row depends on the machine's load: its OpenMP workers spin-wait, and a descheduled "
    "worker stalls the step (see `benchmarks/results/nanogpt_compare.md`). CPU only: nothing here is about GPUs.",
]


def report(res: dict, args, command: str, started: datetime.datetime) -> str:
    """The markdown report of `run`'s measurements."""
    cfg = res["cfg"]
    lines = ["# The CPU step: jaxamp against plain Flax of the same math, and against PyTorch eager", "",
             f"Generated by `benchmarks/cpu_step.py` on {started:%Y-%m-%d %H:%M} (took "
             f"{time.time() - started.timestamp():.0f} s). Command: `{command}`.", "",
             f"- Machine: {res['machine']}; load average at the end {res['load_end']}. A shared 2-core box with other "
             "jobs running: absolute figures move by tens of percent from run to run; the interleaved ratios are the "
             "steadier figures.",
             f"- Versions: {ngc.versions()}.",
             f"- Model: nanoGPT's CPU recipe shape: {cfg.num_layers} layers, {cfg.num_heads} heads, width "
             f"{cfg.width}, seq {cfg.seq_len}, batch {args.batch_size} ({res['tokens']} tokens/step), vocab "
             f"{cfg.vocab_size}, bias={cfg.use_bias}, {res['params']:,} parameters, no dropout; data "
             f"`{args.data or 'stdlib corpus'}`.", ""]
    lines += model_section(res, args) + [""] + step_section(res)
    if "gelu_acc" in res:
        lines += [""] + gelu_section(res, args)
    if "profile" in res:
        lines += [""] + profile_section(res["profile"])
    return "\n".join(lines + ["", "## Notes", ""] + NOTES) + "\n"


def parse_args(argv=None):
    """The flags, checked (one-line usage errors)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default=str(harness.SHAKESPEARE) if harness.SHAKESPEARE.exists() else None,
                   help="UTF-8 text (default ../shared/data/tinyshakespeare.txt; the stdlib corpus if it is missing)")
    harness.add_model_flags(p)
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=False,
                   help="biases in Dense layers and LayerNorms (default off, as nanoGPT's train.py and jaxamp's "
                        "TrainConfig)")
    harness.add_timing_flags(p, rounds=15, steps=10, warmup=3, pause=0.2)  # each phase; a variant is a row
    p.add_argument("--threads", type=harness.thread_counts, default=harness.thread_counts(f"{os.cpu_count()},1"),
                   help="comma-separated torch.set_num_threads values, one PyTorch row each (default: all cores,1)")
    p.add_argument("--gelu-points", type=int, default=10_000_001, help="GELU sweep size in [-10, 10] (0 = skip)")
    p.add_argument("--profile", action="store_true", help="trace the jaxamp step and break its time down by kind")
    p.add_argument("--profile-steps", type=int, default=20, help="traced steps with --profile")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="markdown report (also printed)")
    args = p.parse_args(argv)
    harness.check_sizes(p, args, ("layers", "heads", "width", "seq_len", "batch_size", "rounds", "steps", "warmup",
                          "profile_steps"), ("gelu_points", "pause"))
    harness.check_file(p, "--data", args.data)
    harness.check_output(p, "--out", args.out)
    return args


def run(args) -> dict:
    """All measurements; the report's inputs."""
    res = {"machine": harness.machine()}  # the load before ours
    train_cfg = TrainConfig(data=args.data, precision="fp32", layers=args.layers, heads=args.heads, width=args.width,
                            seq_len=args.seq_len, batch_size=args.batch_size, bias=args.bias, steps=2000,
                            progress=False)
    run_ = build(train_cfg)
    cfg = run_.model.config
    batch = batch_at(run_.dataset.train, seed=train_cfg.seed, step=0, batch_size=args.batch_size,
                     seq_len=args.seq_len)
    fns, params = model_steps(cfg, batch)
    res.update(cfg=cfg, tokens=args.batch_size * args.seq_len, params=count_params(params))
    res["agree"] = agreement(fns, params)
    harness.log("model fwd+bwd: agreement " + ", ".join(f"{n}: {a['grad_rel']:.1e}" for n, a in res["agree"].items()))
    res["model_s"] = time_models(fns, params, args)
    harness.log("model fwd+bwd ms: " + ", ".join(f"{n}: {1e3 * statistics.median(v):.1f}"
                                                 for n, v in res["model_s"].items()))
    res["step"] = full_step(run_, train_cfg, args)
    harness.log("train step tokens/s: " + ", ".join(f"{n}: {statistics.median(v):.0f}" for n, v in
                                             res["step"]["per_round"].items()))
    if args.gelu_points:
        res["gelu_acc"] = gelu_accuracy(args.gelu_points)
        res["gelu_shape"] = (args.batch_size, args.seq_len, cfg.mlp_ratio * cfg.width)
        res["gelu_s"] = gelu_timing(res["gelu_shape"], args)
    if args.profile:
        batches = [batch_at(run_.dataset.train, seed=train_cfg.seed, step=i, batch_size=args.batch_size,
                            seq_len=args.seq_len) for i in range(8)]
        res["profile"] = profile_step(run_, batches, args.profile_steps)
    res["load_end"] = harness.load_average()
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    harness.uncached_compiles()  # its trace + compile seconds are compiles, never cache reads
    started = datetime.datetime.now()
    try:
        res = run(args)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    harness.write_report(args.out, report(res, args, harness.command_line(__file__, argv), started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
