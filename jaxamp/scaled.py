"""Loss scaling for a training loop of your own: `value_and_grad`, in the spirit of Flax's
`DynamicScale.value_and_grad`, and `select_tree` for the skipped update.

    grad_fn = jaxamp.value_and_grad(loss_fn, policy="fp16")       # loss_fn(params, batch) -> loss
    loss_scale, grads_finite, loss, grads = grad_fn(loss_scale, state.params, batch)
    new_state = state.apply_gradients(grads=grads)                # e.g. Flax's own TrainState
    state = jaxamp.select_tree(grads_finite, new_state, state)    # a skipped step changes nothing

The gradients are those `jaxamp.train_step` computes (steps 1-6 of its order of operations: the policy's cast or
autocast, the float32 loss times the loss scale, the gradient, unscaled in float32, one finite check), so an update
built on them is bitwise `train_step`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jmp

from jaxamp import finite
from jaxamp.gradients import compute_loss, split_loss
from jaxamp.precision import get_policy
from jaxamp.step import select_tree

PyTree = Any

__all__ = ["select_tree", "value_and_grad"]


def value_and_grad(loss_fn: Callable, *, has_aux: bool = False, policy: jmp.Policy | str | None = None,
                   axis_name: Any = None) -> Callable:
    """`loss_fn`'s loss and its unscaled float32 gradients under a loss scale, for a hand-written step.

    The returned `grad_fn(loss_scale, params, *args)` (a pure function: jit it, or call it inside your jitted step)
    casts `params` to the policy's compute dtype (or, for an autocast policy, runs `loss_fn` under
    `jaxamp.autocast`), computes the loss in float32, multiplies it by `loss_scale`, differentiates with respect to
    `params`, unscales the gradients in float32, averages them over `axis_name` (inside `jax.pmap` or `shard_map`),
    checks them for inf and NaN once, and adjusts the loss scale: backoff on overflow, growth after a run of finite
    steps, and left alone when the loss itself is not finite (no scale fixes the inputs). As Flax's
    `DynamicScale.value_and_grad` (which returns `(dynamic_scale, is_finite, aux, grad)`), without the state object.

    Args:
      loss_fn: `loss_fn(params, *args) -> loss` (or `(loss, aux)` with `has_aux`); `params` arrive in the compute
        dtype.
      has_aux: `loss_fn` returns `(loss, aux)`.
      policy: a `jmp.Policy` or a spec `jaxamp.get_policy` takes (`"fp16"`, `"bf16;autocast"`); None: the params as
        they are (float32 compute).
      axis_name: a mapped axis to average the gradients and the loss over, or None.

    Returns:
      `grad_fn(loss_scale, params, *args) -> (new_loss_scale, grads_finite, value, grads)`: the adjusted jaxamp loss
      scale, `bool[]`, the unscaled float32 loss (`(loss, aux)` with `has_aux`), and float32 gradients shaped like
      `params`.

    Raises:
      ValueError: `loss_fn` is not callable, or a bad `policy` spec.
    """
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be a function loss_fn(params, *args) -> loss, got {type(loss_fn).__name__}")
    policy = None if policy is None else get_policy(policy) if isinstance(policy, str) else policy

    def grad_fn(loss_scale, params: PyTree, *args):
        compute = params if policy is None else policy.cast_to_compute(params)
        fn = loss_fn if policy is None else compute_loss(policy, loss_fn)

        def scaled(p):
            out = fn(p, *args)
            loss, aux = split_loss(out if has_aux else (out, None))
            return loss_scale.scale(loss), (loss, aux)

        grads, (loss, aux) = jax.grad(scaled, has_aux=True)(compute)
        grads = loss_scale.unscale(grads)
        if axis_name is not None:
            grads, loss = jax.lax.pmean((grads, loss), axis_name)
        grads_finite = finite.check(grads).finite
        new_scale = select_tree(jnp.isfinite(loss), loss_scale.adjust(grads_finite), loss_scale)
        return new_scale, grads_finite, (loss, aux) if has_aux else loss, grads

    return grad_fn
