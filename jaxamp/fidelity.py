"""Gradient fidelity: how far a mixed-precision gradient is from the float32 one, leaf by leaf.

`grad_fidelity(state, batch, loss_fn)` recomputes the step's gradient twice on the same batch, params and rng: once
as `train_step` does (the state's policy and loss scale) and once under a float32 policy with no loss scale. Each
trainable leaf's relative L2 error `||g_mixed - g_f32|| / ||g_f32||` says where precision is lost. Matmul kernels
cost about 2^-8 (bfloat16) or 2^-11 (float16) relative per element, which averages down in a leaf's norm; a leaf far
above the median of the others points at an accumulation done in half precision, e.g. an embedding lookup whose
gradient is a half-precision scatter-add (`jaxamp.layers` explains and fixes that one).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import jmp

from jaxamp.audit import PrecisionWarning
from jaxamp.autocasting import float32_reference
from jaxamp.fp8_collection import merge_fp8, split_fp8
from jaxamp.fp8_report import fp8_bypassed
from jaxamp.gradients import LossFn, gradients
from jaxamp.loss_scale import NoOpLossScale
from jaxamp.precision import leaf_path
from jaxamp.state import TrainState
from jaxamp.step import check_options

PyTree = Any

__all__ = ["NEAR_ZERO", "errors", "fidelity_report", "global_errors", "grad_fidelity", "gradient_pair", "near_zero",
           "whole_error", "worst"]
_F32 = jmp.Policy(jnp.float32, jnp.float32, jnp.float32)


def grad_fidelity(state: TrainState, batch: PyTree, loss_fn: LossFn, *, accum_steps: int = 1,
                  reference_loss_fn: LossFn | None = None, axis_name: Any = None,
                  carry: PyTree = None) -> dict[str, jax.Array]:
    """Relative L2 error of each trainable leaf's mixed-precision gradient against a float32 recomputation.

    Both gradients are unscaled float32 (the reference's matmuls at full float32 precision, `"highest"`: not TF32
    on a GPU), of the same batch with the same params and the step's rng
    (`fold_in(state.rng, state.step)`, as `train_step` draws it), so dropout masks agree. Jit-able; costs two
    forward and backward passes. Nothing in `state` changes.

    Args:
      state: the `TrainState` (its policy and loss scale make the mixed-precision gradient).
      batch: the batch, as `train_step` takes it.
      loss_fn: as for `train_step`. The float32 recomputation hands it float32 params and runs it under
        `jaxamp.float32_reference`: every floating value float32 at trace level, also where the model fixes its own
        dtype (Flax's and Hugging Face's `dtype=jnp.bfloat16` in a config casts to float32 there), so the two sides
        never both run in half precision.
      accum_steps: micro-batches, as for `train_step`.
      reference_loss_fn: the loss of the float32 recomputation instead, for a model whose precision cannot be
        overridden (it gets the params without the FP8 collection). None = `loss_fn` under `float32_reference`, or,
        with FP8 ops (the params hold an FP8 collection), `loss_fn` with those bypassed: each computes its plain
        matmul in float32 (`fp8_report.fp8_bypassed`), so the error includes what FP8 costs.
      axis_name: inside `jax.pmap` or `shard_map`, the mapped axis: both gradients are averaged over it first (as
        `train_step(..., axis_name=...)` averages them), so every device reports the errors of the gradients the
        step applies.
      carry: a stateful loss's state. None = the state's `model_state` (BatchNorm statistics, which `train_step`
        hands the loss as its fourth argument), or none when the state has none. Both passes start from it; the new
        state they return is dropped.

    Returns:
      `{leaf path: f32[] error}`, keys as `jaxamp.precision.leaf_path` writes them (`"h_0/mlp/c_fc/kernel"`);
      inf where the mixed-precision gradient is not finite (the loss scale overflowed it: `train_step` would skip
      this step; called outside `jit`, a `PrecisionWarning` says so); 0 where both gradients are exactly 0.

    Raises:
      ValueError: a bad `loss_fn` or `accum_steps` (one line, as `train_step` says).
    """
    mixed, exact = gradient_pair(state, batch, loss_fn, accum_steps=accum_steps, reference_loss_fn=reference_loss_fn,
                                 carry=carry)
    if axis_name is not None:
        mixed, exact = jax.lax.pmean((mixed, exact), axis_name)
    _warn_if_overflowed(mixed, state, "grad_fidelity")
    return errors(mixed, exact)


def _warn_if_overflowed(mixed: PyTree, state: TrainState, caller: str) -> None:
    """Outside `jit` (concrete gradients): a `PrecisionWarning` when the mixed-precision gradient is not finite, so
    that its errors read inf. Under `jit` nothing can be read: the errors say it (inf)."""
    leaves = jax.tree.leaves(mixed)
    if not leaves or any(isinstance(g, jax.core.Tracer) for g in leaves) or bool(
            jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in leaves]))):  # (one transfer)
        return
    scale = state.loss_scale.loss_scale
    scale = "?" if isinstance(scale, jax.core.Tracer) else f"{float(scale):g}"
    warnings.warn(f"{caller}: the mixed-precision gradient is not finite at loss scale {scale} (train_step would "
                  "skip this step), so the non-finite leaves' errors read inf; measure at a state whose step applies: "
                  "a smaller scale (state.replace(loss_scale=...)) or the state after the dynamic scale backed off",
                  PrecisionWarning, stacklevel=3)


def errors(mixed: PyTree, exact: PyTree) -> dict[str, jax.Array]:
    """`{leaf path: f32[] relative L2 error}` of two gradient trees of the same structure."""
    flat, _ = jax.tree_util.tree_flatten_with_path(mixed)
    refs = jax.tree.leaves(exact)
    return {leaf_path(path): _rel_err(g, r) for (path, g), r in zip(flat, refs)}


def gradient_pair(state: TrainState, batch: PyTree, loss_fn: LossFn, *, accum_steps: int = 1,
                  reference_loss_fn: LossFn | None = None, carry: PyTree = None) -> tuple[PyTree, PyTree]:
    """`(mixed, float32)`: the unscaled float32 gradients of the trainable params as `train_step` computes them, and
    the same under a float32 policy with no loss scale (same batch, params and rng; `reference_loss_fn`, if given,
    on the params without the FP8 collection). With a `carry` (None = the state's `model_state`, if any), `loss_fn`
    is stateful as for `jaxamp.step.train_step_with_carry` (BatchNorm statistics, `jaxamp.nnx`'s RNG counts), and
    both passes run it through the micro-batches from the same `carry`. Jit-able.

    Raises:
      ValueError: a bad `loss_fn` or `accum_steps`, as `train_step` says.
    """
    carry = state.model_state if carry is None else carry
    check_options(loss_fn, accum_steps, caller="grad_fidelity",
                  loss_args=("params", "batch", "rng") + (() if carry is None else ("model_state",)))
    rng = jax.random.fold_in(state.rng, state.step)
    mixed = gradients(state, batch, loss_fn, state.loss_scale, rng, accum_steps, False, carry).grads
    return mixed, _reference(state, batch, loss_fn, rng, accum_steps, reference_loss_fn, carry)


def _reference(state, batch, loss_fn, rng, accum_steps, reference_loss_fn, carry, params=None) -> PyTree:
    """The float32 gradient of the same batch and rng (at `params` instead of the state's, if given)."""
    reference = state.replace(policy=_F32, params=state.params if params is None else params)
    if reference_loss_fn is not None:
        reference = reference.replace(params=split_fp8(reference.params)[0])
    elif split_fp8(state.params)[1] is not None:
        reference_loss_fn = _without_fp8(loss_fn)
    else:  # float32 at trace level, also where the model fixes its own dtype (`dtype=jnp.bfloat16` in its config)
        reference_loss_fn = float32_reference(loss_fn)
    # Full float32 matmuls (not TF32 on a GPU). Also part of jit's cache key: a jitted function inside loss_fn is
    # traced again for the reference, so its FP8 ops are bypassed there, and its cached FP8 trace stays as it was.
    with jax.default_matmul_precision("highest"):
        return gradients(reference, batch, reference_loss_fn or loss_fn, NoOpLossScale(), rng, accum_steps,
                         False, carry).grads


def fidelity_report(state: TrainState, batch: PyTree, loss_fn: LossFn, *, accum_steps: int = 1,
                    reference_loss_fn: LossFn | None = None, noise_floor: Any = False,
                    carry: PyTree = None) -> dict:
    """`grad_fidelity` with what it takes to read it: each leaf's error relative to its own float32 gradient and
    to the whole gradient's norm, which leaves have a float32 gradient near zero beside the others, and optionally
    each leaf's noise floor.

    A leaf whose true gradient is about 0 (a bias just before a normalisation, an attention key bias: a softmax
    ignores a per-row shift) has a meaningless relative error (rounding noise over a tiny norm, 1e2-1e8 %): it is
    marked `near_zero` (its float32 gradient's RMS below `NEAR_ZERO` times the whole gradient's RMS) and `worst`
    passes it over. The error relative to the global norm, `||g_leaf - ref_leaf|| / ||ref||`, stays meaningful for
    every leaf. Jit-able; costs two (three with `noise_floor`) forward and backward passes.

    Args:
      state, batch, loss_fn, accum_steps, reference_loss_fn: as for `grad_fidelity`.
      noise_floor: also compute each leaf's relative error between the float32 gradient at the master weights and
        the float32 gradient at the weights rounded once to the compute dtype (True) or to the dtype given (e.g.
        `jnp.bfloat16` for a float16 policy too): what rounding the weights alone costs (an ill-conditioned model
        at init moves a lot from that alone). Static under jit. True under a float32 policy warns (a
        `PrecisionWarning`: every floor would read 0; pass the model's own dtype).
      carry: a stateful loss's state, as for `grad_fidelity` (None = the state's `model_state`, if any).

    Returns:
      A dict of dicts keyed as `grad_fidelity`'s result (`{path: value}`): `rel_err` (f32[] per leaf, as
      `grad_fidelity`), `global_rel_err` (f32[] per leaf), `near_zero` (bool[] per leaf) and, with `noise_floor`,
      `noise_floor` (f32[] per leaf). A mixed-precision gradient that is not finite reads inf, with a
      `PrecisionWarning` outside `jit` (as `grad_fidelity`).

    Raises:
      ValueError: as `grad_fidelity`.
    """
    carry = state.model_state if carry is None else carry
    mixed, exact = gradient_pair(state, batch, loss_fn, accum_steps=accum_steps,
                                 reference_loss_fn=reference_loss_fn, carry=carry)
    _warn_if_overflowed(mixed, state, "fidelity_report")
    report = {"rel_err": errors(mixed, exact), "global_rel_err": global_errors(mixed, exact),
              "near_zero": near_zero(exact)}
    if noise_floor is not False and noise_floor is not None:  # (a dtype is falsy: len(np.dtype) == 0)
        rng = jax.random.fold_in(state.rng, state.step)
        regular, fp8 = split_fp8(state.params)
        compute = state.policy.compute_dtype if noise_floor is True else noise_floor
        if noise_floor is True and jnp.dtype(compute) == jnp.float32:
            warnings.warn("fidelity_report: noise_floor=True rounds the weights to the policy's compute dtype, "
                          "float32 here, so every floor reads 0; for a model that fixes its own half-precision "
                          "dtype (dtype=jnp.bfloat16 in its config) pass that dtype: noise_floor=jnp.bfloat16",
                          PrecisionWarning, stacklevel=2)
        rounded = jax.tree.map(lambda p: p.astype(compute).astype(p.dtype)
                               if jnp.issubdtype(p.dtype, jnp.floating) else p, regular)
        at_rounded = _reference(state, batch, loss_fn, rng, accum_steps, reference_loss_fn, carry,
                                params=merge_fp8(rounded, fp8))
        report["noise_floor"] = errors(at_rounded, exact)
    return report


# A leaf's float32 gradient RMS below this fraction of the whole gradient's RMS counts as near zero.
NEAR_ZERO = 1e-3


def near_zero(exact: PyTree) -> dict[str, jax.Array]:
    """`{leaf path: bool[]}`: True where the leaf's float32 gradient RMS is below `NEAR_ZERO` times the RMS of the
    whole gradient (all leaves together)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(exact)
    size = sum(max(g.size, 1) for _, g in flat) or 1
    total = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for _, g in flat)
    global_rms = jnp.sqrt(total / size)
    return {leaf_path(path): jnp.sqrt(jnp.sum(jnp.square(g.astype(jnp.float32))) / max(g.size, 1))
            < NEAR_ZERO * global_rms for path, g in flat}


def global_errors(mixed: PyTree, exact: PyTree) -> dict[str, jax.Array]:
    """`{leaf path: f32[] ||g_leaf - ref_leaf|| / ||ref||}`: each leaf's error relative to the whole float32
    gradient's norm (inf where the leaf is not finite)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(mixed)
    refs = jax.tree.leaves(exact)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(r)) for r in refs))
    safe = jnp.where(norm > 0, norm, 1.0)
    return {leaf_path(path): jnp.where(jnp.all(jnp.isfinite(g)), jnp.sqrt(jnp.sum(jnp.square(g - r))) / safe,
                                       jnp.inf).astype(jnp.float32)
            for (path, g), r in zip(flat, refs)}


