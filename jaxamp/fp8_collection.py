"""The rules of the FP8 collection inside a training step: Flax's delayed-scaling FP8 state.

Flax's FP8 ops (`nn.Fp8DirectDotGeneralOp`, `nn.Fp8Einsum`, `jaxamp.layers.Dense(fp8=True)`, `jaxamp.nnx`'s FP8
modules through `jaxamp.nnx`) keep per-tensor scales (`f32[1]`) and amax histories (`f32[history]`) of their input,
kernel and output gradient in the `"_overwrite_with_gradient"` collection of the model's variables. Their "gradient"
is their *new value* (Transformer Engine's delayed scaling: the scale of step t comes from the amax history up to
t - 1). So the step treats that collection apart from the master weights:

- it is never cast to the compute dtype, never unscaled or averaged as a gradient, and takes no part in `grad_norm`,
  clipping, weight decay or the optax update (the optimizer holds no state for it);
- it is stored loss-scale free: the output-gradient entries are multiplied by the loss scale on the way into the
  loss (`scaled`) and divided on the way out (`new_values`), exact for power-of-2 scales, so the FP8 state does not
  depend on the scale;
- it enters the loss as Flax's `fp32_max_grad` ("fm32") dtype, whose cotangents add by maximum (`loss_input`): an op
  called several times in one loss (a weight-shared layer) records the largest of its calls' amax, not their sum;
- under gradient accumulation the micro-batches' new values combine by element-wise maximum (`combine`);
- its new amax values count in the finite check (FP8 clips an overflowed output gradient to e5m2's range, so only
  its amax shows the overflow);
- an op the loss does not call (an unused layer, a `lax.cond` branch not taken) keeps its values, and on a skipped
  step the whole collection stays bitwise unchanged with the params (`select`).

None stands for "no FP8 collection" everywhere: it is an empty pytree, so every function here is the identity on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.core
import jax
import jax.numpy as jnp
import jmp
from flax.linen import fp8_ops

from jaxamp.precision import policy_name, uses_fp8

PyTree = Any

# Flax's FP8 ops keep their scales and amax histories in this collection; the "gradient" of each is its new value.
FP8_COLLECTION = "_overwrite_with_gradient"
_FP8_TENSORS = ("input", "kernel", "output_grad")

__all__ = ["FP8_COLLECTION", "as_float32", "check_policy", "combine", "differentiable", "loss_input", "merge_fp8",
           "new_values", "scaled", "select", "split_fp8", "zeros_like"]


def split_fp8(params: PyTree) -> tuple[PyTree, PyTree]:
    """`(params without the FP8 collection, the FP8 collection or None)` of a variables dict."""
    if isinstance(params, (dict, flax.core.FrozenDict)) and FP8_COLLECTION in params:
        rest = {k: v for k, v in params.items() if k != FP8_COLLECTION}
        frozen = isinstance(params, flax.core.FrozenDict)
        return (flax.core.FrozenDict(rest) if frozen else rest), params[FP8_COLLECTION]
    return params, None


def merge_fp8(params: PyTree, fp8: PyTree) -> PyTree:
    """The inverse of `split_fp8`."""
    if fp8 is None:
        return params
    merged = {**params, FP8_COLLECTION: fp8}
    return flax.core.FrozenDict(merged) if isinstance(params, flax.core.FrozenDict) else merged


def check_policy(policy: jmp.Policy, params: PyTree) -> None:
    """An FP8 policy needs the model's FP8 state: refuses params without (an empty) FP8 collection.

    Raises:
      ValueError: `policy` asks for FP8 (`"fp8"`, `";fp8"`) and `params` hold no FP8 values.
    """
    if uses_fp8(policy) and not jax.tree.leaves(split_fp8(params)[1]):
        raise ValueError(f"policy {policy_name(policy)!r} trains FP8 matmuls through the model's own FP8 ops, but "
                         f"params hold no FP8 collection ({FP8_COLLECTION!r}): build the model with FP8 ops "
                         "(jaxamp.layers.Dense(fp8=True), nn.Fp8DirectDotGeneralOp, jaxamp.nnx.Fp8DotGeneral) and "
                         "pass its whole variables dict, not variables['params']; or, for FP8 matmuls in unchanged "
                         "model code, use a stateless recipe: 'fp8-current', 'fp8-block' or 'mxfp8' (or 'bf16')")


def _is_output_grad(path) -> bool:
    """Flax's FP8 entries measured on the output gradient (`output_grad_scale`, `output_grad_amax_history`)."""
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last))).startswith("output_grad")


