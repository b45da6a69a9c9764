"""Autocast's cost on the CPU: a plain Flax GPT written in float32, trained under `get_policy(precision,
autocast=True)`, against jaxamp's hand-built LM of the same shape under the cast policy of the same precision.

    python benchmarks/autocast_speed.py                       # nanoGPT's CPU recipe: 4 layers, width 128, 12 x 64
    python benchmarks/autocast_speed.py --tiny --out /tmp/a.md   # a test: 1 layer, width 32, 4 x 16 tokens

A is `benchmarks/plain_gpt.py`'s `PlainGPT` (stock `nn.Dense`, `nn.LayerNorm`, `nn.Embed`, einsum attention with a
float32 softmax, no dtype anywhere) with optax's float32 cross-entropy, under `"bf16;autocast"`: `train_step` hands
it the float32 master weights and runs it under `jaxamp.autocast`. B is `jaxamp.lm.model.TransformerLM` (its
float32 islands written by hand, embedding tables kept float32) under the LM's cast policy `make_policy("bf16")`.
Both start from the same weights (the two models have the same parameter tree) and train with the same AdamW,
jitted with the state donated. Reported: each step's median time over interleaved windows (the ratio of medians
and the paired ratios), the first call (trace + compile), XLA's cost analysis of the compiled step (bytes accessed,
FLOPs) and its memory analysis (temporary bytes), and the precision audit of both.

XLA:CPU computes half-precision dots in float32 internally, so CPU times say nothing about a GPU's speed-up; what
they do show is the cost of the program autocast builds (its casts, its float32 sums and activations between the
matmuls) against the hand-written one. The float32 activations that keep the sums exact cost memory and bandwidth
on a GPU: the temporary bytes say how much.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.plain_gpt import PlainGPT  # noqa: E402
from jaxamp import NoOpLossScale, TrainState, precision_audit, train_step  # noqa: E402
from jaxamp.lm.model import TransformerConfig, TransformerLM  # noqa: E402
from jaxamp.lm.setup import make_policy  # noqa: E402

DEFAULT_OUT = harness.RESULTS / "autocast_speed.md"
FULL = dict(layers=4, heads=4, width=128, seq_len=64, batch_size=12, vocab=65)
TINY = dict(layers=1, heads=2, width=32, seq_len=16, batch_size=4, vocab=65)


def _config(size: dict) -> TransformerConfig:
    return TransformerConfig(vocab_size=size["vocab"], seq_len=size["seq_len"], num_layers=size["layers"],
                             num_heads=size["heads"], width=size["width"])


def _plain_loss(model):
    def loss_fn(params, batch, rng):
        del rng
        inputs, targets = batch  # i32[batch, seq] each
        logits = model.apply({"params": params}, inputs)  # f32[batch, seq, vocab] in float32 code
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss_fn


def _lm_loss(model):
    def loss_fn(params, batch, rng):
        del rng
        inputs, targets = batch
        return model.apply({"params": params}, inputs, targets)  # the LM's own fused float32 loss

    return loss_fn


def build(size: dict, precision: str) -> dict:
    """name -> (jitted step, state, loss_fn) of the two sides, same weights."""
    cfg = _config(size)
    lm, plain = TransformerLM(cfg), PlainGPT(cfg)
    params = lm.init(jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]  # f32 master weights
    tx = optax.adamw(1e-3, weight_decay=0.1)
    sides = {
        "autocast": (f"{precision};autocast", _plain_loss(plain)),
        "hand-built": (make_policy(precision), _lm_loss(lm)),
    }
    out = {}
    for name, (policy, loss_fn) in sides.items():
        state = TrainState.create(params=harness.copy_tree(params), tx=tx, policy=policy, loss_scale=NoOpLossScale(),
                                  rng=jax.random.key(1))
        step = jax.jit(lambda s, b, f=loss_fn: train_step(s, b, f), donate_argnums=0)
        out[name] = (step, state, loss_fn)
    return out


def batches(size: dict, n: int) -> list:
    key = jax.random.key(2)
    out = []
    for i in range(n):
        tokens = jax.random.randint(jax.random.fold_in(key, i), (size["batch_size"], size["seq_len"] + 1), 0,
                                    size["vocab"])
        out.append((tokens[:, :-1], tokens[:, 1:]))  # i32[batch, seq] inputs and targets
    return out


def analyse(step, state, batch) -> dict:
    """XLA's cost and memory analysis of the compiled step, and the first call (trace + compile) in seconds."""
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    first = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    memory = compiled.memory_analysis()
    return {"compile_s": first, "bytes": float(cost.get("bytes accessed", 0.0)), "flops": float(cost.get("flops", 0.0)),
            "temp": int(getattr(memory, "temp_size_in_bytes", 0)),
            "args": int(getattr(memory, "argument_size_in_bytes", 0))}


