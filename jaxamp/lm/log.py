"""What the training loop prints and records: lines from process 0 only (`say`), the host records of metrics.jsonl
made from the device metrics of one logging interval (`host_records`), the lines on skipped steps and gradient fidelity,
and the summary line, and the metrics logger (`open_logger`: process 0 writes metrics.jsonl, the
other processes keep the same records in memory, `_NullLogger`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax

from jaxamp.fidelity import worst
from jaxamp.grad_stats import nonfinite_paths, worst_leaves
from jaxamp.lm.config import ConfigError
from jaxamp.lm.metrics_log import MetricsLogger, record_with
from jaxamp.sharding import is_main_process


def say(message: str) -> None:
    """Prints from process 0 only (every process runs the same loop)."""
    if is_main_process():
        print(message, flush=True)


def warn(message: str) -> None:
    """`warning: message` on stderr (beside the checkpointer's warnings), from process 0 only."""
    if is_main_process():
        print(f"warning: {message}", file=sys.stderr, flush=True)


def host_records(metrics: list[dict], first_step: int, t0: float, tokens_per_step: int) -> list[dict]:
    """Host records for the steps of one logging interval (one device fetch for the whole interval).

    `t0` is `time.perf_counter()` when the interval began; the fetch waits for the device, so tokens/s is real.
    """
    host = jax.device_get(metrics)
    tokens_per_s = tokens_per_step * len(host) / max(time.perf_counter() - t0, 1e-9)
    return [_record(first_step + i + 1, m, tokens_per_s) for i, m in enumerate(host)]


def _record(step: int, m: dict, tokens_per_s: float) -> dict:
    """One metrics.jsonl record; overflowed leaves are named (on the host) for skipped steps only."""
    record = record_with({}, step=step, loss=float(m["loss"]), loss_scale=float(m["loss_scale"]),
                         grads_finite=bool(m["grads_finite"]), loss_finite=bool(m["loss_finite"]),
                         grad_norm=float(m["grad_norm"]), lr=float(m["lr"]), retries=int(m["retries"]),
                         tokens_per_s=tokens_per_s)
    if not record["grads_finite"]:
        record_with(record, nonfinite_leaves=nonfinite_paths(m["grads_finite_leaves"]))
    if "nonfinite_at_min_scale" in m:
        record_with(record, nonfinite_at_min_scale=bool(m["nonfinite_at_min_scale"]))
    if "grad_rel_err" in m:
        record_with(record, grad_rel_err={k: float(v) for k, v in m["grad_rel_err"].items()})
    if "underflow" in m:
        u = m["underflow"]
        record_with(record, grad_zero_fraction=float(u["zero_fraction"]), headroom_log2=float(u["headroom_log2"]),
                    worst_zero_leaves=worst_leaves(u["leaf_zero_fraction"], 3),
                    worst_headroom_leaves=worst_leaves(u["leaf_headroom_log2"], 3, largest=False))
    return record


class _NullLogger:
    """The metrics logger of processes other than 0: they compute the same records, keep them (each checkpoint
    saves a copy; only process 0's is written) and write no file."""

    skipped = 0

    def __init__(self, history: list[dict] | None = None):
        self.records = list(history or [])

    def write(self, records: list[dict]) -> None:
        self.records.extend(records)

    def close(self) -> None:
        pass


def open_logger(workdir: Path, step: int, history: list[dict] | None):
    """Process 0's metrics logger, metrics.jsonl made to begin with the checkpoint's copy of the records (repaired
    if it differs, with a warning); the other processes' in-memory one."""
    if not is_main_process():
        return _NullLogger(history)
    try:
        logger = MetricsLogger(workdir, resume_step=step, history=history)
    except ValueError as err:  # no copy in the checkpoint (saved by an older jaxamp) and a damaged record
        raise ConfigError(str(err)) from None
    if logger.repaired_line is not None:
        warn(f"{logger.path} differed from the copy saved with checkpoint step {step} from line "
             f"{logger.repaired_line} on; rewritten from it")
    return logger


def report_skips(bar, records: list[dict]) -> None:
    """One line per logging interval with skipped steps: which step, why, and which leaves overflowed."""
    skipped = [r for r in records if not r["grads_finite"]]
    if skipped and is_main_process():
        r = skipped[0]
        why = "non-finite loss" if not r["loss_finite"] else f"overflow at loss scale {r['loss_scale']:g}"
        leaves = ", ".join(r["nonfinite_leaves"][:3]) + (" ..." if len(r["nonfinite_leaves"]) > 3 else "")
        bar.write(f"step {r['step']}: skipped ({why}) in {leaves}" +
                  (f"; {len(skipped) - 1} more skipped up to step {records[-1]['step']}" if len(skipped) > 1 else ""))


def report_fidelity(bar, records: list[dict]) -> None:
    """One line per gradient-fidelity check: the three leaves whose gradients are furthest from float32."""
    for r in records:
        if "grad_rel_err" in r and is_main_process():
            leaves = ", ".join(f"{k} {100 * v:.2f}%" for k, v in worst(r["grad_rel_err"], 3))
            bar.write(f"step {r['step']}: gradient error against float32, worst leaves: {leaves}")


def summary_line(s: dict) -> str:
    val = "n/a" if s["val_loss"] is None else f"{s['val_loss']:.4f}"
    if s.get("val_loss_step") not in (None, s["steps"]):  # stopped between evaluations: the last one's step
        val += f" (step {s['val_loss_step']})"
    speed = "n/a" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.0f}"
    return (f"summary: precision={s['precision']} steps={s['steps']} val_loss={val} "
            f"train_loss={s['train_loss']:.4f} skipped_steps={s['skipped_steps']} "
            f"final_loss_scale={s['final_loss_scale']:g} tokens_per_s={speed} wall_s={s['wall_s']:.1f}")