def _without_fp8(loss_fn: LossFn) -> LossFn:
    """`loss_fn` traced with every FP8 op computing its plain matmul (the FP8 variables are read by no one)."""

    def plain(*args):
        with fp8_bypassed() as block:
            out = loss_fn(*args)
        if not block.calls:
            raise ValueError("grad_fidelity's float32 reference bypassed no FP8 op: loss_fn calls them inside a "
                             "function that jax.jit or nnx.jit compiled before (its cached trace keeps FP8); call the "
                             "layers directly in loss_fn, or pass reference_loss_fn (the model without FP8 ops)")
        return out

    return plain


def _rel_err(g: jax.Array, ref: jax.Array) -> jax.Array:
    """`||g - ref|| / ||ref||` in float32 (0 when both are 0, inf when `g` is not finite or `ref` is 0 alone)."""
    diff = jnp.sqrt(jnp.sum(jnp.square(g - ref)))
    norm = jnp.sqrt(jnp.sum(jnp.square(ref)))
    err = jnp.where(norm > 0, diff / jnp.where(norm > 0, norm, 1.0), jnp.where(diff > 0, jnp.inf, 0.0))
    return jnp.where(jnp.all(jnp.isfinite(g)), err, jnp.inf).astype(jnp.float32)


def worst(errors: dict, k: int = 3, near_zero: dict | None = None) -> list[tuple[str, float]]:
    """The `k` leaves with the largest errors (host floats), largest first; leaves marked in `near_zero` (see
    `fidelity_report`) are passed over."""
    skip = {name for name, flag in jax.device_get(near_zero or {}).items() if bool(flag)}
    host = {name: float(value) for name, value in jax.device_get(errors).items() if name not in skip}
    return sorted(host.items(), key=lambda kv: -kv[1])[:k]


def whole_error(global_rel_err: dict) -> jax.Array:
    """The whole gradient's error `||g - ref|| / ||ref||` over every leaf (f32[]), from `fidelity_report`'s
    `global_rel_err` (each leaf's `||g_leaf - ref_leaf|| / ||ref||`: their squares add up); inf where a leaf is.
    The "whole-gradient error" of the FP8 guide's tables. Jit-able."""
    values = [jnp.asarray(v, jnp.float32) for v in jax.tree.leaves(global_rel_err)]
    if not values:
        return jnp.float32(0.0)
    values = jnp.abs(jnp.stack(values))
    top = jnp.max(values)  # scaled by the largest: no square overflows or underflows
    safe = jnp.where(jnp.isfinite(top) & (top > 0), top, 1.0)
    return jnp.where(jnp.isfinite(top) & (top > 0), top * jnp.sqrt(jnp.sum(jnp.square(values / safe))), top)
