"""Gradient statistics for loss scaling: underflow (zeros) and headroom in the compute dtype, overflow location."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp.precision import leaf_path

PyTree = Any

__all__ = ["nonfinite_paths", "underflow_stats", "worst_leaves"]


def underflow_stats(scaled_grads: PyTree, dtype: Any = None) -> dict:
    """Underflow and headroom of the scaled gradients, in the dtype they were computed in (the compute dtype).

    Args:
      scaled_grads: the gradients with respect to the compute-dtype params, still multiplied by the loss scale
        (what float16 actually holds during the backward pass).
      dtype: the format whose range the headroom is measured against; None: each leaf's own dtype (a cast policy's
        compute-dtype params). Under autocast the params and their gradients are float32 while the backward GEMMs
        ran in the compute dtype: `train_step` passes it (float16's 65504, not float32's 3.4e38). A leaf summed in
        float32 outside any GEMM (a bias, a lookup's scatter-add) may then read a negative headroom and still be
        finite.

    Returns:
      A dict of float32 scalars and trees of them

        - `zero_fraction`: f32[] share of all gradient elements that are exactly 0 (flushed to zero, or truly zero,
          e.g. embedding rows of tokens absent from the batch);
        - `headroom_log2`: f32[] log2(max finite value of the dtype / max |scaled gradient|): how many doublings the
          loss scale can still take before overflow (negative or -inf: overflowed; NaN: a gradient is NaN, e.g.
          inf - inf in the backward pass; +inf: all zero);
        - `leaf_zero_fraction`, `leaf_headroom_log2`: the same per leaf (a tree like the params).
    """

    def leaf(g):
        g = jnp.asarray(g)
        big = jnp.log2(jnp.asarray(jnp.finfo(g.dtype if dtype is None else dtype).max, jnp.float32))
        max_abs = jnp.max(jnp.abs(g), initial=0).astype(jnp.float32)  # 0 for a zero-size leaf
        return {"zeros": jnp.sum(g == 0).astype(jnp.float32), "size": jnp.asarray(g.size, jnp.float32),
                "headroom": big - jnp.log2(max_abs)}

    per_leaf = jax.tree.map(leaf, scaled_grads)
    is_stats = lambda x: isinstance(x, dict) and set(x) == {"zeros", "size", "headroom"}
    leaves = jax.tree.leaves(per_leaf, is_leaf=is_stats)
    if not leaves:
        raise ValueError("underflow_stats got a pytree with no array leaves; pass the gradients of the params")
    zeros = sum(s["zeros"] for s in leaves)
    size = sum(s["size"] for s in leaves)
    return {
        "zero_fraction": zeros / jnp.maximum(size, 1),
        "headroom_log2": jnp.min(jnp.stack([s["headroom"] for s in leaves])),
        "leaf_zero_fraction": jax.tree.map(lambda s: s["zeros"] / jnp.maximum(s["size"], 1), per_leaf,
                                           is_leaf=is_stats),
        "leaf_headroom_log2": jax.tree.map(lambda s: s["headroom"], per_leaf, is_leaf=is_stats),
    }


def nonfinite_paths(leaf_finite: PyTree) -> list[str]:
    """Host side: the leaf paths (e.g. `"h_0/mlp/c_fc/kernel"`, as `jaxamp.precision.leaf_path` writes them, the
    form of `grad_rel_err` and `keep_float32` patterns) whose `bool[]` flag is False.

    Call it on fetched flags (`metrics["grads_finite_leaves"]`) of a skipped step only: names are built on the host,
    and only when needed.
    """
    flat = jax.tree_util.tree_flatten_with_path(leaf_finite)[0]
    return [leaf_path(path) for path, ok in flat if not bool(np.asarray(ok))]


def worst_leaves(leaf_values: PyTree, k: int = 3, *, largest: bool = True) -> list[tuple[str, float]]:
    """Host side: the `k` leaves with the largest (or smallest) value, as `(leaf_path, value)` pairs; NaN values
    first."""
    flat = [(leaf_path(p), float(np.asarray(v))) for p, v in jax.tree_util.tree_flatten_with_path(leaf_values)[0]]
    return sorted(flat, key=lambda pv: (not math.isnan(pv[1]), -pv[1] if largest else pv[1]))[:k]
