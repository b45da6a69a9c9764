"""One mixed-precision update (`train_step`) and one evaluation (`eval_step`), both pure and jit-able."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxamp import audit, finite
from jaxamp import fp8_collection as fp8c
from jaxamp.fp8_collection import merge_fp8, split_fp8
from jaxamp.gradients import (
    LossFn,
    check_loss_args,
    compute_loss,
    gradients,
    split_loss,
    split_stateful,
    traced_gradients,
)
from jaxamp.metrics import step_metrics
from jaxamp.state import TrainState
from jaxamp.trainable import merge_frozen, split_frozen

PyTree = Any

__all__ = ["check_options", "eval_step", "keep_finite", "select_tree", "train_step", "train_step_with_carry"]


def select_tree(pred: jax.Array, on_true: PyTree, on_false: PyTree) -> PyTree:
    """Leaf by leaf `lax.select(pred, a, b)` for a `bool[]` pred: the unchosen tree's leaves come back bitwise."""
    return jax.tree.map(lambda a, b: jax.lax.select(pred, a, b), on_true, on_false)


def _retry(state, batch, loss_fn, rng, accum_steps, with_stats, max_retries, carry=None, axis_name=None,
           first=None):
    """Backs the scale off and recomputes the same batch until the gradients are finite (`lax.while_loop`).

    Every attempt starts from the same `rng` and `carry`, so a retried batch draws the same dropout masks.

    After the first non-finite attempt (with a finite loss) one probe runs at the lowest scale `backoff` can reach:
    if the gradients are not finite even there, the scale is not the cause (e.g. a NaN from `sqrt(0)`'s derivative)
    and no retry runs, so the step costs the scale exactly what a skip costs (one backoff by `adjust`). Returns
    `(loss_scale used, grads, check, retries, nonfinite_at_min_scale)`.
    """

    def attempt(loss_scale):
        g = gradients(state, batch, loss_fn, loss_scale, rng, accum_steps, with_stats, carry, axis_name)
        return g, finite.check(g.grads, also=g.fp8)

    def can_lower(loss_scale):
        return loss_scale.backoff().loss_scale < loss_scale.loss_scale

    first, check = (attempt(state.loss_scale) if first is None
                    else (first, finite.check(first.grads, also=first.fp8)))  # the first attempt, traced already
    # A non-finite loss comes from the forward pass or the inputs, before the scale: no scale can fix it.
    worth_trying = (~check.finite) & jnp.isfinite(first.loss) & can_lower(state.loss_scale) & (max_retries > 0)
    at_min_finite = jax.lax.cond(worth_trying, lambda: attempt(state.loss_scale.lowest())[1].finite,
                                 lambda: jnp.ones((), jnp.bool_))

    def cond(carry):
        loss_scale, g, check, retries = carry
        return (~check.finite) & jnp.isfinite(g.loss) & (retries < max_retries) & can_lower(loss_scale) \
            & at_min_finite

    def body(carry):
        loss_scale, _, _, retries = carry
        loss_scale = loss_scale.backoff()
        g, check = attempt(loss_scale)
        return loss_scale, g, check, retries + 1

    carry = jax.lax.while_loop(cond, body, (state.loss_scale, first, check, jnp.zeros((), jnp.int32)))
    return (*carry, ~at_min_finite)


