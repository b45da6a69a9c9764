"""Gradient fidelity of the LM in bf16 and fp16 against float32, before and after the float32-accumulation fix.

    python benchmarks/fidelity.py                       # 4 layers, width 128, seq 64, batch 64 (4,096 tokens)
    python benchmarks/fidelity.py --tiny --out /tmp/f.md   # 2 layers, width 32 (a test)

For each precision, batch and model variant, one gradient of the same batch, params and rng is computed twice
(`jaxamp.fidelity.gradient_pair`): as `train_step` computes it, and under float32 with no loss scale. Reported: each
leaf's relative L2 error (median over the Dense kernels, and the worst leaf), and the relative error of the
embedding row of the batch's most frequent token.

- before: the LM as it was up to commit 681b235, emulated by swapping `jaxamp.layers`' pieces for plain autodiff:
  lookups into the table cast to the compute dtype (a half-precision scatter-add, like `nn.Embed(dtype=bf16)`),
  bias and position additions whose gradients sum in the compute dtype, and the tied head's backward by autodiff;
  policy without the per-leaf rule.
- after: the LM as it is, under `get_policy(p, keep_float32=LM_KEEP_FLOAT32)` (what the experiment uses).

Batches: `characters`, a training batch of the corpus; `skewed`, the same batch with 80% of its input positions
replaced by the space character, so one row of the embedding is looked up ~3,300 times.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxamp.layers  # noqa: E402
import jaxamp.lm.model  # noqa: E402
from benchmarks import harness  # noqa: E402
from jaxamp import DynamicLossScale, NoOpLossScale, TrainState, get_policy  # noqa: E402
from jaxamp.fidelity import gradient_pair  # noqa: E402
from jaxamp.lm.data import CharDataset, batch_at, load_text  # noqa: E402
from jaxamp.lm.model import LM_KEEP_FLOAT32, TransformerConfig, TransformerLM, cross_entropy_loss  # noqa: E402
from jaxamp.precision import leaf_path  # noqa: E402

SHAKESPEARE = harness.SHAKESPEARE
DEFAULT_OUT = harness.RESULTS / "fidelity.md"
FULL = dict(layers=4, heads=4, width=128, seq_len=64, batch_size=64)  # nanoGPT's CPU recipe, 4,096 tokens
TINY = dict(layers=1, heads=2, width=32, seq_len=32, batch_size=128)  # 4,096 tokens: sums long enough to show


def _naive_lookup(table, ids, dtype=None):
    ids = jnp.where(ids < 0, table.shape[0], ids)
    return jnp.take(table, ids, axis=0, mode="fill").astype(dtype or table.dtype)  # autodiff: scatter in table dtype


def _naive_attend(x, table):
    return jnp.einsum("...d,vd->...v", x, table.astype(x.dtype), preferred_element_type=jnp.float32)


def _naive_add(y, bias):
    return y + bias.astype(y.dtype)


@contextlib.contextmanager
def before_fix():
    """The LM's pieces as plain autodiff (the code before the fix); restored on exit."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(jaxamp.layers, "embed_lookup", _naive_lookup))
        stack.enter_context(mock.patch.object(jaxamp.layers, "attend", _naive_attend))
        stack.enter_context(mock.patch.object(jaxamp.layers, "add_bias", _naive_add))
        stack.enter_context(mock.patch.object(jaxamp.lm.model, "add_bias", _naive_add))
        yield


