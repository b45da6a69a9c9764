"""The metrics `train_step` returns, defined once: name -> (shape and dtype, meaning).

Every key of `train_step`'s (and `jaxamp.nnx.train_step`'s) metrics dict is one of `STEP_METRICS`; `step_metrics`
builds the dict and refuses any other key, so a new metric is documented here before it can exist. The values are
device arrays; fetch them once per logging interval (`jax.device_get`), not per step.
"""

from __future__ import annotations

from typing import Any

__all__ = ["STEP_METRICS", "step_metrics"]

STEP_METRICS: dict[str, tuple[str, str]] = {
    "loss": ("f32[]", "the unscaled mean loss of the step's batch (over its micro-batches)"),
    "loss_finite": ("bool[]", "False: the loss itself is not finite (the inputs or the forward pass, not the scale)"),
    "grad_norm": ("f32[]", "global L2 norm of the unscaled float32 gradients before clipping; inf or NaN on overflow"),
    "loss_scale": ("f32[]", "the loss scale the gradients were finally computed with (after retries)"),
    "grads_finite": ("bool[]", "the one finite check: False means the update was skipped"),
    "grads_finite_leaves": ("tree of bool[]", "per params leaf, like the params: which leaves overflowed (None "
                                              "at frozen leaves); jaxamp.grad_stats.nonfinite_paths names them"),
    "retries": ("i32[]", "recomputations of the batch at a backed-off scale (on_overflow='retry'; else 0)"),
    "consecutive_skips": ("i32[]", "skipped steps in a row, this one included (0 after an applied step): a loop "
                                   "can stop on it"),
    "loss_weight": ("f32[]", "a WeightedLoss only: the step's count (tokens) over its micro-batches and devices"),
    "nonfinite_at_min_scale": ("bool[]", "on_overflow='retry' only: the probe at the lowest scale overflowed too, "
                                         "so the scale was not the cause"),
    "aux": ("loss_fn's aux", "what loss_fn returned beside the loss (stacked [accum_steps, ...] under accumulation)"),
    "underflow": ("dict", "underflow_stats=True only: jaxamp.grad_stats.underflow_stats of the scaled gradients"),
}


def step_metrics(**values: Any) -> dict:
    """The metrics dict of a step from keyword values; keys whose value is None (an option not in use) are left out.

    Raises:
      ValueError: a key that is not in `STEP_METRICS` (document it there first).
    """
    unknown = sorted(set(values) - set(STEP_METRICS))
    if unknown:
        raise ValueError(f"train_step has no metric {unknown[0]!r}; define it in jaxamp.metrics.STEP_METRICS first")
    return {k: v for k, v in values.items() if v is not None}