def train_step(
    state: TrainState,
    batch: PyTree,
    loss_fn: LossFn,
    *,
    accum_steps: int = 1,
    on_overflow: str = "skip",
    max_retries: int = 4,
    underflow_stats: bool = False,
    axis_name: Any = None,
) -> tuple[TrainState, dict]:
    """One mixed-precision optimizer step, pure: `jax.jit(train_step, static_argnames="loss_fn", donate_argnums=0)`.

    The keyword options are static too: under `jax.jit` name those you pass, e.g.
    `jax.jit(train_step, static_argnames=("loss_fn", "accum_steps", "on_overflow"), donate_argnums=0)`.

    Order of operations (Micikevicius et al., 2018; torch.amp's autocast + GradScaler; jmp):

    1. cast the master params to the policy's compute dtype (`policy.cast_to_compute`);
    2. loss in float32: `loss_fn(compute_params, batch, rng)`, its result cast to float32;
    3. multiply the float32 loss by the loss scale;
    4. gradient with respect to the compute-dtype params (a float16 overflow arrives as inf);
    5. unscale in float32 (divide by the scale); with `accum_steps` > 1, steps 2-5 run per micro-batch and the
       float32 gradients are averaged;
    6. one finite check over every gradient leaf (`all_finite`), once per optimizer step; the same pass over the
       gradients also sums their squares for the `grad_norm` metric;
    7. optax update on the unscaled gradients, so clipping and weight decay inside `tx` never see the scale (the
       unscaled loss goes along as `value=`, for transformations that take it, e.g. `reduce_on_plateau`);
    8. apply, then select new or old `params` and `opt_state` by the finite flag: on overflow both come back bitwise
       unchanged (optax's count and any LR schedule do not advance);
    9. adjust the loss scale once (backoff or growth; a step whose loss itself is not finite leaves the scale as it
       is: no scale fixes a forward pass or an input); advance `step` (also on a skipped step) and count
       `consecutive_skips`.

    Model state (`TrainState.create(..., model_state=...)`: mutable collections such as BatchNorm's
    `batch_stats`): `loss_fn(params, batch, rng, model_state)` returns `(loss | (loss, aux), new_model_state)`; the
    micro-batches of `accum_steps` run in order, each from the state the previous one left; every retry starts from
    the step's model state. A skipped step keeps the new model state, as torch.amp keeps BatchNorm's update (the
    forward pass ran), except a float leaf whose new value is not finite: it keeps its old value bitwise.

    Token-weighted losses: `loss_fn` may return `jaxamp.WeightedLoss(total, count)` (a sum and how many tokens it
    sums) instead of a mean; the step's loss and gradient are then those of the whole step's mean,
    `sum(total) / sum(count)` over micro-batches and devices, however unevenly the tokens fall.

    Devices (`axis_name`, inside `jax.pmap(..., axis_name=...)` or `shard_map`): the gradients, the loss and the
    statistics are averaged over the axis before step 6, so the finite decision, the update and the loss scale are
    the same on every device. Under plain `jax.jit` with sharded arrays none is needed: XLA inserts the collectives.

    FP8 (Flax's `Fp8DirectDotGeneralOp`/`Fp8Einsum`, e.g. `jaxamp.layers.Dense(fp8=True)`): `state.params` is then
    the model's variables dict, and its `"_overwrite_with_gradient"` collection (per-tensor scales and amax
    histories, whose "gradient" is their new value) follows the rules of `jaxamp.fp8_collection`: never cast,
    unscaled or optimized, stored loss-scale free, combined by maximum, its amax in the finite check (step 6), kept
    bitwise on a skipped step (step 8).

    Args:
      state: the `TrainState`. Donating it is safe.
      batch: any pytree; passed to `loss_fn` as is (cast float inputs there with `policy.cast_to_compute` if wanted).
        With `accum_steps` > 1 every leaf's leading axis is split into `accum_steps` micro-batches, so every leaf
        needs the same leading (batch) size.
      loss_fn: `loss_fn(params, batch, rng) -> loss | (loss, aux)`: `params` already in the compute dtype, `rng` a
        `u32[2]` key for this step, `jax.random.fold_in(state.rng, state.step)` (folded again with the micro-batch
        index under accumulation). Static under jit (hashable).
      accum_steps: micro-batches per optimizer step (gradient accumulation in float32). Static.
      on_overflow: `"skip"` (torch.amp, jmp: drop the update, back the scale off) or `"retry"`: back the scale off
        (`loss_scale.backoff()`, ignoring hysteresis) and recompute the same batch inside this call, up to
        `max_retries` times, so no batch is lost to a too-high scale; it falls back to a skip when retries run out,
        the scale cannot go lower, the loss itself is not finite (a forward-pass or input problem that no scale
        fixes: skipped at once, one backoff), or the gradients are not finite even at the lowest scale (one probe
        there after the first overflow: then the scale is not the cause, no retry runs, and the step costs the
        scale one backoff, as a skip does). Static.
      max_retries: retries per step for `"retry"`. Static. (`"skip"` steps are differentiable, e.g. for
        hypergradients; `"retry"` runs a `lax.while_loop`, which reverse-mode differentiation does not support.)
      underflow_stats: add gradient underflow and headroom statistics to the metrics (`grad_stats.underflow_stats`).
        Static.
      axis_name: the mapped axis the batch is split over (`jax.pmap`, `shard_map`), or None. Static.

    Returns:
      `(new_state, metrics)`; metrics hold `loss` (f32[], unscaled), `loss_finite` (bool[]: False points at the
      forward pass or the inputs rather than a gradient overflow), `grad_norm` (f32[], global L2 norm of the
      unscaled gradients before clipping; inf or NaN on overflow), `loss_scale` (f32[], the scale the gradients
      were finally computed with), `grads_finite` (bool[]), `grads_finite_leaves` (a tree of bool[] like the params:
      which leaves overflowed; None at frozen leaves), `retries` (i32[]), `nonfinite_at_min_scale` (bool[], retry
      mode only: the probe at the lowest scale overflowed too, so the scale was not the cause), `consecutive_skips`
      (i32[]: skipped steps in a row, this one included; 0 after an applied step), `loss_weight` (f32[], for a
      `WeightedLoss`: the step's count), `aux` when `loss_fn` returns one, and `underflow` when asked
      (`jaxamp.metrics.STEP_METRICS` defines them all).

    Raises:
      ValueError: `loss_fn` returned something other than a float scalar or a `(loss, aux)` pair, the batch leaves
        differ in leading size or `accum_steps` does not divide it, a bad `on_overflow`/`accum_steps`/`max_retries`,
        or a traced (non-static) option under `jax.jit`.
    """
    new_state, metrics, new_model_state = train_step_with_carry(
        state, batch, loss_fn, state.model_state, accum_steps=accum_steps, on_overflow=on_overflow,
        max_retries=max_retries, underflow_stats=underflow_stats, axis_name=axis_name)
    if state.model_state is not None:
        new_state = new_state.replace(model_state=keep_finite(new_model_state, state.model_state))
    return new_state, metrics


