"""Optimizer state in a low-precision dtype: `low_precision_state(tx, jnp.bfloat16)`, e.g. bfloat16 Adam moments.

DeepSeek-V3 trained with bfloat16 Adam moments and float32 master weights; a moment then costs 2 bytes per
parameter instead of 4 (Adam: 4 + 2 x 2 = 8 bytes per parameter with float32 weights, against 12). The wrapper is an
optax `(init, update)` pair around any transformation::

    init(params):            state = tx.init(params); every floating leaf with at least one axis -> dtype
    update(g, state, p):     state32 = those leaves -> float32
                             updates, new = tx.update(g, state32, p)     # the optimizer's own float32 arithmetic
                             new: those leaves -> dtype (round to nearest); updates as tx gave them

So the arithmetic of the update stays float32 and only the storage is narrow: the moments are rounded once per
step, and their dtypes never drift (a counter stays int32, a scalar hyperparameter float32). `TrainState.create`
applies it for a policy with the `";opt_state=bf16"` rule (`get_policy("bf16;opt_state=bf16")`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["low_precision_state", "optimizer_bytes_per_param"]


def _narrow(x) -> bool:
    """The leaves stored narrow: floating arrays with at least one axis (moments), not counters or scalars."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and jnp.ndim(x) >= 1


def _cast(tree: Any, dtype) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if _narrow(x) else x, tree)


def low_precision_state(tx: optax.GradientTransformation, dtype=jnp.bfloat16) -> optax.GradientTransformation:
    """`tx` with its state's floating arrays stored in `dtype` and its update computed in float32 (see the module).

    Args:
      tx: any optax transformation (`optax.adamw(...)`, a chain).
      dtype: the storage dtype of the state's floating arrays: `jnp.bfloat16` or `jnp.float16` (a float16 second
        moment underflows below 6e-8: bfloat16 keeps float32's range).

    Returns:
      An optax `GradientTransformation` (`update` takes `params` when `tx` does).

    Raises:
      ValueError: `dtype` is not a floating dtype of 16 bits.
    """
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize != 2:
        raise ValueError(f"low_precision_state stores the optimizer state in a 16-bit float (bfloat16 or float16), "
                         f"got {dtype.name}")

    def init(params):
        return _cast(tx.init(params), dtype)

    def update(updates, state, params=None):
        updates, new = tx.update(updates, _cast(state, jnp.float32), params)
        return updates, _cast(new, dtype)

    return optax.GradientTransformation(init, update)


def optimizer_bytes_per_param(params: Any, opt_state: Any) -> float:
    """Bytes per trainable parameter of the master weights plus the optimizer state (float32 Adam: 4 + 8 = 12;
    bfloat16 moments: 4 + 4 = 8), from the arrays themselves.

    Args:
      params: the master weights (a pytree of arrays).
      opt_state: the optax state.

    Returns:
      `(bytes of params + bytes of opt_state) / number of parameters`, or 0.0 for no parameters.
    """
    count = sum(int(x.size) for x in jax.tree.leaves(params) if hasattr(x, "size"))
    size = sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves((params, opt_state))
               if hasattr(x, "dtype"))
    return size / count if count else 0.0
