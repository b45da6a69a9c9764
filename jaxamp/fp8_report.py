"""FP8 ranges: per FP8 matmul, how this batch's inputs, kernel and output gradient fit e4m3 / e5m2 at the current scale.

Flax's FP8 ops (`Fp8DirectDotGeneralOp`, `Fp8Einsum`, used by `jaxamp.layers.Dense(fp8=True)`) divide each tensor
by a per-tensor scale before casting it to FP8, with saturation: inputs and kernels to e4m3 (largest finite 448),
output gradients to e5m2 (57344). The scale is delayed: it comes from the amax history of earlier steps,
`scale = max(history) / format max`. `fp8_ranges(state, batch, loss_fn)` runs one forward and backward pass (loss
scale 1: the FP8 state is stored loss-scale free) and reports, per op and tensor:

- `amax`: the largest |value| of this batch; `capacity`: the largest |value| the scale can hold (format max x
  scale); `amax / capacity` above 1 means values saturate (clip to the format max);
- `saturated`: the fraction of values clipped; `flushed`: nonzero values that round to 0 (|x / scale| at most half
  the smallest subnormal); `below_normal`: nonzero values held as subnormals (fewer significant bits) or flushed.

| | largest finite | smallest normal | smallest subnormal | flushes to 0 when \\|x / scale\\| <= |
| --- | --- | --- | --- | --- |
| float8_e4m3fn | 448 | 2^-6 | 2^-9 | 2^-10 |
| float8_e5m2 | 57344 | 2^-14 | 2^-16 | 2^-17 |
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import fp8_ops

from jaxamp.diagnostics import FloatFormat
from jaxamp.state import FP8_COLLECTION, TrainState, split_fp8

PyTree = Any

FP8_FORMATS: dict[str, FloatFormat] = {
    "e4m3": FloatFormat("float8_e4m3fn", 448.0, 464.0, 2.0**-6, 2.0**-9, 2.0**-10),
    "e5m2": FloatFormat("float8_e5m2", 57344.0, 61440.0, 2.0**-14, 2.0**-16, 2.0**-17),
}
# tensor -> (format, the op's scale variable, the op's amax-history variable)
_TENSORS = {"input": ("e4m3", "input_scale", "input_amax_history"),
            "kernel": ("e4m3", "kernel_scale", "kernel_amax_history"),
            "output_grad": ("e5m2", "output_grad_scale", "output_grad_amax_history")}


class _Fp8Recorder:
    """Records each FP8 op's operands and FP8 variables, and adds a perturbation to its output (for its gradient)."""

    def __init__(self, perturb: dict | None = None):
        self.perturb = perturb
        self.captured: dict[str, dict] = {}

    def __call__(self, next_fun, args, kwargs, context):
        if context.method_name != "__call__" or not isinstance(context.module, fp8_ops.Fp8DotGeneralBase):
            return next_fun(*args, **kwargs)
        out = next_fun(*args, **kwargs)
        key = "/".join(context.module.path)
        names = [name for _, scale, history in _TENSORS.values() for name in (scale, history)]
        variables = {name: context.module.get_variable(FP8_COLLECTION, name) for name in names}
        # The first two array arguments: (lhs, rhs) of a dot_general op, after the equation of `Fp8Einsum`.
        lhs, rhs = [a for a in (*args, *kwargs.values()) if hasattr(a, "shape")][:2]
        self.captured[key] = {"input": lhs, "kernel": rhs, **variables}
        if self.perturb is not None and key in self.perturb:
            out = out + self.perturb[key].astype(out.dtype)
        return out


def _loss(loss_fn, params, batch):
    out = loss_fn(params, batch, None)
    return (out[0] if isinstance(out, tuple) else out).astype(jnp.float32)


def _run(loss_fn, params, batch):
    """The captured operands and variables of every FP8 op, and the gradient of the loss w.r.t. each op's output."""
    recorder = _Fp8Recorder()

    def forward(perturb):
        recorder.perturb, recorder.captured = perturb, {}
        with nn.intercept_methods(recorder):
            loss = _loss(loss_fn, params, batch)
        return loss, recorder.captured

    out_shapes = jax.eval_shape(lambda: _op_outputs(loss_fn, params, batch))
    perturb = {k: jnp.zeros(s.shape, jnp.float32) for k, s in out_shapes.items()}
    grads, captured = jax.grad(forward, has_aux=True)(perturb)
    return captured, grads