def measure(size: dict, precision: str, rounds: int, steps: int, warmup: int) -> dict:
    sides = build(size, precision)
    data = batches(size, warmup + rounds * steps)
    info = {name: analyse(step, state, data[0]) for name, (step, state, _) in sides.items()}
    audits = {name: precision_audit(state, data[0], loss_fn) for name, (_, state, loss_fn) in sides.items()}
    states = {name: state for name, (_, state, _) in sides.items()}
    losses = {name: [] for name in sides}

    def window(name):
        def run(idx):
            step = sides[name][0]
            for i in idx:
                states[name], metrics = step(states[name], data[i])
            losses[name].append(float(jax.block_until_ready(metrics["loss"])))
        return run

    first, per_round = harness.interleaved({n: window(n) for n in sides}, rounds=rounds, steps=steps, warmup=warmup)
    return {"info": info, "audits": audits, "first": first, "per_round": per_round, "losses": losses,
            "steps": steps}


def report(result: dict, size: dict, precision: str, argv) -> str:
    a, b = result["per_round"]["autocast"], result["per_round"]["hand-built"]
    ia, ib = result["info"]["autocast"], result["info"]["hand-built"]
    ms = lambda xs: 1e3 * statistics.median(xs) / result["steps"]  # noqa: E731
    rows = [
        ["step time (median, ms)", f"{ms(a):.2f}", f"{ms(b):.2f}", harness.ratio_cells(a, b)],
        ["trace + compile (s)", f"{ia['compile_s']:.2f}", f"{ib['compile_s']:.2f}",
         f"**{ia['compile_s'] / ib['compile_s']:.3f}x** | "],
        ["XLA bytes accessed (MB)", f"{ia['bytes'] / 1e6:.1f}", f"{ib['bytes'] / 1e6:.1f}",
         f"**{ia['bytes'] / ib['bytes']:.3f}x** | "],
        ["XLA FLOPs (G)", f"{ia['flops'] / 1e9:.3f}", f"{ib['flops'] / 1e9:.3f}",
         f"**{ia['flops'] / ib['flops']:.3f}x** | "],
        ["temporary memory (MiB)", harness.mib(ia["temp"], 2), harness.mib(ib["temp"], 2),
         f"**{ia['temp'] / max(ib['temp'], 1):.3f}x** | "],
        ["matmul FLOPs in half precision (audit)", f"{100 * result['audits']['autocast'].half_fraction:.1f}%",
         f"{100 * result['audits']['hand-built'].half_fraction:.1f}%", " | "],
        ["last loss", f"{result['losses']['autocast'][-1]:.4f}", f"{result['losses']['hand-built'][-1]:.4f}", " | "],
    ]
    lines = [
        f"# Autocast on the CPU: a plain float32 Flax GPT under `{precision};autocast` vs jaxamp's hand-built LM "
        f"under `{precision}`",
        "",
        f"- command: `{harness.command_line(__file__, argv)}`",
        f"- machine: {harness.machine()}; {harness.SHARED_BOX}",
        f"- date: {harness.now()}",
        f"- model: {size['layers']} layers, {size['heads']} heads, width {size['width']}, {size['batch_size']} x "
        f"{size['seq_len']} tokens per step, vocab {size['vocab']}; AdamW; state donated",
        f"- timing: {len(a)} interleaved rounds of {result['steps']} steps after warm-up",
        "",
        *harness.table(["", "A: plain Flax + autocast", "B: hand-built LM", "A/B (ratio of medians)", "paired"],
                       rows, "lrrrr"),
        "",
        f"- A: {result['audits']['autocast'].summary()}",
        f"- B: {result['audits']['hand-built'].summary()}",
        "- Goals (the autocast issue): step time A/B <= 1.15 by the ratio of medians, compile time A/B <= 1.5.",
    ]
    if jax.default_backend() == "cpu":
        lines.append("- XLA:CPU upcasts bfloat16/float16 dots to float32 inside, so the CPU times show the program's "
                     "overhead, not a GPU's speed-up.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--tiny", action="store_true", help="a test-sized run")
    harness.add_timing_flags(parser, rounds=8, steps=10, warmup=3)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    harness.uncached_compiles()  # its trace + compile seconds are compiles, never cache reads
    harness.check_output(parser, "--out", args.out)
    size = TINY if args.tiny else FULL
    result = measure(size, args.precision, args.rounds, args.steps, args.warmup)
    harness.write_report(args.out, report(result, size, args.precision, argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
