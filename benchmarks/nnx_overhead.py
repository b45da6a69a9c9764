"""CPU overhead of the Flax NNX step `jaxamp.nnx.train_step` against the functional `jaxamp.train_step`.

    python benchmarks/nnx_overhead.py                   # reference size: 4 layers, 4 heads, width 128, seq 64, batch 12
    python benchmarks/nnx_overhead.py --rounds 2 --steps 2 --layers 1 --width 16 --heads 2 --out /tmp/nnx.md   # smoke

The sibling of `overhead.py` (same LM, loss, optax AdamW, fp16 policy and `DynamicLossScale`, same token batches).
The NNX variants run the linen LM wrapped as an NNX module (`nnx.bridge.ToNNX`) with (a)'s weights, so the compiled
arithmetic is (a)'s (XLA's cost model says so in the table) and what differs is the NNX step's Python-side work per
call: reading the arrays out of the model's and optimizer's variables, NNX's graph traversal where it runs, and
writing the new arrays back.

  a  `jaxamp.train_step` on a `TrainState`, jitted with the state donated (overhead.py's (a))
  f  `jaxamp.nnx.train_step` inside `nnx.jit(..., donate_argnames=("model", "opt"))`
  g  `jaxamp.nnx.train_step(..., donate=True)` called directly (its own jitted fast path)
  h  (f) through `nnx.cached_partial(step, model, opt)` (NNX's cache of its graph traversal)

Two measurements, each interleaved in one process (round-robin, the starting variant rotating per round):

1. the reference size: seconds per step of each variant (dispatch of `--steps` steps, then `block_until_ready`), with
   short rounds so that paired rounds see the same machine load; ratios to (a) by medians and per-round pairs;
2. the Python-side cost per step: the same structure (same layers and heads, so the same variables) at width
   `--probe-width`, sequence 8 and batch 1, where the compute is small: the extra milliseconds per step over (a),
   then divided by (a)'s reference step. On a shared, loaded machine (1) is noisy by several percent; (2) measures
   the fixed cost that (1) hides in its noise.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import harness, overhead  # noqa: E402  (overhead: variant (a), the LM and batches, windows)
from jaxamp import DynamicLossScale, get_policy  # noqa: E402
from jaxamp.lm.model import TransformerConfig, count_params, cross_entropy_loss  # noqa: E402
from jaxamp.nnx import Optimizer, train_step  # noqa: E402

DEFAULT_OUT = harness.RESULTS / "nnx_overhead.md"
VARIANTS = {
    "a": "jaxamp.train_step (functional), fp16 + DynamicLossScale, state donated",
    "f": "jaxamp.nnx.train_step under nnx.jit, model and opt donated",
    "g": "jaxamp.nnx.train_step called directly, donate=True",
    "h": "jaxamp.nnx.train_step under nnx.jit + nnx.cached_partial",
}
GOAL = 1.05


def make_nnx_variant(name: str, model, params, tx, counter: list):
    """(f), (g), (h) as `(step, carry, call)` like `overhead.make_variant`: the LM as an NNX module, (a)'s weights."""
    module = nnx.bridge.ToNNX(model, rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(module, jnp.zeros((1, model.config.seq_len), jnp.int32))
    nnx.update(module, harness.copy_tree(params))  # ToNNX keeps linen's names
    opt = Optimizer(module, tx, policy=get_policy("fp16"), loss_scale=DynamicLossScale(overhead.INIT_SCALE))

    def loss_fn(m, batch):  # overhead.py's loss (dropout is 0 there)
        counter[0] += 1
        inputs, targets = batch
        return cross_entropy_loss(m(inputs, deterministic=True), targets)

    if name == "g":
        step = functools.partial(train_step, loss_fn=loss_fn, donate=True)
        return step, (module, opt), lambda f, carry, batch: (f(*carry, batch), carry)[1]
    jitted = nnx.jit(lambda m, o, batch: train_step(m, o, batch, loss_fn), donate_argnames=("m", "o"))
    if name == "f":
        return jitted, (module, opt), lambda f, carry, batch: (f(*carry, batch), carry)[1]
    return nnx.cached_partial(jitted, module, opt), (module, opt), lambda f, carry, batch: (f(batch), carry)[1]


def interleave(model, params, batches, *, rounds: int, steps: int, warmup: int, count_events: bool) -> dict:
    """Builds every variant, runs its first call and `warmup` steps, then `rounds` interleaved timed rounds.

    Returns `{"per_round": {n: [s/step, ...]}, "first_call": {n: s}, "traces": {n: int}, "windows": {n: window}}`;
    with `count_events`, XLA compile events are attributed to the variants (`harness.compile_events()`).
    """
    tx = optax.adamw(learning_rate=1e-3, weight_decay=0.1)
    traces = {n: [0] for n in VARIANTS}
    windows = {n: overhead.Window(n, (overhead.make_variant if n == "a" else make_nnx_variant)(
        n, model, params, tx, traces[n]), batches, count_events) for n in VARIANTS}
    res = overhead.run_interleaved(windows, rounds=rounds, steps=steps, warmup=warmup)
    return {**res, "traces": {n: traces[n][0] for n in VARIANTS}, "windows": windows}


def _cost(step, *args) -> dict:
    """XLA's cost model of the lowered (unoptimized) step: `{"flops": ..., "bytes": ...}`; no compile needed."""
    analysis = step.lower(*args).cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return {"flops": float(analysis.get("flops", 0.0)), "bytes": float(analysis.get("bytes accessed", 0.0))}


def _scale(name: str, carry) -> float:
    if name == "a":
        return float(carry[0].loss_scale.loss_scale)
    model, opt = carry
    return float(opt.train_state(model).loss_scale.loss_scale)


def _probe(args) -> dict | None:
    """The Python-side cost: median seconds per step of each variant at `--probe-width`, seq 8, batch 1."""
    if not args.probe_rounds:
        return None
    _, model, params, batches = overhead.setup(args.layers, args.heads, args.probe_width, 8, 1, args.vocab)
    probe = interleave(model, params, batches, rounds=args.probe_rounds, steps=args.probe_steps, warmup=args.warmup,
                       count_events=False)
    return {n: statistics.median(v) for n, v in probe["per_round"].items()}


def run(args) -> dict:
    """Both measurements; the report's input."""
    machine = harness.machine(when="at start")  # before this process adds load
    cfg, model, params, batches = overhead.setup(args.layers, args.heads, args.width, args.seq_len, args.batch_size,
                                                 args.vocab)
    ref = interleave(model, params, batches, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                     count_events=True)
    w = ref["windows"]
    cost = {"a": _cost(w["a"].step, *w["a"].carry, batches[0]), "nnx": _cost(w["f"].step, *w["f"].carry, batches[0])}
    return {
        "machine": machine, "cfg": cfg, "n_params": count_params(params), "cost": cost,
        "median": {n: statistics.median(v) for n, v in ref["per_round"].items()},
        "per_round": ref["per_round"], "first_call": ref["first_call"], "traces": ref["traces"],
        "compiles": {n: harness.compile_events().count(n) for n in VARIANTS},
        "probe": _probe(args),
        "n_variables": len(jax.tree.leaves(nnx.state(w["g"].carry))),
        "skipped": {n: _scale(n, w[n].carry) != overhead.INIT_SCALE for n in VARIANTS},
    }


def _paired(res, x: str) -> tuple[float, float, float]:
    """Median and 25th-75th percentile of the per-round ratios x/(a)."""
    ratios = harness.paired_ratios(res["per_round"][x], res["per_round"]["a"])
    lo, mid, hi = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return mid, lo, hi


def _header(args, res, argv) -> list[str]:
    cfg: TransformerConfig = res["cfg"]
    tokens = args.batch_size * args.seq_len
    return [
        "# Flax NNX step overhead on CPU",
        "",
        f"- command: `{harness.command_line(__file__, argv)}`",
        f"- machine: {res['machine']}",
        f"- date: {harness.now()}",
        f"- model: {cfg.num_layers} layers, {cfg.num_heads} heads, width {cfg.width}, seq {cfg.seq_len}, vocab "
        f"{cfg.vocab_size}, batch {args.batch_size} ({tokens} tokens/step), {res['n_params']:,} params; the NNX "
        f"model and optimizer hold {res['n_variables']} variables; optax.adamw; fp16 + DynamicLossScale",
        f"- protocol: {args.rounds} interleaved rounds x {args.steps} steps per variant (start rotates per round), "
        f"after a first call and {args.warmup} warmup steps",
        "- CPU timings on a shared 2-core machine with other jobs running: differences of a few % are within noise.",
        "",
    ]


def _reference_section(args, res) -> list[str]:
    tokens, med = args.batch_size * args.seq_len, res["median"]
    ca, cn = res["cost"]["a"], res["cost"]["nnx"]
    lines = ["## At the reference size", "",
             *harness.table(["variant", "median ms/step", "tokens/s (median)", "first call s", "traces in run",
                             "XLA compiles in run", "vs (a): of medians",
                             "vs (a): per-round paired, median (25th-75th pct)"])]
    for n, desc in VARIANTS.items():
        mid, lo, hi = _paired(res, n)
        lines.append(f"| ({n}) {desc} | {med[n] * 1e3:.2f} | {tokens / med[n]:,.0f} | {res['first_call'][n]:.2f} | "
                     f"{res['traces'][n]} | {res['compiles'][n]} | **{med[n] / med['a']:.3f}x** | "
                     f"{mid:.3f}x ({lo:.3f}-{hi:.3f}) |")
    return lines + [
        "",
        f"XLA's cost model of the lowered step (before optimization): (a) {ca['bytes'] / 1e6:.1f} MB accessed, "
        f"{ca['flops'] / 1e9:.3f} "
        f"GFLOP; the NNX step (f) {cn['bytes'] / 1e6:.1f} MB, {cn['flops'] / 1e9:.3f} GFLOP "
        f"({cn['bytes'] / ca['bytes']:.3f}x, {cn['flops'] / ca['flops']:.3f}x): the same program. (g) and (h) run "
        "it as well. Overflowed (skipped) steps: "
        + ", ".join(f"({n}) {'some' if res['skipped'][n] else 0}" for n in VARIANTS) + ".",
        "",
    ]


def _probe_section(args, res) -> list[str]:
    med = res["median"]
    lines = [f"## Python-side cost per step (width {args.probe_width}, seq 8, batch 1: the same variables, little "
             "compute)", ""]
    if res["probe"] is None:
        return lines + ["Not measured (`--probe-rounds 0`)."]
    lines += harness.table(["variant", "median ms/step", "extra ms/step over (a)", "extra / (a)'s reference step",
                            "implied ratio at the reference size"])
    for n, desc in VARIANTS.items():
        extra = res["probe"][n] - res["probe"]["a"]
        lines.append(f"| ({n}) {desc} | {res['probe'][n] * 1e3:.2f} | {extra * 1e3:+.2f} | "
                     f"{extra / med['a']:+.1%} | {1 + extra / med['a']:.3f}x |")
    g_extra = (res["probe"]["g"] - res["probe"]["a"]) / med["a"]
    return lines + [
        "",
        f"Goal: at most {GOAL:.2f}x (a). The direct call (g) adds {g_extra:+.1%} of (a)'s reference step in Python "
        f"({'within' if 1 + g_extra <= GOAL else 'over'} the goal); measured end to end at the reference size it "
        f"ran at {med['g'] / med['a']:.3f}x (a) by medians, {_paired(res, 'g')[0]:.3f}x by paired rounds. "
        "`nnx.jit` in graph mode (f) traverses the model's and the optimizer's graph on every call; "
        "`nnx.cached_partial` (h) caches that traversal.",
    ]


def report(args, res, argv=None) -> str:
    """The markdown report of `run`'s results."""
    return "\n".join([*_header(args, res, argv), *_reference_section(args, res), *_probe_section(args, res)]) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_timing_flags(p, rounds=60, steps=5, warmup=3, first_call_included=False)
    harness.add_model_flags(p)
    p.add_argument("--vocab", type=int, default=65, help="vocabulary size (default: %(default)s)")
    p.add_argument("--probe-width", type=int, default=16, help="width of the Python-cost probe (default: "
                   "%(default)s)")
    p.add_argument("--probe-rounds", type=int, default=20, help="interleaved rounds of the probe, 0 to skip it "
                   "(default: %(default)s)")
    p.add_argument("--probe-steps", type=int, default=20, help="steps per variant per probe round (default: "
                   "%(default)s)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="markdown file to write (default: %(default)s)")
    args = p.parse_args(argv)
    harness.check_sizes(p, args, ("steps", "rounds", "layers", "heads", "width", "seq_len", "batch_size", "vocab",
                                  "probe_width", "probe_steps"), ("warmup", "probe_rounds"))
    if args.probe_width % args.heads:
        p.error(f"--heads ({args.heads}) must divide --probe-width ({args.probe_width})")
    harness.check_output(p, "--out", args.out)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    harness.write_report(args.out, report(args, run(args), argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
