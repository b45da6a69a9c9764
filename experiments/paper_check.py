"""Why loss scaling exists, on the jaxamp LM: float16 gradient underflow without and with a loss scale.

    python experiments/paper_check.py --data ../shared/data/tinyshakespeare.txt     # reference size, 200 fp32 steps
    python experiments/paper_check.py --layers 1 --heads 2 --width 16 --seq-len 8 --batch-size 4 --train-steps 2 \
        --batches 1 --out-dir /tmp/paper_check                                       # smoke test

The check of Micikevicius et al., *Mixed Precision Training* (ICLR 2018), Figure 3: the gradients of a few batches
are computed in float32 (the reference) and with float16 compute, once without scaling and once with the loss scale
(`--loss-scale`, default 2^15, `DynamicLossScale`'s initial value; with growth every 2000 finite steps, the
reference run holds it until its last step, where it grows to 2^16). The histogram of the float32 gradient
magnitudes (log2 bins) is drawn over float16's flush-to-zero,
subnormal, normal and overflow ranges, and the share of nonzero float32 gradient elements that are exactly zero in
float16 is reported, for the activation gradients (the cotangents of every leaf layer's output: Figure 3's quantity)
and for the parameter gradients. Both at initialisation and after `--train-steps` float32 training steps (the
gradients shrink as the loss falls).

Writes `OUT_DIR/paper_check.png` and `OUT_DIR/paper_check.md` (also printed). The computation is
`jaxamp.diagnostics.gradient_underflow`.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "paper_check"
FLOAT32_MAX = 3.4028234663852886e38
FP16_LOG2 = {"subnormal": -24, "normal": -14, "overflow": 16}  # 2^-24 smallest subnormal, 2^-14 smallest normal


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="UTF-8 text file (default: the Python standard library's sources)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--train-steps", type=int, default=200,
                   help="float32 training steps before the second measurement (0: at initialisation only)")
    p.add_argument("--batches", type=int, default=4, help="validation batches whose gradients are measured")
    p.add_argument("--loss-scale", type=float, default=2.0**15, help="the loss scale of the scaled float16 pass")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.train_steps < 0 or args.batches < 1:
        p.error("--train-steps must be >= 0 and --batches >= 1")
    if not (math.isfinite(args.loss_scale) and 0 < args.loss_scale <= FLOAT32_MAX):
        p.error(f"--loss-scale must be finite, > 0 and <= float32's maximum {FLOAT32_MAX:.4g}, got {args.loss_scale}")
    from jaxamp.lm.cli import check_output  # pylint: disable=import-outside-toplevel

    check_output(p, "--out-dir", args.out_dir, directory=True)
    return args


def measure(args: argparse.Namespace) -> dict:
    """`{"config", "points": [(label, step, {"params": stats, "activations": stats}), ...], "seconds"}`."""
    import jax

    from jaxamp.diagnostics import gradient_underflow
    from jaxamp.lm.config import TrainConfig
    from jaxamp.lm.data import batch_at
    from jaxamp.lm.model import count_params
    from jaxamp.lm.setup import build, make_loss_fn

    t0 = time.perf_counter()
    cfg = TrainConfig(data=args.data, precision="fp32", layers=args.layers, heads=args.heads, width=args.width,
                      seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
                      steps=max(args.train_steps, 1), eval_batches=args.batches, sample_tokens=0)
    run = build(cfg)
    loss_fn = make_loss_fn(run.model)
    batches = list(run.val_batches)
    points = [("init", 0, gradient_underflow(loss_fn, run.state.params, batches, loss_scale=args.loss_scale))]
    if args.train_steps > 0:
        state, loss = run.state, None
        for step in range(args.train_steps):
            batch = batch_at(run.dataset.train, seed=cfg.seed, step=step, batch_size=cfg.batch_size,
                             seq_len=cfg.seq_len)
            state, metrics = run.step_fn(state, batch)
            loss = metrics["loss"]
        print(f"trained {args.train_steps} float32 steps: last training loss {float(jax.device_get(loss)):.3f}",
              flush=True)
        points.append((f"after {args.train_steps} fp32 steps", args.train_steps,
                       gradient_underflow(loss_fn, state.params, batches, loss_scale=args.loss_scale)))
    return {"config": cfg, "vocab_size": run.dataset.vocab_size, "params": count_params(run.state.params),
            "use_bias": run.model.config.use_bias, "points": points, "seconds": time.perf_counter() - t0}


def _scale_label(scale: float) -> str:
    k = math.log2(scale)
    return f"2^{int(k)}" if k == int(k) else f"{scale:g}"


def plot(result: dict, path: Path, scale: float) -> None:
    """Rows: activation / parameter gradients; columns: the measurement points. Shares of nonzero float32 values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    points = result["points"]
    kinds = [("activations", "activation gradients"), ("params", "parameter gradients")]
    fig, axes = plt.subplots(len(kinds), len(points), figsize=(6.5 * len(points), 8.0), squeeze=False)
    shift = math.log2(scale)
    for col, (label, _, stats) in enumerate(points):
        for row, (key, title) in enumerate(kinds):
            ax, s = axes[row][col], stats[key]
            bins, ref = s["log2_bins"], s["counts_reference"]
            total = max(int(ref.sum()), 1)
            used = np.nonzero(ref)[0]
            lo = int(bins[used[0]]) - 2 if used.size else -30
            hi = max(int(bins[used[-1]]) + 3 if used.size else 0, FP16_LOG2["overflow"] + 2)
            lo = min(lo, FP16_LOG2["subnormal"] - int(shift) - 2)
            ax.axvspan(lo, FP16_LOG2["subnormal"], color="tab:red", alpha=0.12, lw=0, label="fp16: becomes 0")
            ax.axvspan(FP16_LOG2["subnormal"], FP16_LOG2["normal"], color="gold", alpha=0.18, lw=0,
                       label="fp16: subnormal")
            ax.axvspan(FP16_LOG2["normal"], FP16_LOG2["overflow"], color="tab:green", alpha=0.10, lw=0,
                       label="fp16: normal range")
            ax.axvspan(FP16_LOG2["overflow"], hi, color="0.4", alpha=0.15, lw=0, label="fp16: overflow")
            pct = 100.0 / total
            edges = np.append(bins, bins[-1] + 1)  # one filled step artist per series (fast, unlike bar())
            ax.stairs(ref * pct, edges, fill=True, color="0.55", label="float32 reference (nonzero)")
            ax.stairs(s["counts_flushed_unscaled"] * pct, edges, fill=True, color="tab:red",
                      label="of which 0 in fp16, no scaling")
            ax.stairs(s["counts_flushed_scaled"] * pct, edges, fill=True, color="tab:blue",
                      label=f"of which 0 in fp16, scale {_scale_label(scale)}")
            ax.axvline(FP16_LOG2["subnormal"] - shift, color="tab:blue", ls="--", lw=1,
                       label=f"2^-24 / {_scale_label(scale)}: smallest |g| float16 holds after scaling")
            ax.text(0.98, 0.96, f"0 in fp16 (of nonzero float32):\nno scaling {_pct(s['flushed_unscaled'])}\n"
                    f"scale {_scale_label(scale)}: {_pct(s['flushed_scaled'])}", transform=ax.transAxes,
                    ha="right", va="top", fontsize=8, bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
            ax.set_xlim(lo, hi)
            ax.set_yscale("log")
            shown = [c for c in (ref, s["counts_flushed_unscaled"], s["counts_flushed_scaled"]) if c.any()]
            smallest = min(float(c[c > 0].min()) for c in shown) * pct if shown else 1e-3
            ax.set_ylim(smallest / 3, 200)
            ax.set_xlabel("log2 |gradient| (float32 reference)")
            ax.set_ylabel("% of nonzero float32 values")
            ax.set_title(f"{title}, {label}", fontsize=10)
    cfg = result["config"]
    fig.suptitle(f"float16 gradient underflow, jaxamp LM ({cfg.layers} layers, width {cfg.width}, seq {cfg.seq_len}, "
                 f"batch {cfg.batch_size})\ncf. Micikevicius et al., Mixed Precision Training, 2018, Figure 3",
                 fontsize=11)
    handles, labels = axes[0][0].get_legend_handles_labels()
    wide = len(points) > 1
    fig.legend(handles, labels, loc="lower center", ncol=4 if wide else 2, fontsize=8, frameon=False)
    fig.subplots_adjust(left=0.07 if wide else 0.13, right=0.98, top=0.89, bottom=0.16 if wide else 0.22,
                        hspace=0.35, wspace=0.2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(x: float) -> str:
    return "0" if x == 0 else f"{100 * x:.3g}%"


def table(result: dict, args: argparse.Namespace, argv: list[str]) -> str:
    import jax

    cfg, scale = result["config"], args.loss_scale
    sl = _scale_label(scale)
    lines = [
        "# float16 gradient underflow with and without loss scaling (Micikevicius et al. 2018, Figure 3)",
        "",
        f"Command: `python experiments/paper_check.py {shlex.join(argv)}`",
        f"Date: {datetime.date.today().isoformat()}; machine: {platform.machine()}, {platform.system()}, "
        f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind}); "
        f"{result['seconds']:.0f} s.",
        f"Model: {cfg.layers} layers, {cfg.heads} heads, width {cfg.width}, seq {cfg.seq_len}, vocab "
        f"{result['vocab_size']}, {'with' if result['use_bias'] else 'no'} biases, {result['params']:,} parameters; "
        f"data `{cfg.data or 'Python stdlib sources'}`; gradients of {args.batches} "
        f"validation batches of {cfg.batch_size} sequences (mean cross-entropy). Loss scale of the scaled pass: "
        f"{sl}.",
        "",
        f"| state | gradients | elements | nonzero in float32 | float32 \\|g\\| <= 2^-25 (rounds to 0) | "
        f"0 in fp16, no scaling | 0 in fp16, scale {sl} | non-finite, scale {sl} | max \\|g\\| (float32) | "
        f"largest safe scale |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, _, stats in result["points"]:
        for key, name in (("activations", "activations"), ("params", "parameters")):
            s = stats[key]
            safe = "n/a" if s["max_safe_log2_scale"] is None else f"2^{s['max_safe_log2_scale']}"
            lines.append(
                f"| {label} | {name} | {s['size']:,} | {s['nonzero_reference']:,} | "
                f"{_pct(s['predicted_flush_unscaled'])} | **{_pct(s['flushed_unscaled'])}** | "
                f"**{_pct(s['flushed_scaled'])}** | {_pct(s['nonfinite_scaled'])} | {s['max_abs_reference']:.3g} | "
                f"{safe} |")
    lines += [
        "",
        "Fractions of 'nonzero in float32' elements, except non-finite (of all elements). 'Largest safe scale': the "
        "largest power of two that keeps the largest float32 gradient below 65504. Activation gradients are the "
        "float16 cotangents of every leaf layer's output (Embed, LayerNorm, Dense); parameter gradients are those "
        "of the float32 master weights (float16 cotangents cast to float32, as in `train_step`).",
        "",
        "Layers that lose the most without scaling (share of their nonzero float32 elements):",
        "",
    ]
    label, _, stats = result["points"][-1]
    for key in ("activations", "params"):
        worst = sorted(stats[key]["per_leaf"], key=lambda r: -r["flushed_unscaled"])[:5]
        worst = [r for r in worst if r["flushed_unscaled"] > 0]
        items = ", ".join(f"`{r['name']}` {_pct(r['flushed_unscaled'])} (scaled: {_pct(r['flushed_scaled'])})"
                          for r in worst) or "none"
        lines.append(f"- {key} ({label}): {items}")
    lines += ["", "![histograms](paper_check.png)", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from jaxamp.lm.config import ConfigError
    from jaxamp.lm.data import DataError

    try:
        result = measure(args)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(result, args.out_dir / "paper_check.png", args.loss_scale)
    text = table(result, args, argv)
    (args.out_dir / "paper_check.md").write_text(text)
    print(text)
    print(f"wrote {args.out_dir / 'paper_check.png'} and {args.out_dir / 'paper_check.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
