"""The finite check: does a gradient tree hold any inf or NaN? One pass per leaf also sums its squares for the norm.

`check(tree)` is the one finite check of `train_step` (jmp's `all_finite`, torch.amp's `found_inf`): a variadic
`lax.reduce` per leaf computes the leaf's sum of squares and its all-finite flag together, so the gradients are read
once for both the decision and the `grad_norm` metric. `all_finite` and `finite_leaves` are its two views.

Which leaves count: inexact ones (floating and complex). Integer and boolean leaves are finite and add nothing to the
norm.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any

__all__ = ["Check", "all_finite", "check", "finite_leaves"]


def _leaf_check(x) -> tuple[jax.Array, jax.Array]:
    """`(f32[] sum of squares, bool[] all finite)` of one leaf in one pass (a variadic `lax.reduce`)."""
    # A decision and a metric, not part of the update's value: no derivative (JAX's JVP of a variadic reduce with a
    # bool operand fails, so differentiating through `train_step`, e.g. for hypergradients, needs this).
    x = jax.lax.stop_gradient(jnp.asarray(x))
    if not jnp.issubdtype(x.dtype, jnp.inexact):  # integer or boolean leaves: finite, no norm
        return jnp.zeros((), jnp.float32), jnp.ones((), jnp.bool_)
    magnitude = jnp.abs(x) if jnp.issubdtype(x.dtype, jnp.complexfloating) else x
    xf = magnitude.astype(jnp.float32)
    return jax.lax.reduce((xf * xf, jnp.isfinite(x)), (jnp.float32(0), jnp.bool_(True)),
                          lambda a, b: (a[0] + b[0], a[1] & b[1]), tuple(range(x.ndim)))


class Check(NamedTuple):
    """What the finite check found."""

    finite: jax.Array  # bool[]: every element of every leaf finite
    finite_leaves: PyTree  # a tree of bool[] like the checked tree: True where that leaf is all finite
    norm: jax.Array  # f32[]: the global L2 norm (`optax.tree.norm`); inf or NaN when not finite


def check(tree: PyTree, also: PyTree = None) -> Check:
    """The finite check and the global L2 norm of `tree`, one fused reduction per leaf.

    Args:
      tree: the gradients (any pytree; params may hold tuples themselves, so it is flattened, not mapped).
      also: more leaves whose finiteness counts in `finite` but not in the norm or `finite_leaves` (e.g. the FP8
        ops' new amax histories: FP8 clips an overflowed output gradient to e5m2's range, and only its amax shows it).

    Returns:
      A `Check`; an empty tree is finite with norm 0.
    """
    leaves, treedef = jax.tree.flatten(tree)
    checks = [_leaf_check(x) for x in leaves]
    flags = [c[1] for c in checks] + [_leaf_check(x)[1] for x in jax.tree.leaves(also)]
    finite = jnp.all(jnp.stack(flags)) if flags else jnp.ones((), jnp.bool_)
    norm = jnp.sqrt(sum((c[0] for c in checks), jnp.zeros((), jnp.float32)))
    return Check(finite, treedef.unflatten([c[1] for c in checks]), norm)


def finite_leaves(tree: PyTree) -> PyTree:
    """Returns a tree of `bool[]`, one per leaf: True where every element of that leaf is finite.

    Non-inexact leaves (integers, booleans) count as finite. Used to name the overflowing parameters cheaply: the
    flags stay on device, and paths are built on the host only when a step was skipped
    (`jaxamp.grad_stats.nonfinite_paths`).
    """
    return check(tree).finite_leaves


def all_finite(tree: PyTree) -> jax.Array:
    """Returns `bool[]`: True when every inexact element of every leaf of `tree` is finite (no inf, no NaN).

    One reduction over all leaves: the single finite check that decides whether an update is applied
    (`jmp.all_finite`). An empty tree is finite.
    """
    return check(tree).finite