def keep_finite(new: PyTree, old: PyTree) -> PyTree:
    """`new` leaf by leaf, except a float leaf that is not finite everywhere: that one keeps its `old` value bitwise
    (a non-finite running statistic, e.g. an inf batch through BatchNorm, would poison every later step). Leaves
    keep `old`'s dtypes."""

    def one(n, o):
        n = jnp.asarray(n).astype(jnp.asarray(o).dtype)
        if not jnp.issubdtype(n.dtype, jnp.inexact):
            return n
        return jax.lax.select(jnp.all(jnp.isfinite(n)), n, o)

    return jax.tree.map(one, new, old)


def train_step_with_carry(state: TrainState, batch: PyTree, loss_fn: Callable, carry: PyTree, *,
                          accum_steps: int = 1, on_overflow: str = "skip", max_retries: int = 4,
                          underflow_stats: bool = False, axis_name: Any = None, caller: str = "train_step"
                          ) -> tuple[TrainState, dict, PyTree]:
    """`train_step` for a stateful loss: the model state that is not differentiated runs through the step.

    The building block of `train_step`'s `model_state` and of `jaxamp.nnx.train_step` (BatchNorm statistics, RNG
    counts). `loss_fn(params, batch, rng, carry)` returns `(loss | (loss, aux), new_carry)` with `new_carry` shaped
    like `carry`. The micro-batches of `accum_steps` run in order, each from the previous one's carry; every attempt
    of `on_overflow="retry"` starts from the given carry (so a retried batch draws the same randomness). The carry
    is returned whatever the finite flag says: what to keep on a skipped step is the caller's decision. With
    `carry=None`, `loss_fn(params, batch, rng)` (no carry returned: None).

    Returns:
      `(new_state, metrics, new_carry)`: as `train_step`, plus the carry after the step's (last attempt's) pass.

    Raises:
      ValueError: as `train_step`.
    """
    check_options(loss_fn, accum_steps, max_retries=max_retries, on_overflow=on_overflow,
                  underflow_stats=underflow_stats, axis_name=axis_name,
                  loss_args=("params", "batch", "rng") + (() if carry is None else ("model_state",)))
    rng = jax.random.fold_in(state.rng, state.step)
    # Steps 1-5, traced once: the precision audit reads the very program that runs (a warning per compilation).
    first, program = traced_gradients(state, batch, loss_fn, state.loss_scale, rng, accum_steps, underflow_stats,
                                      carry, axis_name)
    audit.check_program(program, state.policy, where=caller)
    if on_overflow == "retry":
        loss_scale, g, check, retries, futile = _retry(state, batch, loss_fn, rng, accum_steps, underflow_stats,
                                                       max_retries, carry, axis_name, first)
    else:
        loss_scale, retries, futile, g = state.loss_scale, jnp.zeros((), jnp.int32), None, first
        check = finite.check(g.grads, also=g.fp8)  # the one finite check and the norm, one pass over the gradients
    grads_finite, loss_finite = check.finite, jnp.isfinite(g.loss)
    params, opt_state = _update(state, g, grads_finite)
    # No scale fixes a non-finite loss (the forward pass or the inputs): the step is skipped, the scale left alone.
    new_scale = select_tree(loss_finite, loss_scale.adjust(grads_finite), state.loss_scale)
    skips = jnp.where(grads_finite, 0, _skips(state) + 1).astype(jnp.int32)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, loss_scale=new_scale,
                              consecutive_skips=skips if state.consecutive_skips is not None else None)
    metrics = step_metrics(
        loss=g.loss, loss_finite=loss_finite, grad_norm=check.norm,
        loss_scale=jnp.copy(loss_scale.loss_scale),  # a new buffer: the state's own is donated next step
        grads_finite=grads_finite, grads_finite_leaves=check.finite_leaves, retries=retries,
        consecutive_skips=jnp.copy(skips), nonfinite_at_min_scale=futile, loss_weight=g.weight, aux=g.aux,
        underflow=g.stats)
    return new_state, metrics, g.carry