def _in_scaled_units(fp8: PyTree, loss_scale, inverse: bool) -> PyTree:
    s = loss_scale.loss_scale

    def convert(path, x):
        if not _is_output_grad(path):
            return x
        return (x / s if inverse else x * s).astype(x.dtype)

    return jax.tree_util.tree_map_with_path(convert, fp8)


def scaled(fp8: PyTree, loss_scale) -> PyTree:
    """The stored (loss-scale free) collection in the units of the scaled backward pass: output-gradient scales and
    amax histories times the loss scale. The argument `jax.grad` differentiates."""
    return _in_scaled_units(fp8, loss_scale, inverse=False)


def loss_input(fp8_scaled: PyTree) -> PyTree:
    """Inside the differentiated loss: the collection as Flax's `fp32_max_grad` dtype (float32 whose cotangents add
    by maximum). Flax's ops compute in float32 from it; one call gives bitwise the same values as float32."""
    return jax.tree.map(lambda x: jax.lax.convert_element_type(x, fp8_ops.fp32_max_grad), fp8_scaled)


def differentiable(grad_fn: Callable, fp8: PyTree) -> Callable:
    """`grad_fn` (a `jax.grad` over `(trainable, fp8_scaled, ...)`) made fit for an FP8 collection: jitted (fm32
    cotangents add only in compiled code; inlined under an outer jit), with one clear error for the misuse that
    fm32 cannot express. Without FP8 (`fp8` None) it is `grad_fn` itself."""
    if fp8 is None:
        return grad_fn
    jitted = jax.jit(grad_fn)

    def run(*args):
        try:
            return jitted(*args)
        except TypeError as err:
            if "fp8_meta" not in str(err):
                raise
            raise ValueError("loss_fn used an FP8 scale or amax history as a number, or vmapped an FP8 layer per "
                             "example: inside the step they are Flax's fp32_max_grad dtype, which only FP8 ops compute "
                             "with (and whose amax cannot be combined over a jax.vmap axis); read them outside "
                             "loss_fn, call the layer on the whole batch, or give each mapped slice its own FP8 state "
                             "(nn.vmap / nnx.vmap of the variables)") from None

    return run


def new_values(fp8_grad: PyTree, loss_scale) -> PyTree:
    """The collection's "gradient" as its new stored values: fm32's zero (-inf, an op in a `lax.cond` branch not
    taken) becomes 0 (the mark of an op the loss did not call, see `select`), and the output-gradient entries are
    divided by the loss scale again."""
    fp8_grad = jax.tree.map(lambda x: jnp.where(x == -jnp.inf, jnp.zeros_like(x), x), fp8_grad)
    return _in_scaled_units(fp8_grad, loss_scale, inverse=True)


def as_float32(tree: PyTree) -> PyTree:
    """Leaves of Flax's fm32 dtype (an FP8 scale returned in `aux` for monitoring) as plain float32 arrays."""
    return jax.tree.map(lambda x: jax.lax.convert_element_type(x, jnp.float32)
                        if getattr(x, "dtype", None) == fp8_ops.fp32_max_grad else x, tree)


def zeros_like(fp8: PyTree) -> PyTree:
    """The identity of `combine` (scales > 0 and amax >= 0)."""
    return jax.tree.map(jnp.zeros_like, fp8)


def combine(acc: PyTree, new: PyTree) -> PyTree:
    """Two micro-batches' new values combined: the element-wise maximum (one history entry per optimizer step,
    holding the largest amax of its micro-batches, and the largest scale)."""
    return jax.tree.map(jnp.maximum, acc, new)


def _keep_uncalled(new: PyTree, old: PyTree) -> PyTree:
    """The new values, except where the loss did not call the op (its "gradient" there is 0, which as a new scale
    would make its next call divide by 0). Per op and tensor, a new scale of 0 (never a real one: scales are amax /
    format max > 0, or the old scale) keeps the old scale and history."""
    if not hasattr(new, "keys"):
        return new
    if not all(f"{t}_scale" in new for t in _FP8_TENSORS):
        return type(new)({k: _keep_uncalled(new[k], old[k]) for k in new.keys()})
    out = dict(new)
    for t in _FP8_TENSORS:
        called = new[f"{t}_scale"] > 0  # bool[..., 1]: per layer of a stacked (scanned) op
        for name in (f"{t}_scale", f"{t}_amax_history"):
            out[name] = jnp.where(called, new[name], old[name])
    return type(new)(out)


def select(grads_finite: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    """The collection after the step: the new values on an applied step (those of uncalled ops kept), the old ones
    bitwise on a skipped step (an overflowed step's inf amax would otherwise sit in the history for its length)."""
    if old is None:
        return None
    kept = _keep_uncalled(new, old)
    return jax.tree.map(lambda a, b: jax.lax.select(grads_finite, a, b), kept, old)
