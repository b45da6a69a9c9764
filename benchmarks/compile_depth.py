"""Compile time against depth on the CPU: the LM's jitted training step with its blocks unrolled (`h_0 .. h_{L-1}`)
against one `nn.scan` over stacked blocks (`--scan-layers`), each with and without `--remat`, and the step time.

    python benchmarks/compile_depth.py                        # 48 layers, width 64, 2 heads, 4 x 64 tokens, vocab 65
    python benchmarks/compile_depth.py --tiny --out /tmp/c.md   # a test: 1 and 2 layers, width 16, 2 x 16 tokens

Each variant runs in a fresh Python process (nothing traced or compiled before it; the variants' order rotates from
round to round, `--rounds`), which builds the experiment's state and step as `jaxamp.lm.setup.build` does (the same
`TransformerConfig`, AdamW, loss scale and `train_step`, jitted with the state donated) and times, apart:

- trace: `jax.jit(step).trace(state, batch)` (Python: Flax and the step's code, once per block when unrolled),
- lower: `.lower()` (the jaxpr to StableHLO),
- compile: `.compile()` (XLA's optimisation and code generation),

then reads the compiled step's temporary memory (`memory_analysis()`) and times `--steps` steps after `--warmup`
untimed ones (median), counting any compilation while they run (there must be none: one compilation per run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks import harness  # noqa: E402

DEFAULT_OUT = harness.RESULTS / "compile_depth.md"
FULL = dict(depths=(12, 24, 48), heads=2, width=64, seq_len=64, batch_size=4, vocab=65)
TINY = dict(depths=(1, 2), heads=2, width=16, seq_len=16, batch_size=2, vocab=65)
# (label, scan_layers, remat), in the table's order; every variant runs at the deepest depth, the rest at every depth.
VARIANTS = (("unrolled", False, "none"), ("unrolled, remat full", False, "full"), ("scanned", True, "none"),
            ("scanned, remat full", True, "full"), ("scanned, remat dots", True, "dots"))
AT_EVERY_DEPTH = ("unrolled", "scanned")
MIB = 2.0**20


def measure_one(layers: int, scan: bool, remat: str, size: dict, precision: str, steps: int, warmup: int) -> dict:
    """In this process: the step's trace, lower and compile seconds, temp bytes and median step seconds."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxamp.fp8_collection import split_fp8
    from jaxamp.lm.config import TrainConfig, validate
    from jaxamp.lm.model import TransformerLM
    from jaxamp.lm.setup import (
        init_variables,
        make_loss_fn,
        make_loss_scale,
        make_optimizer,
        make_policy,
        model_config,
    )
    from jaxamp.precision import uses_fp8
    from jaxamp.state import TrainState
    from jaxamp.step import train_step

    cfg = TrainConfig(layers=layers, heads=size["heads"], width=size["width"], seq_len=size["seq_len"],
                      batch_size=size["batch_size"], precision=precision, scan_layers=scan, remat=remat,
                      steps=1000)
    validate(cfg)
    policy = make_policy(cfg.precision)
    model_cfg = model_config(cfg, size["vocab"], fp8=uses_fp8(policy))
    model = TransformerLM(model_cfg)
    variables = init_variables(model_cfg, jax.random.PRNGKey(cfg.seed))
    params = variables if model_cfg.fp8 else variables["params"]
    state = TrainState.create(params=params, tx=make_optimizer(cfg, split_fp8(params)[0]), policy=policy,
                              loss_scale=make_loss_scale(cfg), rng=jax.random.PRNGKey(1))
    loss_fn = make_loss_fn(model)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, size["vocab"], (cfg.batch_size, cfg.seq_len + 1)), jnp.int32)
    batch = (tokens[:, :-1], tokens[:, 1:])  # i32[batch, seq] each
    step = jax.jit(lambda s, b: train_step(s, b, loss_fn), donate_argnums=0)
    jax.block_until_ready(state)

    events = harness.compile_events()
    t0 = time.perf_counter()
    traced = step.trace(state, batch)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    memory = compiled.memory_analysis()
    times = []
    with events.attribute("steps"):
        for i in range(warmup + steps):
            t = time.perf_counter()
            state, metrics = step(state, batch)  # the jitted function: its cache holds the compilation above
            jax.block_until_ready((state, metrics))
            if i >= warmup:
                times.append(time.perf_counter() - t)
    return {"layers": layers, "scan": scan, "remat": remat, "trace": t1 - t0, "lower": t2 - t1, "compile": t3 - t2,
            "temp": None if memory is None else memory.temp_size_in_bytes, "step": statistics.median(times),
            "recompiles": events.count("steps", "compile"), "loss": float(metrics["loss"])}


