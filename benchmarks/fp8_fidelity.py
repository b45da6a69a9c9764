"""Gradient fidelity of each FP8 recipe against float32, per layer kind, on the LM of the reference runs.

    python benchmarks/fp8_fidelity.py                                # 4 layers, width 128, 300 warm-up steps
    python benchmarks/fp8_fidelity.py --tiny --out /tmp/f.md         # 1 layer, width 64, 5 warm-up steps (a test)

The LM of nanoGPT's shakespeare_char CPU recipe (`reference_recipes.sh`: 4 layers, 4 heads, width 128, no biases)
is trained in float32 for `--warmup` steps (the recipe's batch of 12 x 64 tokens, its optimizer), so the gradients
are those of a model that learns, not of one at init. At those weights (and at init, for contrast), each precision's
gradient of the same batches is compared with the float32 one (`jaxamp.fidelity.fidelity_report`: the reference runs
every op in float32, the FP8 ops bypassed): `bf16` (the LM's cast policy, the yardstick), `bf16;autocast`, `fp8`
(Flax's delayed scaling, its amax histories filled by `--history-steps` steps at the same weights first),
`fp8-current`, `fp8-block` and `mxfp8` (stateless, under autocast; the tied head and the attention's batched
matmuls stay bf16).

Per layer kind (the LM's leaves grouped: the token embedding, which is also the tied head, the position embedding,
the attention's qkv and output projections, the MLP's two kernels, the LayerNorm scales; biases in a model with
them), two figures:

- `rel`: the median over the kind's leaves of `||g - g_f32|| / ||g_f32||` (each leaf against its own norm);
- `share`: `||g_kind - g_f32,kind|| / ||g_f32||`, the kind's part of the error relative to the whole gradient's norm
  (the kinds' shares add in quadrature to the `global` column).

Each figure is the mean over `--batches` batches of 64 x 64 tokens (4,096 tokens, as benchmarks/fidelity.py).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import harness  # noqa: E402
from jaxamp.fidelity import fidelity_report  # noqa: E402
from jaxamp.lm.config import TrainConfig  # noqa: E402
from jaxamp.lm.data import batch_at  # noqa: E402
from jaxamp.lm.setup import build, make_loss_fn, train_batch  # noqa: E402

DEFAULT_OUT = harness.RESULTS / "fp8_fidelity.md"
PRECISIONS = ("bf16", "bf16;autocast", "fp8", "fp8-current", "fp8-current-pow2", "fp8-block", "mxfp8")
FULL = dict(layers=4, heads=4, width=128, seq_len=64, batch_size=12)  # the reference runs' model and batch
TINY = dict(layers=1, heads=2, width=64, seq_len=32, batch_size=8)  # mxfp8 needs multiples of 32
MEASURE_ROWS = 64  # sequences per measured batch (64 x 64 = 4,096 tokens at full size)
# Layer kinds: (name, regular expression over the leaf path without the FP8 variables' "params/" prefix).
KINDS = (("token embedding + head", r"^wte/"), ("position embedding", r"^wpe/"), ("attn qkv", r"attn/c_attn/kernel"),
         ("attn out", r"attn/c_proj/kernel"), ("mlp in", r"mlp/c_fc/kernel"), ("mlp out", r"mlp/c_proj/kernel"),
         ("LayerNorm scales", r"ln_\w+/scale"), ("biases", r"/bias$"))


def kind_of(path: str) -> str:
    """The layer kind of a leaf path (`"h_0/mlp/c_fc/kernel"` -> `"mlp in"`); "other" where none matches."""
    return next((name for name, pattern in KINDS if re.search(pattern, path)), "other")


def config(size: dict, precision: str, data: str | None, workdir: str, steps: int) -> TrainConfig:
    return TrainConfig(data=data, precision=precision, layers=size["layers"], heads=size["heads"],
                       width=size["width"], seq_len=size["seq_len"], batch_size=size["batch_size"], lr=1e-3,
                       dropout=0.0, steps=max(steps, 2), workdir=workdir, progress=False, sample_tokens=0)


def trained_params(size: dict, data: str | None, workdir: str, steps: int):
    """The float32 params at init and after `steps` float32 steps of the recipe: `(init, trained)`."""
    run = build(config(size, "fp32", data, workdir, steps))
    init = jax.tree.map(np.asarray, run.state.params)
    state = run.state
    for step in range(steps):
        state, _ = run.step_fn(state, train_batch(run, step))
    return init, jax.tree.map(np.asarray, state.params)


def at_params(run, params, history_steps: int):
    """`run`'s state with `params` as its weights; for delayed FP8, after `history_steps` steps at those weights
    have filled the amax histories (the weights set back after them)."""
    if "params" not in run.state.params:  # no FP8 collection
        return run.state.replace(params=params)
    state = harness.copy_tree(run.state)  # (the step donates its input: run.state stays for the next weights)
    state = state.replace(params={**state.params, "params": params})
    for step in range(history_steps):
        state, _ = run.step_fn(state, train_batch(run, step))
        state = state.replace(params={**state.params, "params": params})
    return state


def measure(state, loss_fn, batches) -> dict:
    """Per kind: the mean over `batches` of the median leaf `rel` and of the kind's `share`; and the `global`."""
    fn = jax.jit(lambda s, b: fidelity_report(s, b, loss_fn))
    rel, share, total = {}, {}, []
    for batch in batches:
        report = jax.device_get(fn(state, batch))
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for path, err in report["rel_err"].items():
            key = path.removeprefix("params/")
            by_kind.setdefault(kind_of(key), []).append((float(err), float(report["global_rel_err"][path])))
        for kind, pairs in by_kind.items():
            rel.setdefault(kind, []).append(float(np.median([r for r, _ in pairs])))
            share.setdefault(kind, []).append(float(np.sqrt(sum(g * g for _, g in pairs))))
        total.append(float(np.sqrt(sum(float(g) ** 2 for g in report["global_rel_err"].values()))))
    mean = lambda d: {k: float(np.mean(v)) for k, v in d.items()}  # noqa: E731
    return {"rel": mean(rel), "share": mean(share), "global": float(np.mean(total))}


