"""FP8 ranges: per FP8 matmul, how this batch's inputs, kernel and output gradient fit e4m3 / e5m2 at the current scale.

Flax's FP8 ops (`Fp8DirectDotGeneralOp`, `Fp8Einsum`, used by `jaxamp.layers.Dense(fp8=True)`) divide each tensor
by a per-tensor scale before casting it to FP8, with saturation: inputs and kernels to e4m3 (largest finite 448),
output gradients to e5m2 (57344). The scale is delayed: it comes from the amax history of earlier steps,
`scale = max(history) / format max`. `fp8_ranges(state, batch, loss_fn)` runs one forward and backward pass (loss
scale 1: the FP8 state is stored loss-scale free) and reports, per op and tensor:

- `amax`: the largest |value| of this batch; `capacity`: the largest |value| the scale can hold (format max x
  scale); `amax / capacity` above 1 means values saturate (clip to the format max);
- `saturated`: the fraction of values the clip changes beyond rounding (|x / scale| past 464 for e4m3, at least
  61440 for e5m2, where an unclipped cast gives NaN or inf; a value at the amax that set the scale, 448.00003 after
  the division, rounds to 448 and is not counted); `flushed`: nonzero values that round to 0 (|x / scale| at most half
  the smallest subnormal); `below_normal`: nonzero values held as subnormals (fewer significant bits) or flushed.

| | largest finite | smallest normal | smallest subnormal | flushes to 0 when \\|x / scale\\| <= |
| --- | --- | --- | --- | --- |
| float8_e4m3fn | 448 | 2^-6 | 2^-9 | 2^-10 |
| float8_e5m2 | 57344 | 2^-14 | 2^-16 | 2^-17 |
| float8_e4m3fnuz (Flax's NANOO op, AMD) | 240 | 2^-7 | 2^-10 | 2^-11 |
| float8_e5m2fnuz (Flax's NANOO op, AMD) | 57344 | 2^-15 | 2^-17 | 2^-18 |

NNX models (`jaxamp.nnx.Fp8DotGeneral`, `jaxamp.nnx.Fp8Einsum`) get the same report from `jaxamp.nnx.fp8_ranges`:
their ops report to the recorder of `capture` while it runs. `fp8_bypassed()` turns every FP8 op, linen or NNX, into
its plain matmul: the float32 reference of `jaxamp.fidelity.grad_fidelity` for a model with FP8 ops.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import fp8_ops

from jaxamp.diagnostics import FloatFormat
from jaxamp.fp8_collection import FP8_COLLECTION, split_fp8
from jaxamp.gradients import split_loss
from jaxamp.state import TrainState

PyTree = Any

__all__ = ["FP8_FORMATS", "active_recorder", "bypassed", "capture", "einsum_operands", "einsum_swaps",
           "format_fp8_table", "fp8_bypassed", "fp8_ranges", "ranges_table", "record_nnx_op", "run_capture"]

FP8_FORMATS: dict[str, FloatFormat] = {
    # e4m3fn has no inf: above 464 (halfway to 480, a tie that rounds to 448's even mantissa) a cast gives NaN.
    "e4m3": FloatFormat("float8_e4m3fn", 448.0, float(np.nextafter(np.float32(464), np.float32(np.inf))), 2.0**-6,
                        2.0**-9, 2.0**-10),
    "e5m2": FloatFormat("float8_e5m2", 57344.0, 61440.0, 2.0**-14, 2.0**-16, 2.0**-17),
    # The "fnuz" forms of AMD GPUs (Flax's NANOOFp8DotGeneralOp): no inf, no -0, one more binade of subnormals.
    "e4m3fnuz": FloatFormat("float8_e4m3fnuz", 240.0, 248.0, 2.0**-7, 2.0**-10, 2.0**-11),
    "e5m2fnuz": FloatFormat("float8_e5m2fnuz", 57344.0, 61440.0, 2.0**-15, 2.0**-17, 2.0**-18),
}
_FORMAT_KEYS = tuple(FP8_FORMATS)
# tensor -> (which of the op's two formats: 0 = its e4m3 dtype, 1 = its e5m2 dtype, the op's scale variable, the op's
# amax-history variable)
_TENSORS = {"input": (0, "input_scale", "input_amax_history"),
            "kernel": (0, "kernel_scale", "kernel_amax_history"),
            "output_grad": (1, "output_grad_scale", "output_grad_amax_history")}


_VARIABLES = [name for _, scale, history in _TENSORS.values() for name in (scale, history)]
# input_* <-> kernel_*: the variables of the other operand (for an einsum that contracts the kernel first)
_SWAPPED = {a: b for x, y in (("input", "kernel"), ("kernel", "input")) for a, b in
            ((f"{x}_scale", f"{y}_scale"), (f"{x}_amax_history", f"{y}_amax_history"))}
_ACTIVE: contextvars.ContextVar[_Fp8Recorder | None] = contextvars.ContextVar("jaxamp_fp8_recorder", default=None)


class _Fp8Recorder:
    """Records each FP8 op's operands, FP8 variables and output, and adds a perturbation to its output (whose
    gradient is the op's output gradient). Linen ops report through `nn.intercept_methods`, NNX ops
    (`jaxamp.nnx.Fp8DotGeneral`, `Fp8Einsum`) through `record_nnx_op` while the recorder is active."""

    def __init__(self):
        self.perturb: dict | None = None
        self.captured: dict[str, dict] = {}
        self.names: dict[int, str] = {}  # id(NNX module) -> its path in the model, set by jaxamp.nnx

    def record(self, key: str, lhs, rhs, variables: dict, out, formats=(jnp.float8_e4m3fn, jnp.float8_e5m2)):
        calls = sum(k == key or k.startswith(f"{key} (call ") for k in self.captured)
        if calls:  # an op called again in the same loss (a shared layer): a row set per call
            key = f"{key} (call {calls + 1})"
        codes = jnp.array([_FORMAT_KEYS.index(_format_key(f)) for f in formats], jnp.int32)  # i32[2]
        self.captured[key] = {"input": lhs, "kernel": rhs, "output": out, "formats": codes, **variables}
        if self.perturb is not None and key in self.perturb:
            out = out + self.perturb[key].astype(out.dtype)
        return out

    def __call__(self, next_fun, args, kwargs, context):  # a linen method interceptor
        if context.method_name != "__call__" or not isinstance(context.module, fp8_ops.Fp8DotGeneralBase):
            return next_fun(*args, **kwargs)
        out = next_fun(*args, **kwargs)
        variables = {name: context.module.get_variable(FP8_COLLECTION, name) for name in _VARIABLES}
        # The first two array arguments: (lhs, rhs) of a dot_general op, after the equation of `Fp8Einsum`.
        lhs, rhs = [a for a in (*args, *kwargs.values()) if hasattr(a, "shape")][:2]
        if isinstance(context.module, fp8_ops.Fp8Einsum):
            if einsum_swaps(args[0], lhs.shape, rhs.shape):
                # The op quantizes the kernel with its input_* variables and the inputs with its kernel_* ones: each
                # tensor's row reads the variables that scale it.
                variables = {name: variables[_SWAPPED.get(name, name)] for name in variables}
            lhs, rhs = einsum_operands(args[0], jnp.asarray(lhs, rhs.dtype), rhs)
        formats = (context.module.e4m3_dtype, context.module.e5m2_dtype)  # e4m3fnuz/e5m2fnuz in the NANOO op
        return self.record("/".join(context.module.path), lhs, rhs, variables, out, formats)


def _format_key(dtype) -> str:
    name = jnp.dtype(dtype).name
    for key, fmt in FP8_FORMATS.items():
        if fmt.name == name:
            return key
    raise ValueError(f"fp8_ranges knows the FP8 formats {[f.name for f in FP8_FORMATS.values()]}, not {name}")


def active_recorder() -> _Fp8Recorder | None:
    """The recorder of the `fp8_ranges` running now, or None (for NNX FP8 ops and the NNX wrapper that names them)."""
    return _ACTIVE.get()


def record_nnx_op(module, lhs, rhs, out, eqn: str | None = None):
    """Called by an NNX FP8 op with its operands (and an einsum's equation) and output: returns the output,
    perturbed while `fp8_ranges` records (`module`'s path comes from the names the NNX wrapper registered; its FP8
    variables are read by name).

    Raises:
      ValueError: the op runs in a trace of its own inside the loss (`nnx.scan`, `nnx.remat`, `jax.checkpoint`,
        `nnx.jit`), where its values cannot be read out.
    """
    recorder = _ACTIVE.get()
    if recorder is None:
        return out
    if id(module) not in recorder.names:  # a module merged again by an NNX transform (nnx.scan, nnx.remat, ...)
        raise ValueError(_INNER)
    variables = {name: getattr(module, name)[...] for name in _VARIABLES}
    if eqn is not None:
        lhs, rhs = einsum_operands(eqn, lhs, rhs)
    return recorder.record(recorder.names[id(module)], lhs, rhs, variables, out)


@contextlib.contextmanager
def _recording(recorder: _Fp8Recorder):
    token = _ACTIVE.set(recorder)
    try:
        with nn.intercept_methods(recorder):
            yield recorder
    finally:
        _ACTIVE.reset(token)


def einsum_swaps(eqn: str, lhs_shape: tuple, rhs_shape: tuple) -> bool:
    """Whether `jnp.einsum(eqn, lhs, rhs, _dot_general=f)` calls `f(rhs, lhs, ...)`: it contracts in that order when
    that saves a transpose (e.g. `"bi,io->ob"`). Flax's `Fp8Einsum` then quantizes the kernel with the input's
    scale and history and the inputs with the kernel's: each tensor still has a scale of its own, under the other's
    name. Found by tracing the einsum abstractly with the operands told apart by dtype."""
    order = []

    def probe(x, y, dimension_numbers, *args, **kwargs):
        del args, kwargs
        order.append(x.dtype == jnp.bfloat16)  # x is rhs
        return jax.lax.dot_general(x.astype(jnp.float32), y.astype(jnp.float32), dimension_numbers)

    with jax.numpy_dtype_promotion("standard"):  # a summed-out index: einsum compares the two dtypes
        jax.eval_shape(lambda a, b: jnp.einsum(eqn, a, b, preferred_element_type=jnp.bfloat16, _dot_general=probe),
                       jax.ShapeDtypeStruct(tuple(lhs_shape), jnp.float32),
                       jax.ShapeDtypeStruct(tuple(rhs_shape), jnp.bfloat16))
    return bool(order and order[0])


def einsum_operands(eqn: str, lhs: jax.Array, rhs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(inputs, kernel)` as `jnp.einsum(eqn, lhs, rhs)` hands them to its `dot_general`, which an FP8 einsum
    quantizes: an index only one operand has and the output lacks is summed out first (`"bij,jk->bk"` sums `i`),
    as `jnp.einsum` does it (`lax.reduce` in the operand's dtype), so their amax is the quantized tensors' amax.
    (An equation with a repeated index in one operand, a diagonal, gives the operands as they are.)"""
    spec = eqn.replace(" ", "")
    if "->" not in spec:
        return lhs, rhs  # implicit output: every index that appears once is kept
    ins, out = spec.split("->")
    names = ins.split(",")
    if len(names) != 2:
        return lhs, rhs
    return _summed_out(lhs, names[0], names[1] + out), _summed_out(rhs, names[1], names[0] + out)


def _summed_out(x: jax.Array, names: str, kept: str) -> jax.Array:
    if "..." in names:
        head, tail = names.split("...")
        labels = [*head, *[None] * (x.ndim - len(head) - len(tail)), *tail]
    else:
        labels = list(names)
    letters = [n for n in labels if n is not None]
    if len(set(letters)) != len(letters):
        return x
    axes = tuple(i for i, n in enumerate(labels) if n is not None and n not in kept)
    return jax.lax.reduce(x, np.array(0, x.dtype), jax.lax.add, axes) if axes else x


class _Bypass:
    """The state of one `fp8_bypassed()` block: how many FP8 ops it bypassed."""

    def __init__(self):
        self.calls = 0


_BYPASS: contextvars.ContextVar[_Bypass | None] = contextvars.ContextVar("jaxamp_fp8_bypass", default=None)


def bypassed() -> bool:
    """True inside `fp8_bypassed()`; counts the caller (an NNX FP8 op about to compute its plain matmul)."""
    block = _BYPASS.get()
    if block is not None:
        block.calls += 1
    return block is not None


@contextlib.contextmanager
def fp8_bypassed():
    """Within it, every FP8 op computes its plain matmul in its kernel's dtype, without quantizing or touching its
    FP8 variables: Flax's linen ops (`Fp8DirectDotGeneralOp`, `Fp8Einsum`, as in `jaxamp.layers.Dense(fp8=True)`)
    through `nn.intercept_methods`, `jaxamp.nnx`'s FP8 modules by checking `bypassed()`. The model without its FP8
    ops, for the float32 reference of `jaxamp.fidelity.grad_fidelity`. Trace-time: wrap the tracing of the loss (an
    op inside a function that `jax.jit` compiled before is not traced again, so it is not bypassed). Yields an
    object whose `calls` counts the ops bypassed."""
    block = _Bypass()
    token = _BYPASS.set(block)
    try:
        with nn.intercept_methods(functools.partial(_plain_linen_op, block)):
            yield block
    finally:
        _BYPASS.reset(token)


def _plain_linen_op(block: _Bypass, next_fun, args, kwargs, context):
    """A linen method interceptor: an FP8 op's `__call__` becomes `lax.dot_general` / `jnp.einsum` in the dtype of
    its kernel (the op's second operand), as the op's own output."""
    if context.method_name != "__call__" or not isinstance(context.module, fp8_ops.Fp8DotGeneralBase):
        return next_fun(*args, **kwargs)
    block.calls += 1
    if isinstance(context.module, fp8_ops.Fp8Einsum):
        eqn, lhs, rhs = (*args, *[kwargs[k] for k in ("eqn", "lhs", "rhs")[len(args):]])[:3]
        return jnp.einsum(eqn, lhs.astype(rhs.dtype), rhs)
    names = ("lhs", "rhs", "dimension_numbers")
    lhs, rhs, dims = (*args, *[kwargs[k] for k in names[len(args):]])[:3]
    return jax.lax.dot_general(lhs.astype(rhs.dtype), rhs, dims)


def _loss(loss_fn, params, batch):
    return split_loss(loss_fn(params, batch, None))[0]


def capture(state: TrainState, batch: PyTree, loss_fn) -> tuple[dict, dict]:
    """`(captured, output_grads)`: every FP8 op's operands and FP8 variables (`{op: {"input", "kernel",
    "input_scale", ...}}`) and the gradient of the loss w.r.t. its output (`{op: array}`), at loss scale 1 and the
    state's compute dtype. Traceable (`fp8_ranges` jits it)."""
    params = state.compute_params()
    recorder = _Fp8Recorder()

    def forward(perturb):
        recorder.perturb, recorder.captured = perturb, {}
        with _recording(recorder):
            loss = _loss(loss_fn, params, batch)
        return loss, recorder.captured

    shapes = jax.eval_shape(lambda: forward(None)[1])
    perturb = {k: jnp.zeros(c["output"].shape, jnp.float32) for k, c in shapes.items()}
    grads, captured = jax.grad(forward, has_aux=True)(perturb)
    return {k: {name: v for name, v in c.items() if name != "output"} for k, c in captured.items()}, grads


def _delayed_scale(history: np.ndarray, scale: np.ndarray, fmt: FloatFormat) -> float:
    """The scale the op uses this step (Flax's `compute_scale`): max(amax history) / format max when that amax is
    positive and finite, else the stored scale."""
    amax = float(np.max(history))
    return amax / fmt.max if amax > 0 and np.isfinite(amax) else float(scale.reshape(-1)[0])


def _row(layer: str, tensor: str, values: np.ndarray, history: np.ndarray, scale: np.ndarray,
         formats: tuple[str, str] = ("e4m3", "e5m2")) -> dict:
    fmt = FP8_FORMATS[formats[_TENSORS[tensor][0]]]
    s = _delayed_scale(history, scale, fmt)
    a = np.abs(values.astype(np.float32).reshape(-1)) / s  # the magnitudes the FP8 cast sees
    nonzero = a > 0
    amax = float(np.max(np.abs(values.astype(np.float32)))) if values.size else 0.0
    return {"layer": layer, "tensor": tensor, "format": fmt.name, "amax": amax, "scale": s,
            "capacity": fmt.max * s, "amax_over_capacity": amax / (fmt.max * s),
            "saturated": float(np.mean(a >= fmt.overflow_at)), "flushed": float(np.mean(nonzero & (a <= fmt.flush_at))),
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
        raise ValueError("state.params holds no FP8 collection ('_overwrite_with_gradient'): fp8_ranges reads "
                         "delayed scaling's amax histories ('fp8'); build the model with FP8 ops "
                         "(jaxamp.layers.Dense(fp8=True), TransformerConfig(fp8=True)) and pass its variables. The "
                         "stateless recipes ('fp8-current', 'fp8-block', 'mxfp8') keep no history: see "
                         "precision_audit's fp8_fraction and grad_fidelity")
    return ranges_table(*run_capture(jax.jit(capture, static_argnums=2), state, batch, loss_fn))


_INNER = ("fp8_ranges cannot read an FP8 op that runs inside a transform of loss_fn (nn.scan, nn.remat, "
          "jax.checkpoint, lax.cond, jax.jit: its values live in an inner trace); give fp8_ranges a loss_fn that calls "
          "the layers directly")


def run_capture(jitted, *args):
    """`jitted(*args)` (a jitted `capture`), with an op's values leaked from an inner trace told in one line."""
    try:
        return jitted(*args)
    except jax.errors.UnexpectedTracerError:
        raise ValueError(_INNER) from None


def ranges_table(captured: dict, grads: dict) -> list[dict]:
    """`fp8_ranges`'s rows from `capture`'s output.

    Raises:
      ValueError: no FP8 op was recorded, or the values are tracers (called inside `jax.jit` / `nnx.jit`).
    """
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((captured, grads))):
        raise ValueError("fp8_ranges returns host floats: call it outside jax.jit / nnx.jit")
    if not captured:
        raise ValueError("the loss calls no FP8 op (Flax Fp8DirectDotGeneralOp / Fp8Einsum, jaxamp.nnx.Fp8DotGeneral "
                         "/ Fp8Einsum) where fp8_ranges can see it: an op inside a function that jax.jit or nnx.jit "
                         "compiled before is not traced again; give fp8_ranges a loss_fn that calls the layers "
                         "directly")
    captured, grads = jax.device_get((captured, grads))
    rows = []
    for layer, c in captured.items():
        values = {"input": c["input"], "kernel": c["kernel"], "output_grad": grads[layer]}
        formats = tuple(_FORMAT_KEYS[int(code)] for code in c["formats"])
        for tensor, (_, scale_name, history_name) in _TENSORS.items():
            rows.append(_row(layer, tensor, np.asarray(values[tensor]), np.asarray(c[history_name]),
                             np.asarray(c[scale_name]), formats))
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