def measure(model, params, batch, precision: str, fixed: bool) -> dict:
    """Per-leaf errors and the most frequent token's embedding-row error for one configuration."""
    policy = get_policy(precision, keep_float32=LM_KEEP_FLOAT32 if fixed else ())
    scale = DynamicLossScale(2.0**15) if precision == "fp16" else NoOpLossScale()
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy=policy, loss_scale=scale,
                              rng=jax.random.key(0))

    def loss_fn(p, b, rng):
        del rng
        return cross_entropy_loss(model.apply({"params": p}, b[0]), b[1])

    with contextlib.nullcontext() if fixed else before_fix():
        mixed, exact = jax.jit(gradient_pair, static_argnums=2)(state, batch, loss_fn)
    errors = {}
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(mixed)[0], jax.tree.leaves(exact)):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        errors[leaf_path(path)] = float(np.linalg.norm(g - r) / np.linalg.norm(r))
    top = int(np.bincount(np.asarray(batch[0]).reshape(-1)).argmax())
    g_row, r_row = (np.asarray(t["wte"]["embedding"][top], np.float64) for t in (mixed, exact))
    worst = max(errors, key=errors.get)
    return {"kernel_median": float(np.median([v for k, v in errors.items() if k.endswith("kernel")])),
            "worst": worst, "worst_err": errors[worst], "row_err": float(np.linalg.norm(g_row - r_row)
                                                                          / np.linalg.norm(r_row)),
            "top_share": float(np.mean(np.asarray(batch[0]) == top))}


def batches(ds: CharDataset, size: dict) -> dict:
    """The `characters` training batch and its `skewed` copy (80% of the inputs the space character)."""
    inputs, targets = batch_at(ds.train, seed=0, step=0, batch_size=size["batch_size"], seq_len=size["seq_len"])
    space = int(ds.tokenizer.encode(" ")[0])
    skewed = np.where(np.random.default_rng(0).random(inputs.shape) < 0.8, space, inputs).astype(np.int32)
    return {"characters": (inputs, targets), "skewed": (skewed, targets)}


def report(rows: list[dict], size: dict, corpus: str, argv) -> str:
    """The markdown table: one row per precision, batch and variant."""
    pct = lambda x: f"{100 * x:.2f}%"  # noqa: E731
    lines = [
        "# Gradient fidelity: bf16 and fp16 against float32, before and after the fix",
        "",
        f"- command: `{harness.command_line(__file__, argv)}`",
        f"- date: {harness.now()}; machine: {harness.machine()}",
        f"- model: {size['layers']} layers, {size['heads']} heads, width {size['width']}, biases on; batch "
        f"{size['batch_size']} x {size['seq_len']} tokens of {corpus}; init seed 0",
        "- error = ||g - g_f32|| / ||g_f32|| per leaf; `row` = the embedding row of the batch's most frequent token",
        "",
        *harness.table(["precision", "batch", "top token share", "variant", "kernel median", "worst leaf", "worst",
                        "row"]),
    ]
    for r in rows:
        lines.append(f"| {r['precision']} | {r['batch']} | {pct(r['top_share'])} | {r['variant']} | "
                     f"{pct(r['kernel_median'])} | {r['worst']} | {pct(r['worst_err'])} | {pct(r['row_err'])} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked (one-line usage errors)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a small model (the test suite's run)")
    p.add_argument("--data", default=None, help="text corpus (default: tinyshakespeare if at ../shared, else the "
                   "Python standard library's sources)")
    p.add_argument("--precisions", nargs="+", choices=["bf16", "fp16"], default=["bf16", "fp16"])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="markdown table")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    harness.check_file(p, "--data", args.data)
    harness.check_output(p, "--out", args.out)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    size = TINY if args.tiny else FULL
    data = args.data or (str(SHAKESPEARE) if SHAKESPEARE.exists() else None)
    ds = CharDataset.from_text(load_text(data), size["seq_len"])
    cfg = TransformerConfig(vocab_size=ds.tokenizer.vocab_size, seq_len=size["seq_len"], num_layers=size["layers"],
                            num_heads=size["heads"], width=size["width"])
    model = TransformerLM(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
    rows = []
    for precision in args.precisions:
        for batch_name, batch in batches(ds, size).items():
            for variant, fixed in (("before", False), ("after", True)):
                r = measure(model, params, batch, precision, fixed)
                rows.append({**r, "precision": precision, "batch": batch_name, "variant": variant})
    corpus = Path(data).name if data else "the default corpus (stdlib sources)"
    harness.write_report(args.out, report(rows, size, corpus, args.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