def _op_outputs(loss_fn, params, batch) -> dict:
    """The output of every FP8 op (shapes only are used)."""
    outputs = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__" and isinstance(context.module, fp8_ops.Fp8DotGeneralBase):
            outputs["/".join(context.module.path)] = out
        return out

    with nn.intercept_methods(record):
        _loss(loss_fn, params, batch)
    return outputs


def _delayed_scale(history: np.ndarray, scale: np.ndarray, fmt: FloatFormat) -> float:
    """The scale the op uses this step (Flax's `compute_scale`): max(amax history) / format max when that amax is
    positive and finite, else the stored scale."""
    amax = float(np.max(history))
    return amax / fmt.max if amax > 0 and np.isfinite(amax) else float(scale.reshape(-1)[0])


def _row(layer: str, tensor: str, values: np.ndarray, history: np.ndarray, scale: np.ndarray) -> dict:
    fmt = FP8_FORMATS[_TENSORS[tensor][0]]
    s = _delayed_scale(history, scale, fmt)
    a = np.abs(values.astype(np.float32).reshape(-1)) / s  # the magnitudes the FP8 cast sees
    nonzero = a > 0
    amax = float(np.max(np.abs(values.astype(np.float32)))) if values.size else 0.0
    return {"layer": layer, "tensor": tensor, "format": fmt.name, "amax": amax, "scale": s,
            "capacity": fmt.max * s, "amax_over_capacity": amax / (fmt.max * s),
            "saturated": float(np.mean(a > fmt.max)), "flushed": float(np.mean(nonzero & (a <= fmt.flush_at))),
            "below_normal": float(np.mean(nonzero & (a < fmt.smallest_normal)))}


def fp8_ranges(state: TrainState, batch: PyTree, loss_fn) -> list[dict]:
    """Per FP8 op and tensor (input, kernel, output gradient), this batch's values against the op's current scale.

    Args:
      state: a `TrainState` whose params hold the FP8 collection (a model with Flax FP8 ops).
      batch: one batch, as `train_step` takes it.
      loss_fn: as for `train_step`.

    Returns:
      One dict per op and tensor, in call order: `layer` (the op's module path), `tensor`, `format`, `amax`,
      `scale`, `capacity`, `amax_over_capacity`, `saturated`, `flushed`, `below_normal` (see the module docstring).

    Raises:
      ValueError: the state holds no FP8 collection, or the loss calls no FP8 op.
    """
    if split_fp8(state.params)[1] is None:
        raise ValueError("state.params holds no FP8 collection ('_overwrite_with_gradient'): build the model with "
                         "FP8 ops (jaxamp.layers.Dense(fp8=True), TransformerConfig(fp8=True)) and pass its variables")
    captured, grads = jax.jit(lambda p, b: _run(loss_fn, p, b))(state.compute_params(), batch)
    if not captured:
        raise ValueError("the loss calls no FP8 op (Flax Fp8DirectDotGeneralOp / Fp8Einsum)")
    captured, grads = jax.device_get((captured, grads))
    rows = []
    for layer, c in captured.items():
        values = {"input": c["input"], "kernel": c["kernel"], "output_grad": grads[layer]}
        for tensor, (_, scale_name, history_name) in _TENSORS.items():
            rows.append(_row(layer, tensor, np.asarray(values[tensor]), np.asarray(c[history_name]),
                             np.asarray(c[scale_name])))
    return rows


def format_fp8_table(rows: list[dict]) -> str:
    """A markdown table of `fp8_ranges`."""
    lines = ["| FP8 op | tensor | format | amax | capacity (max x scale) | amax / capacity | saturated | flushed | "
             "below normal |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['tensor']} | {r['format']} | {r['amax']:.3g} | {r['capacity']:.3g} | "
                     f"{r['amax_over_capacity']:.3g} | {100 * r['saturated']:.3f}% | {100 * r['flushed']:.3f}% | "
                     f"{100 * r['below_normal']:.2f}% |")
    return "\n".join(lines) + "\n"
