"""The fused, chunked head + cross-entropy (`TransformerConfig.loss_chunk`) against whole float32 logits, on the CPU:
the compiled step's temporary memory, its time, and how far its loss and gradients are from the whole-logits path.

    python benchmarks/fused_loss.py                    # 2 layers, width 256, GPT-2's vocab 50304, 8 x 256 tokens
    python benchmarks/fused_loss.py --tiny --out /tmp/fused.md   # a test: vocab 2048, width 32, 4 x 64 tokens

Each row compiles `jax.value_and_grad` of the LM's mean loss (`TransformerLM(tokens, targets)`) over the bf16
compute copy of the same float32 weights (`jaxamp.lm.setup.make_policy("bf16")`: the embedding tables stay float32),
reads `memory_analysis()` of the compiled function, then times `--steps` calls after one warm-up (median). Gradient
errors are relative L2 norms per parameter leaf, `|g - r| / |r|`, worst leaf shown (the measure of
`jaxamp.fidelity.grad_fidelity`): against the `loss_chunk=0` row of the same bf16 copy, and against float32 (the
float32 weights, whole logits), where bf16 kernels sit near 0.4%. On a GPU the point is memory
traffic (about 15 ms of a GPT-2-124M bf16 step on an H200, `benchmarks/results/gpu_analysis.md`), which a CPU does
not show: `benchmarks/gpu_throughput.py`'s bf16-fused row measures that.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import harness  # noqa: E402
from jaxamp.lm.model import TransformerConfig, TransformerLM  # noqa: E402
from jaxamp.lm.setup import make_policy  # noqa: E402

REPO = harness.REPO
DEFAULT_OUT = harness.RESULTS / "fused_loss.md"
FULL = dict(layers=2, heads=4, width=256, vocab=50304, seq_len=256, batch_size=8, chunks=(0, 256, 1024, 2048))
TINY = dict(layers=1, heads=2, width=32, vocab=2048, seq_len=64, batch_size=4, chunks=(0, 64, 256))
MIB = 2.0**20


def _model(size: dict, chunk: int) -> TransformerLM:
    return TransformerLM(TransformerConfig(vocab_size=size["vocab"], seq_len=size["seq_len"], num_layers=size["layers"],
                                           num_heads=size["heads"], width=size["width"], loss_chunk=chunk))


def measure(size: dict, steps: int) -> list[dict]:
    """One dict per chunk size: temp bytes, median seconds, loss and gradients (as host arrays)."""
    tokens = jax.random.randint(jax.random.key(1), (size["batch_size"], size["seq_len"] + 1), 0, size["vocab"])
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # i32[batch, seq] each
    params = _model(size, 0).init(jax.random.key(0), inputs)["params"]  # float32 master weights
    params_c = make_policy("bf16").cast_to_compute(params)  # bf16 compute copy, tables float32
    model32 = _model(size, 0)
    grads32 = jax.jit(jax.grad(lambda p: model32.apply({"params": p}, inputs, targets)))(params)
    rows = [{"fp32": jax.tree.map(np.asarray, grads32)}]
    for chunk in size["chunks"]:
        model = _model(size, chunk)
        fn = jax.jit(jax.value_and_grad(lambda p, m=model: m.apply({"params": p}, inputs, targets)))
        compiled = fn.lower(params_c).compile()
        memory = compiled.memory_analysis()
        loss, grads = jax.block_until_ready(compiled(params_c))  # warm-up
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(params_c))
            times.append(time.perf_counter() - t0)
        rows.append({"chunk": chunk, "temp": memory.temp_size_in_bytes if memory else None,
                     "seconds": statistics.median(times), "loss": float(loss),
                     "grads": jax.tree.map(lambda g: np.asarray(g, np.float32), grads)})
    return rows  # [float32 reference, one row per chunk size]


def worst_leaf(grads, reference) -> str:
    """The largest relative L2 error `|g - r| / |r|` over the leaves, and that leaf's path, as a table cell."""
    worst = ("", 0.0)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(reference)):
        rel = float(np.linalg.norm(g - r) / max(float(np.linalg.norm(r)), 1e-30))
        worst = max(worst, (jax.tree_util.keystr(path), rel), key=lambda w: w[1])
    return f"{100 * worst[1]:.3f}% ({worst[0]})" if worst[0] else "0 (the reference)"


def report(args, size: dict, rows: list[dict]) -> str:
    """The markdown table: one row per chunk size."""
    grads32, rows = rows[0]["fp32"], rows[1:]
    ref = rows[0]
    n_tokens = size["batch_size"] * size["seq_len"]
    logits_mib = n_tokens * size["vocab"] * 4 / MIB
    lines = [
        "# Fused head + cross-entropy (`loss_chunk`) against whole float32 logits, CPU",
        "",
        f"- command: `{harness.command_line(__file__, args.argv)}`",
        f"- {harness.now()}, {harness.machine(when='at the end')}",
        f"- model: {size['layers']} layers, {size['heads']} heads, width {size['width']}, vocab {size['vocab']}; "
        f"{size['batch_size']} x {size['seq_len']} = {n_tokens:,} tokens; bf16 compute (tables float32); the whole "
        f"f32[{n_tokens}, {size['vocab']}] logits are {logits_mib:,.1f} MiB",
        f"- value_and_grad of the mean loss, compiled once per row; time = median of {args.steps} calls",
        "",
        *harness.table(["loss_chunk (tokens)", "temp MiB", "temp / whole", "seconds per call", "loss",
                        "loss difference", "gradient: worst leaf's error against whole logits",
                        "gradient: worst leaf's error against float32"]),
    ]
    for r in rows:
        ratio = "n/a" if r["temp"] is None or not ref["temp"] else f"{r['temp'] / ref['temp']:.2f}x"
        temp = "n/a" if r["temp"] is None else f"{r['temp'] / MIB:,.1f}"
        label = "0 (whole logits)" if r["chunk"] == 0 else f"{r['chunk']:,}"
        lines.append(f"| {label} | {temp} | {ratio} | {r['seconds']:.3f} | {r['loss']:.6f} | "
                     f"{abs(r['loss'] - ref['loss']):.1e} | {worst_leaf(r['grads'], ref['grads'])} | "
                     f"{worst_leaf(r['grads'], grads32)} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    """The flags, checked (one-line usage errors)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="vocab 2048, width 32, 4 x 64 tokens: a test")
    p.add_argument("--steps", type=int, default=3, help="timed calls per row (median)")
    p.add_argument("--out", default=None, help=f"markdown file to write (default: {DEFAULT_OUT.relative_to(REPO)}; "
                                                "--tiny: print only)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.steps <= 0:
        p.error(f"--steps must be > 0, got {args.steps}")
    if args.out is not None:
        harness.check_output(p, "--out", args.out)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    harness.uncached_compiles()  # its trace + compile seconds are compiles, never cache reads
    size = TINY if args.tiny else FULL
    text = report(args, size, measure(size, args.steps))
    harness.write_or_print(args.out or (None if args.tiny else DEFAULT_OUT), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