def _skips(state: TrainState) -> jax.Array:
    """The state's consecutive skipped steps (0 for a state built without the counter)."""
    return jnp.zeros((), jnp.int32) if state.consecutive_skips is None else state.consecutive_skips


def _update(state: TrainState, g, grads_finite: jax.Array) -> tuple[PyTree, PyTree]:
    """Steps 7-8: the optax update on the unscaled gradients, then new or old params and optax state by the finite
    flag (the FP8 collection by its own rules, frozen leaves the very arrays they were)."""
    regular, fp8 = split_fp8(state.params)
    train_params, frozen = split_frozen(regular, state.trainable)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats with i32 counts; all float32 here
        # `value`: the unscaled float32 loss, for transformations that use it (optax.contrib.reduce_on_plateau,
        # optax.polyak_sgd); plain GradientTransformations ignore it (`with_extra_args_support`).
        updates, new_opt_state = optax.with_extra_args_support(state.tx).update(
            g.grads, state.opt_state, train_params, value=g.loss)
        new_params = optax.apply_updates(train_params, updates)  # cast back to the params' dtypes
    # Master weights in float16/bfloat16 (a jmp string such as "float16"): the float32 gradients promote optax's
    # moments; every leaf keeps the dtype it has in the state, so state dtypes never drift.
    old = (train_params, state.opt_state)
    new = jax.tree.map(lambda x, o: x.astype(o.dtype), (new_params, new_opt_state), old)
    train_params, opt_state = select_tree(grads_finite, new, old)
    fp8 = fp8c.select(grads_finite, g.fp8, fp8)
    return merge_fp8(merge_frozen(train_params, frozen), fp8), opt_state


def check_options(loss_fn, accum_steps: int, *, max_retries: int = 0, on_overflow: str = "skip",
                  underflow_stats: bool = False, axis_name: Any = None, caller: str = "train_step",
                  loss_args: tuple[str, ...] = ()) -> None:
    """`train_step`'s checks of its static arguments, shared with `jaxamp.fidelity` (`caller` names the function
    in the messages; `loss_args`, the names of the positional arguments `loss_fn` is called with, if given).

    Raises:
      ValueError: in one line, naming the argument and the fix.
      TypeError: `loss_fn` cannot take `loss_args` (see `check_loss_args`).
    """
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be a function loss_fn(params, batch, rng) -> loss | (loss, aux), got "
                         f"{type(loss_fn).__name__}")
    if loss_args:
        check_loss_args(loss_fn, loss_args, caller)
    donate = ", donate_argnums=0" if caller == "train_step" else ""
    for name, value in (("accum_steps", accum_steps), ("max_retries", max_retries),
                        ("underflow_stats", underflow_stats)):
        if isinstance(value, jax.core.Tracer):
            raise ValueError(f"{name} must be a static Python value: under jax.jit name it in static_argnames, e.g. "
                             f"jax.jit({caller}, static_argnames=('loss_fn', '{name}'){donate})")
    if on_overflow not in ("skip", "retry"):
        raise ValueError(f'on_overflow must be "skip" or "retry", got {on_overflow!r}')
    for name, value in (("accum_steps", accum_steps), ("max_retries", max_retries)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1 (micro-batches per step), got {accum_steps}")
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")
    try:
        hash(axis_name)
    except TypeError:
        raise ValueError(f"axis_name must be the name of a mapped axis (a string, e.g. 'batch' of "
                         f"jax.pmap(..., axis_name='batch')) or None, got {type(axis_name).__name__}") from None


def eval_step(state: TrainState, batch: PyTree, loss_fn: LossFn) -> dict:
    """The loss on `batch` with the params cast to the compute dtype and no RNG (dropout off).

    Args:
      state: the `TrainState`.
      batch: as for `train_step`.
      loss_fn: as for `train_step`; it receives `rng=None` and must run deterministically then (with a model
        state, `loss_fn(params, batch, None, model_state)`, whose new model state is dropped: evaluate with the
        running statistics, e.g. `use_running_average=True` when `rng` is None).

    Returns:
      `{"loss": f32[]}`, plus `"aux"` when `loss_fn` returns one.
    """
    loss_fn = compute_loss(state.policy, loss_fn)
    if state.model_state is None:
        out = loss_fn(state.compute_params(), batch, None)
    else:
        out, _ = split_stateful(loss_fn(state.compute_params(), batch, None, state.model_state))
    loss, aux = split_loss(out)
    return {"loss": loss} if aux is None else {"loss": loss, "aux": aux}