def run_child(args, layers: int, scan: bool, remat: str) -> dict:
    """`measure_one` in a fresh process (nothing traced or compiled before it)."""
    cmd = [sys.executable, __file__, "--child", json.dumps([layers, scan, remat]), "--precision", args.precision,
           "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--tiny"] if args.tiny else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if proc.returncode != 0:
        raise SystemExit(f"error: the child for {layers} layers, scan {scan}, remat {remat} failed:\n"
                         f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def jobs(size: dict) -> list[tuple[int, bool, str]]:
    deepest = max(size["depths"])
    out = [(deepest, scan, remat) for _, scan, remat in VARIANTS]
    for layers in size["depths"]:
        if layers != deepest:
            out += [(layers, scan, remat) for label, scan, remat in VARIANTS if label in AT_EVERY_DEPTH]
    return out


def label_of(scan: bool, remat: str) -> str:
    return next(label for label, s, r in VARIANTS if (s, r) == (scan, remat))


def report(args, size: dict, results: dict) -> str:
    """The markdown: the deepest depth's variants, then compile time against depth."""
    deepest = max(size["depths"])

    def med(key, layers, scan, remat):
        return statistics.median(r[key] for r in results[(layers, scan, remat)])

    def total(layers, scan, remat):
        return statistics.median(r["trace"] + r["lower"] + r["compile"] for r in results[(layers, scan, remat)])

    base = total(deepest, False, "none")
    lines = [
        "# Compile time against depth: unrolled blocks against `--scan-layers`, with and without `--remat`, CPU",
        "",
        f"- command: `{harness.command_line(__file__, args.argv)}`",
        f"- {harness.now()}, {harness.machine(when='at the end')}",
        f"- model: width {size['width']}, {size['heads']} heads, vocab {size['vocab']}, {size['batch_size']} x "
        f"{size['seq_len']} tokens; precision {args.precision}; the experiment's training step (AdamW, loss scale, "
        "`train_step`), jitted with the state donated",
        f"- each cell: the median of {args.rounds} round(s), each variant in a fresh process; step = median of "
        f"{args.steps} steps after {args.warmup} untimed; seconds of `jit(step).trace`, `.lower()` and "
        "`.compile()` apart; recompiles = compilations while the steps ran",
        f"- {harness.SHARED_BOX}",
        "",
        f"## {deepest} layers",
        "",
        *harness.table(["variant", "trace s", "lower s", "compile s", "total s", "total / unrolled", "step ms",
                        "temp MiB", "recompiles", "first loss"]),
    ]
    for label, scan, remat in VARIANTS:
        key = (deepest, scan, remat)
        rs = results[key]
        temp = rs[0]["temp"]
        lines.append(harness.row([
            label, f"{med('trace', *key):.2f}", f"{med('lower', *key):.2f}", f"{med('compile', *key):.2f}",
            f"**{total(*key):.2f}**", f"{total(*key) / base:.2f}x", f"{1e3 * med('step', *key):.1f}",
            harness.mib(temp), max(r["recompiles"] for r in rs), f"{rs[0]['loss']:.6f}"]))
    lines += ["", "## Compile time (trace + lower + compile, s) against depth", "",
              *harness.table(["layers", *AT_EVERY_DEPTH, "unrolled / scanned", "step ms unrolled",
                              "step ms scanned"])]
    for layers in size["depths"]:
        u, s = total(layers, False, "none"), total(layers, True, "none")
        lines.append(harness.row([layers, f"{u:.2f}", f"{s:.2f}", f"{u / s:.1f}x",
                                  f"{1e3 * med('step', layers, False, 'none'):.1f}",
                                  f"{1e3 * med('step', layers, True, 'none'):.1f}"]))
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    """The flags, checked (one-line usage errors)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="1 and 2 layers, width 16, 2 x 16 tokens: a test")
    p.add_argument("--precision", default="fp32", help="--precision of the run (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="fresh processes per variant (median; default: "
                   "%(default)s)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (median; default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the compilation (default: "
                   "%(default)s)")
    default = DEFAULT_OUT.relative_to(harness.REPO)
    p.add_argument("--out", default=None, help=f"markdown file to write (default: {default}; --tiny: print only)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one variant, JSON on stdout
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    harness.check_sizes(p, args, ("rounds", "steps"), ("warmup",))
    if args.out is not None:
        harness.check_output(p, "--out", args.out)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    size = TINY if args.tiny else FULL
    if args.child is not None:
        layers, scan, remat = json.loads(args.child)
        print(json.dumps(measure_one(layers, scan, remat, size, args.precision, args.steps, args.warmup)))
        return 0
    todo = jobs(size)
    results: dict = {job: [] for job in todo}
    for r in range(args.rounds):
        for job in harness.rotated(todo, r):
            harness.log(f"round {r + 1}/{args.rounds}: {job[0]} layers, {label_of(*job[1:])}")
            results[job].append(run_child(args, *job))
    text = report(args, size, results)
    harness.write_or_print(args.out or (None if args.tiny else DEFAULT_OUT), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
