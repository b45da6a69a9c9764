"""Steps 1-5 of `train_step`: the compute-dtype params -> the scaled float32 loss -> its gradient -> unscaled float32,
averaged over micro-batches. Pure and jit-able; `jaxamp.step` adds the finite check, the update and the loss scale,
`jaxamp.fidelity` calls it twice (mixed precision and float32).

A stateful loss (`jaxamp.nnx`'s BatchNorm statistics and RNG counts) runs through the micro-batches as a `carry`:
`loss_fn(params, batch, rng, carry) -> (loss | (loss, aux), new_carry)`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from jaxamp import fp8_collection as fp8c
from jaxamp.autocasting import FLOAT32_RESULTS, FP8_EXCLUDE, autocast
from jaxamp.grad_stats import underflow_stats
from jaxamp.precision import fp8_recipe, uses_autocast
from jaxamp.state import TrainState
from jaxamp.trainable import merge_frozen, split_frozen

PyTree = Any
LossFn = Callable[[PyTree, PyTree, Any], Any]

__all__ = ["Grads", "LossFn", "WeightedLoss", "compute_loss", "gradients", "split_loss", "split_stateful",
           "split_weighted", "traced_gradients"]


class WeightedLoss(NamedTuple):
    """A loss normalised by the step's count of what it averages (tokens), for exact gradient accumulation.

    Return it from `loss_fn` (alone or as `(WeightedLoss(...), aux)`) instead of a mean when micro-batches hold
    different counts (a masked, padded batch): `train_step` then takes the mean over the whole step,
    `sum(total_i) / sum(count_i)` over its micro-batches (and devices, with `axis_name`), and its gradient, exact to
    float32 rounding against the full batch. A mean of the micro-batches' means would weight a micro-batch of 6
    tokens as much as one of 23 (transformers #24725). Each micro-batch is differentiated as its own mean,
    `total / max(count, 1)` (so a float16 loss scale sees mean-sized gradients), and weighted by its count.

    Its fields: `total`, f32[] the sum of the per-token losses (masked tokens excluded), and `count`, f32[] (or an
    integer) how many tokens `total` sums (>= 0; a micro-batch of 0 contributes nothing).
    """

    total: Any
    count: Any


def split_loss(out) -> tuple[jax.Array, Any]:
    """`loss_fn` returns a scalar loss or `(loss, aux)`; returns `(f32[] loss, aux or None)`. A `WeightedLoss` comes
    back as its mean, `total / max(count, 1)` (see `split_weighted`).

    Raises:
      ValueError: anything else (a list, a dict, a 3-tuple, None, a non-scalar or a non-float loss).
    """
    loss, aux, _ = split_weighted(out)
    return loss, aux


def split_weighted(out) -> tuple[jax.Array, Any, jax.Array | None]:
    """`(f32[] loss, aux or None, f32[] count or None)` of what `loss_fn` returned; for a `WeightedLoss` the loss is
    its mean over its count and the count is returned too (None for a plain loss).

    Raises:
      ValueError: as `split_loss`.
    """
    if isinstance(out, WeightedLoss):
        out = (out, None)
    if isinstance(out, tuple) and not isinstance(out, WeightedLoss) and len(out) == 2 \
            and isinstance(out[0], WeightedLoss):
        weighted, aux = out
        count = _scalar(weighted.count, "WeightedLoss.count")
        total = _scalar(weighted.total, "WeightedLoss.total")
        return total / jnp.maximum(count, 1.0), aux, count
    if isinstance(out, tuple) and len(out) != 2 or isinstance(out, (list, dict)) or out is None:
        what = f"a {len(out)}-tuple" if isinstance(out, tuple) else type(out).__name__
        raise ValueError(f"loss_fn must return a scalar loss or a (loss, aux) tuple, got {what}; put everything "
                         "besides the loss into aux, e.g. return loss, {'accuracy': acc}")
    loss, aux = out if isinstance(out, tuple) else (out, None)
    return _scalar(loss, "loss"), aux, None


def _scalar(loss, what: str) -> jax.Array:
    loss = jnp.asarray(loss)
    if loss.shape != ():
        raise ValueError(f"loss_fn must return a scalar {what} (or (loss, aux)), got shape {loss.shape}")
    if not jnp.issubdtype(loss.dtype, jnp.floating) and what != "WeightedLoss.count":
        raise ValueError(f"loss_fn must return a real floating-point {what}, got {loss.dtype} (an integer loss has "
                         "no gradient; a complex one has no order)")
    return loss.astype(jnp.float32)


class Grads(NamedTuple):
    """The gradients of one step, before the finite check."""

    grads: PyTree  # float32, unscaled, like the trainable params (None at frozen leaves)
    loss: jax.Array  # f32[] unscaled mean loss
    aux: Any  # loss_fn's aux (stacked [accum_steps, ...] under accumulation) or None
    stats: Any  # underflow_stats dict (averaged over micro-batches; min headroom) or None
    fp8: Any = None  # the FP8 collection's new values (float32, loss-scale free), or None without FP8 ops
    carry: Any = None  # a stateful loss_fn's state after the step's micro-batches, or None
    weight: Any = None  # f32[] the WeightedLoss counts summed over micro-batches (and devices), or None


def _micro_grads(loss_fn, loss_scale, params_c, batch, rng, carry=None):
    """Scaled loss -> gradients w.r.t. the trainable compute-dtype params (still scaled, in the compute dtype), the
    FP8 collection's new values (loss-scale free) and, for a stateful `loss_fn`, its new state.

    `params_c` is `(trainable, frozen, fp8)`: frozen leaves enter the loss as constants; the FP8 collection (None
    without FP8 ops) is "differentiated" too, since Flax's FP8 ops return its new values as its gradient
    (`jaxamp.fp8_collection`).
    """
    train_c, frozen_c, fp8 = params_c

    def scaled_loss(train, fp8_scaled, frozen_c, batch, rng, carry, loss_scale):
        params = fp8c.merge_fp8(merge_frozen(train, frozen_c), fp8c.loss_input(fp8_scaled))
        if carry is None:
            out, new_carry = loss_fn(params, batch, rng), None
        else:
            out, new_carry = split_stateful(loss_fn(params, batch, rng, carry))
        loss, aux, count = split_weighted(out)
        return loss_scale.scale(loss), (loss, aux, new_carry, count)

    grad_fn = fp8c.differentiable(jax.grad(scaled_loss, argnums=(0, 1), has_aux=True), fp8)
    (grads_c, fp8_grad), (loss, aux, new_carry, count) = grad_fn(
        train_c, fp8c.scaled(fp8, loss_scale), frozen_c, batch, rng, carry, loss_scale)
    return grads_c, loss, fp8c.as_float32(aux), fp8c.new_values(fp8_grad, loss_scale), new_carry, count


def split_stateful(result) -> tuple[Any, Any]:
    """`(loss | (loss, aux), new_state)` as a stateful `loss_fn(params, batch, rng, model_state)` returns it.

    Raises:
      TypeError: `result` is not such a pair (a bare loss: the new model state is missing).
    """
    if isinstance(result, (tuple, list)) and len(result) == 2:
        return result[0], result[1]
    what = (f"an array of shape {tuple(result.shape)}" if hasattr(result, "shape") else
            f"a {type(result).__name__}" + (f" of {len(result)}" if isinstance(result, (tuple, list)) else ""))
    raise TypeError(f"with a model state, loss_fn(params, batch, rng, model_state) must return (loss, "
                    f"new_model_state) or ((loss, aux), new_model_state); it returned {what}. Return the state too "
                    "(the one it received when nothing changes it, e.g. when rng is None)")


def compute_loss(policy, loss_fn: Callable) -> Callable:
    """`loss_fn` as the policy runs it on its compute copy of the params: as it is (the params arrive cast), or
    under `jaxamp.autocast` with the compute dtype for an autocast policy (the params arrive float32)."""
    if not uses_autocast(policy):
        return loss_fn
    return autocast(loss_fn, policy.compute_dtype, fp8=fp8_recipe(policy),
                    fp8_exclude=getattr(policy, "fp8_exclude", FP8_EXCLUDE),
                    float32_results=getattr(policy, "float32_results", FLOAT32_RESULTS))


def split_micro(batch: PyTree, accum_steps: int) -> PyTree:
    """Every leaf `[batch, ...]` -> `[accum_steps, batch // accum_steps, ...]`; every leaf must share `batch`.

    Micro-batch i holds rows i, i + accum_steps, ... (strided): under a batch sharded by rows every device holds
    its share of every micro-batch, so no rows move between devices.

    Raises:
      ValueError: the leaves differ in leading size, or `accum_steps` does not divide it.
    """
    shapes = {jax.tree_util.keystr(path): jnp.shape(x) for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]}
    if len({shape[:1] for shape in shapes.values()}) > 1:
        listed = ", ".join(f"batch{name}: {shape}" for name, shape in list(shapes.items())[:6])
        raise ValueError(f"accum_steps={accum_steps} splits every batch leaf along its leading (batch) axis, so every "
                         f"leaf needs the same leading size; got {listed}. Keep per-step constants such as class "
                         "weights out of the batch (e.g. close over them in loss_fn)")
    for name, shape in shapes.items():
        if not shape or shape[0] % accum_steps:
            raise ValueError(f"accum_steps={accum_steps} must divide the batch's leading axis, but batch{name} has "
                             f"shape {shape}")

    def split(x):
        x = jnp.asarray(x)
        x = x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:])  # [micro_batch, accum, ...]
        return jnp.swapaxes(x, 0, 1)  # [accum, micro_batch, ...]

    return jax.tree.map(split, batch)


def gradients(state: TrainState, batch: PyTree, loss_fn: Callable, loss_scale, rng: jax.Array, accum_steps: int = 1,
              with_stats: bool = False, carry: PyTree = None, axis_name: Any = None) -> Grads:
    """Float32 unscaled gradients of `state`'s trainable params under its policy, scaled by `loss_scale`.

    Steps 1-5 of `train_step`: cast the master params to the compute dtype, the loss in float32, times the loss
    scale, the gradient with respect to the compute-dtype params, unscaled in float32; with `accum_steps` > 1 per
    micro-batch (one `lax.scan`, a float32 accumulator), averaged (a `WeightedLoss` weighted by its counts). The FP8
    collection's new values combine over micro-batches by element-wise maximum. A stateful `loss_fn`'s `carry` runs
    through the micro-batches in order. With `axis_name` (inside `jax.pmap` or `shard_map`) the gradients, the loss
    and the statistics are averaged over that axis (a `WeightedLoss` by its counts), so every device holds the same.

    Args:
      state: the `TrainState` (its params, policy and trainable mask).
      batch: as `train_step` takes it.
      loss_fn: `loss_fn(params, batch, rng)`, or `loss_fn(params, batch, rng, carry)` with a `carry`.
      loss_scale: the loss scale to compute with (the state's, or a backed-off one when retrying).
      rng: the step's key (folded with the micro-batch index under accumulation).
      accum_steps: micro-batches.
      with_stats: also return `jaxamp.grad_stats.underflow_stats` of the scaled gradients.
      carry: the stateful loss's state, or None.
      axis_name: a mapped axis to average over (`jax.pmap(..., axis_name=...)`, `shard_map`), or None.

    Returns:
      A `Grads`.
    """
    loss_fn = compute_loss(state.policy, loss_fn)
    regular, fp8 = fp8c.split_fp8(state.params)
    train_c, frozen_c = split_frozen(state.policy.cast_to_compute(regular), state.trainable)
    params_c = (train_c, frozen_c, fp8)
    stats_of = _stats_of(state.policy) if with_stats else (lambda g: None)
    if accum_steps == 1:
        grads_c, loss, aux, fp8_new, carry, count = _micro_grads(loss_fn, loss_scale, params_c, batch, rng, carry)
        g = Grads(loss_scale.unscale(grads_c), loss, aux, stats_of(grads_c), fp8_new, carry, count)
    else:
        g = _accumulated(loss_fn, loss_scale, params_c, state, batch, rng, accum_steps, stats_of, with_stats, carry)
    return _across_devices(g, axis_name)


def traced_gradients(state: TrainState, batch: PyTree, loss_fn: Callable, loss_scale, rng: jax.Array,
                     accum_steps: int = 1, with_stats: bool = False, carry: PyTree = None,
                     axis_name: Any = None) -> tuple[Grads, Any]:
    """`gradients`, traced once to a program that is then run, and that program: `(Grads, closed jaxpr)`.

    `train_step` reads the program (`jaxamp.audit`: what runs in which precision, forward and backward) and runs
    the very same one, so `loss_fn` is traced once per compilation, audit included. Inside an outer `jit`, `pmap`
    or `shard_map` the program is bound into the caller's trace, as a direct call would be.
    """

    def run(state, batch, loss_scale, rng, carry):
        return gradients(state, batch, loss_fn, loss_scale, rng, accum_steps, with_stats, carry, axis_name)

    args = (state, batch, loss_scale, rng, carry)
    closed, shapes = jax.make_jaxpr(run, return_shape=True)(*args)
    out = jex_core.jaxpr_as_fun(closed)(*jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(shapes), out), closed


def _accumulated(loss_fn, loss_scale, params_c, state, batch, rng, accum_steps, stats_of, with_stats, carry) -> Grads:
    """`gradients` over `accum_steps` micro-batches in one `lax.scan`: float32 sums weighted by each micro-batch's
    count (1 for a plain loss: then the mean of the micro-batches)."""
    weighted = []  # set while the body is traced: whether loss_fn returns a WeightedLoss

    def body(scan_carry, xs):
        acc, loss_sum, weight_sum, stats_acc, fp8_acc, carry = scan_carry
        micro, i = xs
        grads_c, loss, aux, fp8_new, carry, count = _micro_grads(loss_fn, loss_scale, params_c, micro,
                                                                 jax.random.fold_in(rng, i), carry)
        weighted.append(count is not None)
        w = jnp.ones((), jnp.float32) if count is None else count
        acc = jax.tree.map(lambda a, g: a + w * g, acc, loss_scale.unscale(grads_c))
        stats = stats_of(grads_c)
        if stats is not None:
            stats = stats if stats_acc is None else _combine_stats(stats_acc, stats)
        return (acc, loss_sum + w * loss, weight_sum + w, stats, fp8c.combine(fp8_acc, fp8_new), carry), aux

    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), state.trainable_params())
    zero = jnp.zeros((), jnp.float32)
    (acc, loss_sum, weight_sum, stats, fp8_new, carry), aux = jax.lax.scan(
        body, (zeros, zero, zero, _initial_stats(params_c[0], with_stats), fp8c.zeros_like(params_c[2]), carry),
        (split_micro(batch, accum_steps), jnp.arange(accum_steps)))
    if stats is not None:
        stats = {k: (jax.tree.map(lambda v: v / accum_steps, v) if "zero" in k else v) for k, v in stats.items()}
    total = jnp.maximum(weight_sum, 1.0)  # accum_steps for a plain loss; a step of 0 tokens has zero gradients
    grads = jax.tree.map(lambda g: g / total, acc)
    return Grads(grads, loss_sum / total, aux, stats, fp8_new, carry, weight_sum if weighted[0] else None)


def _across_devices(g: Grads, axis_name) -> Grads:
    """`g` averaged over the mapped axis `axis_name` (None: as it is): the gradients and the loss by the mean (a
    `WeightedLoss` by its counts), zero fractions by the mean and headroom by the minimum, the FP8 collection's new
    values by the maximum. The carry and aux stay per device."""
    if axis_name is None:
        return g
    if g.weight is None:
        grads, loss, weight = jax.lax.pmean((g.grads, g.loss), axis_name) + (None,)
    else:
        weight = jax.lax.psum(g.weight, axis_name)
        total = jnp.maximum(weight, 1.0)
        grads = jax.tree.map(lambda x: jax.lax.psum(x * g.weight, axis_name) / total, g.grads)
        loss = jax.lax.psum(g.loss * g.weight, axis_name) / total
    stats = None if g.stats is None else {
        k: jax.lax.pmean(v, axis_name) if "zero" in k else jax.lax.pmin(v, axis_name) for k, v in g.stats.items()}
    fp8 = jax.tree.map(lambda x: jax.lax.pmax(x, axis_name), g.fp8)
    return g._replace(grads=grads, loss=loss, stats=stats, fp8=fp8, weight=weight)


def _stats_of(policy) -> Callable:
    """`underflow_stats` against the compute dtype's range under autocast (the params' gradients are float32, the
    backward GEMMs ran in the compute dtype), against each leaf's own dtype otherwise."""
    return functools.partial(underflow_stats, dtype=policy.compute_dtype if uses_autocast(policy) else None)


def _initial_stats(train_c: PyTree, with_stats: bool):
    """The accumulator of `underflow_stats` over micro-batches: zero fractions at 0 (sums), headroom at +inf
    (minima); None without stats."""
    if not with_stats:
        return None
    shapes = jax.eval_shape(underflow_stats, train_c)
    return {k: jax.tree.map(lambda s, k=k: jnp.full(s.shape, 0.0 if "zero" in k else jnp.inf, s.dtype), v)
            for k, v in shapes.items()}


def _combine_stats(acc: dict, new: dict) -> dict:
    """Running sums of zero fractions and minima of headroom over micro-batches."""
    return {k: jax.tree.map(jnp.add if "zero" in k else jnp.minimum, acc[k], new[k]) for k in acc}


def check_loss_args(loss_fn, loss_args: tuple[str, ...], caller: str) -> None:
    """A TypeError, before any tracing, when `loss_fn` cannot be called with `len(loss_args)` positional arguments
    (`("params", "batch", "rng")`: a `loss_fn(params, batch)` without the rng); the message names the call and
    the fix. Functions whose signature Python cannot read pass."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*loss_args)
    except TypeError as err:
        call = f"loss_fn({', '.join(loss_args)})"
        fix = {"rng": "; take the rng even if it goes unused (def loss_fn(params, batch, rng=None)): eval_step "
                      "passes rng=None",
               "model_state": "; with model_state= it also takes the model state and returns (loss, "
                              "new_model_state)"}.get(loss_args[-1], "")
        raise TypeError(f"{caller} calls {call}, but {getattr(loss_fn, '__name__', 'loss_fn')}{signature} cannot "
                        f"take it ({err}){fix}") from None
