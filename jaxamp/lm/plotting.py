"""Training curves of one or more runs in one PNG (matplotlib, Agg backend; no display needed).

A run is a workdir holding `metrics.jsonl` (one JSON record per step: `step`, `loss`, `loss_scale`, `grads_finite`,
`grad_norm`, `lr`, `tokens_per_s`, `skipped_steps`, and `val_loss` on eval steps) and optionally `summary.json`
(its `precision` labels the run). `experiments/plot.py` is the command-line front end.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from jaxamp.lm.metrics_log import read_metrics


class PlotError(ValueError):
    """A run directory cannot be plotted (missing, or no metrics); the message names the directory."""


def _summary(run_dir: Path) -> dict:
    """The run's `summary.json`, or {} when it is missing or unreadable."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _label(run_dir: Path) -> str:
    """The run's precision from `summary.json`, else the directory name."""
    precision = _summary(run_dir).get("precision")
    return str(precision) if precision else run_dir.name


def final_scale(run_dir: Path, records: list[dict]) -> tuple[int, float] | None:
    """(last step, loss scale after it) from `summary.json`: each record holds the scale its step was computed with,
    so a growth at the last step (e.g. step 2000 of a 2000-step interval) shows only in the summary."""
    summary = _summary(run_dir)
    final = summary.get("final_loss_scale")
    if summary.get("steps") != records[-1]["step"] or not _finite(final) or final <= 0:
        return None
    return records[-1]["step"], float(final)


def _unique(labels: list[str], run_dirs: list[Path]) -> list[str]:
    """Adds the directory name to labels that several runs share (two fp16 runs stay distinguishable)."""
    return [f"{lab} ({d.name})" if labels.count(lab) > 1 and lab != d.name else lab
            for lab, d in zip(labels, run_dirs)]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _series(records: list[dict], key: str, positive: bool = False) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that hold a finite `key` (> 0 when `positive`, for log axes)."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if _finite(v) and (not positive or v > 0):
            steps.append(r["step"])
            values.append(float(v))
    return steps, values


def _ema(values: list[float], weight: float) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard's smoothing)."""
    out, acc = [], 0.0
    for i, v in enumerate(values, start=1):
        acc = weight * acc + (1 - weight) * v
        out.append(acc / (1 - weight**i))
    return out


def load_run(run_dir: str | Path) -> list[dict]:
    """The step records of one run, sorted by step.

    Raises:
      PlotError: the directory does not exist, or its `metrics.jsonl` is missing or holds no records.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PlotError(f"run directory not found: {run_dir}")
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if isinstance(r, dict) and "step" in r]
    if not records:
        raise PlotError(f"no metrics in {run_dir / 'metrics.jsonl'} (missing or empty)")
    return sorted(records, key=lambda r: r["step"])


def _lone(steps) -> str | None:
    """A marker for a series of one point (a line through one point draws nothing)."""
    return "o" if len(steps) == 1 else None


def plot_runs(run_dirs: Sequence[str | Path], out_path: str | Path, labels: Sequence[str] | None = None) -> Path:
    """Draws the runs' training curves into one PNG with four panels and returns its path.

    Panels: (1) train loss (light) with a smoothed line, validation loss as markers, vs step; (2) loss scale on a
    log2 axis, steps whose gradients overflowed (`grads_finite` false, the update was skipped) as red x's;
    (3) gradient norm (unscaled, log axis; non-finite norms of skipped steps are left out); (4) tokens/s.

    Args:
      run_dirs: workdirs, each with `metrics.jsonl` (and optionally `summary.json`).
      out_path: the PNG to write; parent directories are created.
      labels: one legend label per run; default: the summary's precision, else the directory name.

    Raises:
      PlotError: a directory is missing or has no metrics, `labels` does not match `run_dirs` in length, or
        `out_path` is a directory.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise PlotError("no run directories given")
    if Path(out_path).is_dir():
        raise PlotError(f"--out {out_path} is a directory; pass a file name such as {Path(out_path) / 'plot.png'}")
    runs = [load_run(d) for d in run_dirs]
    if labels is None:
        labels = _unique([_label(d) for d in run_dirs], run_dirs)
    elif len(labels) != len(run_dirs):
        raise PlotError(f"{len(labels)} labels for {len(run_dirs)} runs")

    fig = Figure(figsize=(13, 8.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_scale, ax_norm, ax_speed = fig.subplots(2, 2).ravel()
    skipped_labelled = False
    for i, (records, label, run_dir) in enumerate(zip(runs, labels, run_dirs)):
        color = f"C{i % 10}"
        steps, loss = _series(records, "loss")
        if loss:
            ax_loss.plot(steps, loss, color=color, alpha=0.25, linewidth=0.8)
            weight = min(0.98, max(0.0, 1 - 40 / len(loss)))  # window ~len/40 steps: 5 at 200 steps, 50 at 2000+
            ax_loss.plot(steps, _ema(loss, weight), color=color, linewidth=1.8, label=f"{label} train",
                         marker=_lone(steps))
        vsteps, vloss = _series(records, "val_loss")
        if vloss:
            ax_loss.plot(vsteps, vloss, color=color, marker="o", linestyle="--", linewidth=1, markersize=5,
                         label=f"{label} val")

        ssteps, scale = _series(records, "loss_scale", positive=True)
        final = final_scale(run_dir, records)
        if scale and final is not None:
            ssteps, scale = [*ssteps, final[0]], [*scale, final[1]]  # the scale after the last step
            ax_scale.plot(*final, color=color, marker="o", markersize=5)
        if scale:
            ax_scale.plot(ssteps, scale, color=color, linewidth=1.5, drawstyle="steps-post", label=label,
                          marker=_lone(ssteps))
        skipped = [(r["step"], r["loss_scale"]) for r in records
                   if r.get("grads_finite") is False and _finite(r.get("loss_scale")) and r["loss_scale"] > 0]
        if skipped:
            xs, ys = zip(*skipped)
            ax_scale.scatter(xs, ys, marker="x", color="red", s=40, zorder=3,
                             label=None if skipped_labelled else "skipped step (overflow)")
            skipped_labelled = True

        nsteps, norm = _series(records, "grad_norm", positive=True)
        if norm:
            ax_norm.plot(nsteps, norm, color=color, linewidth=1, label=label, marker=_lone(nsteps))

        tsteps, speed = _series(records, "tokens_per_s", positive=True)
        if speed:
            ax_speed.plot(tsteps, speed, color=color, linewidth=1.2, label=label, marker=_lone(tsteps))

    ax_loss.set(title="loss (train: raw + smoothed; val: markers)", xlabel="step", ylabel="cross-entropy (nats/token)")
    ax_scale.set(title="loss scale per step (x = skipped step, o = after the last step)", xlabel="step",
                 ylabel="loss scale")
    ax_scale.set_yscale("log", base=2)
    ax_norm.set(title="gradient norm (unscaled)", xlabel="step", ylabel="global L2 norm")
    ax_norm.set_yscale("log")
    ax_speed.set(title="throughput", xlabel="step", ylabel="tokens/s")
    ax_speed.set_ylim(0, ax_speed.get_ylim()[1] * 1.05)  # from 0: the first interval (with compilation) dips
    for ax in (ax_loss, ax_scale, ax_norm, ax_speed):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out_path, format="png")
    except OSError as err:
        raise PlotError(f"cannot write {out_path}: {err.strerror or err}") from None
    return out_path