def rows_for(size, data, workdir, warmup, history_steps, num_batches, precisions) -> list[dict]:
    """One row per weights (init, trained) and precision."""
    init, trained = trained_params(size, data, workdir, warmup)
    rows = []
    for precision in precisions:
        run = build(config(size, precision, data, workdir, warmup))
        batches = [batch_at(run.dataset.train, seed=7, step=i, batch_size=MEASURE_ROWS, seq_len=size["seq_len"])
                   for i in range(num_batches)]
        loss_fn = make_loss_fn(run.model)
        for weights, params in (("init", init), (f"after {warmup} steps", trained)):
            harness.log(f"{precision}: {weights}")
            rows.append({"precision": precision, "weights": weights,
                         **measure(at_params(run, params, history_steps), loss_fn, batches)})
    return rows


def report(rows: list[dict], size: dict, args, corpus: str) -> str:
    pct = lambda x: f"{100 * x:.2f}%"  # noqa: E731
    kinds = [name for name, _ in KINDS if any(name in r["rel"] for r in rows)]  # (biases: only in a model with them)
    lines = [
        "# Gradient fidelity per FP8 recipe and layer kind, against float32",
        "",
        f"- command: `{harness.command_line(__file__, args.argv)}`",
        f"- date: {harness.now()}; machine: {harness.machine()}",
        f"- model: {size['layers']} layers, {size['heads']} heads, width {size['width']}, seq {size['seq_len']}, "
        f"no biases; trained in float32 for {args.warmup} steps of {size['batch_size']} x {size['seq_len']} tokens "
        f"of {corpus}; measured on {args.batches} batches of {MEASURE_ROWS} x {size['seq_len']} tokens (means over "
        "them); delayed fp8's histories filled by "
        f"{args.history_steps} steps at the same weights",
        "- `rel`: median over the kind's leaves of ||g - g_f32|| / ||g_f32||; `share`: the kind's error over the "
        "whole float32 gradient's norm; `global`: ||g - g_f32|| / ||g_f32|| over every leaf",
        "",
    ]
    for measure_name, title in (("rel", "rel (each leaf against its own norm)"),
                                ("share", "share (against the whole gradient's norm)")):
        lines += [f"## {title}", "", *harness.table(["precision", "weights", *kinds, "global"])]
        for r in rows:
            lines.append(harness.row([r["precision"], r["weights"], *(pct(r[measure_name].get(k, float("nan")))
                                                                       for k in kinds), pct(r["global"])]))
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a small model and few steps (the test suite's run)")
    p.add_argument("--data", default=None, help="text corpus (default: tinyshakespeare if at ../shared, else the "
                   "Python standard library's sources)")
    p.add_argument("--warmup", type=int, default=None, help="float32 steps before the measurement (default 300; "
                   "--tiny: 5)")
    p.add_argument("--history-steps", type=int, default=None, help="steps that fill delayed fp8's amax histories "
                   "(default 16; --tiny: 2)")
    p.add_argument("--batches", type=int, default=None, help="measured batches (default 4; --tiny: 1)")
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    p.add_argument("--out", default=str(DEFAULT_OUT), help="markdown table")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for name, full, tiny in (("warmup", 300, 5), ("history_steps", 16, 2), ("batches", 4, 1)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    harness.check_sizes(p, args, ("history_steps", "batches"), nonnegative=("warmup",))
    harness.check_file(p, "--data", args.data)
    harness.check_output(p, "--out", args.out)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    size = TINY if args.tiny else FULL
    data = args.data or (str(harness.SHAKESPEARE) if harness.SHAKESPEARE.exists() else None)
    with tempfile.TemporaryDirectory() as workdir:
        rows = rows_for(size, data, workdir, args.warmup, args.history_steps, args.batches, args.precisions)
    corpus = Path(data).name if data else "the default corpus (stdlib sources)"
    harness.write_report(args.out, report(rows, size, args, corpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
