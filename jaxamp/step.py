"""One mixed-precision update (`train_step`) and one evaluation (`eval_step`), both pure and jit-able."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxamp.loss_scale import all_finite
from jaxamp.state import TrainState

PyTree = Any
LossFn = Callable[[PyTree, PyTree, Any], Any]


def _split_loss(out) -> tuple[jax.Array, Any]:
    """`loss_fn` returns a scalar loss or `(loss, aux)`; returns `(f32[] loss, aux or None)`."""
    loss, aux = out if isinstance(out, tuple) else (out, None)
    loss = jnp.asarray(loss)
    if loss.shape != ():
        raise ValueError(f"loss_fn must return a scalar loss (or (loss, aux)), got shape {loss.shape}")
    return loss.astype(jnp.float32), aux


def select_tree(pred: jax.Array, on_true: PyTree, on_false: PyTree) -> PyTree:
    """Leaf by leaf `lax.select(pred, a, b)` for a `bool[]` pred: the unchosen tree's leaves come back bitwise."""
    return jax.tree.map(lambda a, b: jax.lax.select(pred, a, b), on_true, on_false)


def train_step(state: TrainState, batch: PyTree, loss_fn: LossFn) -> tuple[TrainState, dict]:
    """One mixed-precision optimizer step, pure: `jax.jit(train_step, static_argnames="loss_fn", donate_argnums=0)`.

    Order of operations (Micikevicius et al., 2018; torch.amp's autocast + GradScaler; jmp):

    1. cast the master params to the policy's compute dtype (`policy.cast_to_compute`);
    2. loss in float32: `loss_fn(compute_params, batch, rng)`, its result cast to float32;
    3. multiply the float32 loss by the loss scale;
    4. gradient with respect to the master params (the cast's transpose brings the compute-dtype cotangents back
       to the param dtype, so an float16 overflow arrives as inf);
    5. unscale in float32 (divide by the scale);
    6. one finite check over every gradient leaf (`all_finite`);
    7. optax update on the unscaled gradients, so clipping and weight decay inside `tx` never see the scale;
    8. apply, then select new or old `params` and `opt_state` by the finite flag: on overflow both come back bitwise
       unchanged (optax's count and any LR schedule do not advance);
    9. adjust the loss scale (backoff or growth); advance `step` (also on a skipped step).

    Args:
      state: the `TrainState`. Donating it is safe.
      batch: any pytree; passed to `loss_fn` as is (cast float inputs there with `policy.cast_to_compute` if wanted).
      loss_fn: `loss_fn(params, batch, rng) -> loss | (loss, aux)`: `params` already in the compute dtype, `rng` a
        `u32[2]` key for this step, `jax.random.fold_in(state.rng, state.step)`. Static under jit (hashable).

    Returns:
      `(new_state, metrics)`; metrics hold `loss` (f32[], unscaled), `grad_norm` (f32[], global L2 norm of the
      unscaled gradients before clipping; inf or NaN on overflow), `loss_scale` (f32[], the scale used in this step),
      `grads_finite` (bool[]) and `aux` (when `loss_fn` returns one).

    Raises:
      ValueError: `loss_fn` returned a non-scalar loss.
    """
    step_rng = jax.random.fold_in(state.rng, state.step)
    loss_scale = state.loss_scale

    def scaled_loss(params):
        loss, aux = _split_loss(loss_fn(state.policy.cast_to_compute(params), batch, step_rng))
        return loss_scale.scale(loss), (loss, aux)

    grads, (loss, aux) = jax.grad(scaled_loss, has_aux=True)(state.params)
    grads = loss_scale.unscale(grads)
    grads_finite = all_finite(grads)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats with i32 counts; all float32 here
        updates, new_opt_state = state.tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    params, opt_state = select_tree(grads_finite, (new_params, new_opt_state), (state.params, state.opt_state))
    new_state = state.replace(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        loss_scale=loss_scale.adjust(grads_finite),
    )
    metrics = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads).astype(jnp.float32),
        "loss_scale": jnp.copy(loss_scale.loss_scale),  # a new buffer: the state's own is donated next step
        "grads_finite": grads_finite,
    }
    if aux is not None:
        metrics["aux"] = aux
    return new_state, metrics


def eval_step(state: TrainState, batch: PyTree, loss_fn: LossFn) -> dict:
    """The loss on `batch` with the params cast to the compute dtype and no RNG (dropout off).

    Args:
      state: the `TrainState`.
      batch: as for `train_step`.
      loss_fn: as for `train_step`; it receives `rng=None` and must run deterministically then.

    Returns:
      `{"loss": f32[]}`, plus `"aux"` when `loss_fn` returns one.
    """
    loss, aux = _split_loss(loss_fn(state.policy.cast_to_compute(state.params), batch, None))
    return {"loss": loss} if aux is None else {"loss": loss, "aux": aux}
