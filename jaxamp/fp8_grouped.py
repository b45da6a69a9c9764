"""Grouped FP8 matmuls: `fp8_ragged_dot`, `lax.ragged_dot` (an MoE's experts over tokens sorted by expert) with
FP8 operands under the per-tensor current-scaling recipes, stateless.

For `out = ragged_dot(x, w, group_sizes)` with `x: bf16[m, k]` (rows grouped, group i taking the next
`group_sizes[i]` rows), `w: bf16[groups, k, n]` and output gradient `g: bf16[m, n]`, each group is its own matmul,
as each expert's GEMM of Transformer Engine's grouped linear layers is:

* x's rows and g's rows are quantized per group (`fp8_quant.quantize_grouped`: each expert's tokens with their own
  amax), w per group (`quantize_current(..., batch_axes=1)`: each expert's weight alone); x and w e4m3, g e5m2
  (`current`'s HYBRID formats; `current-pow2` rounds the scales up to powers of 2);
* forward `ragged_dot(xq, wq) * (sx * sw)[group of the row]`, dgrad `ragged_dot(gq, wq^T) * (sg * sw)[group]` and
  wgrad `ragged_dot_general(xq, gq)` over each group's rows `* (sx * sg)[group]`: the FP8 values themselves are the
  GEMMs' operands, with float32 accumulation, and the scales multiply their float32 outputs, as `current`'s dots do
  (`jaxamp.fp8_recipes`). The backward reuses the forward's FP8 x and w and quantizes g once for both gradients.

The tiled recipes (`block`, `mxfp8`) are not here: their tiles along the rows would cross the groups' edges (the
kernels that run them pad each group to whole tiles). Under them autocast leaves grouped matmuls in the compute
dtype, and the precision audit says so. No GPU has run these yet: XLA:GPU's `ragged_dot` with FP8 operands is
numerics until measured.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jaxamp import fp8_quant
from jaxamp.fp8_recipes import Recipe, fp8_scope, get_recipe

__all__ = ["fp8_ragged_dot", "group_ids", "is_ragged_dot", "takes_recipe"]

# ragged_dot's own form: lhs [m, k] ragged over m, rhs [groups, k, n]
_FORWARD = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (1,)), ((), ())),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
# the weight gradient: x^T g over each group's rows, out [groups, k, n]
_WGRAD = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                       lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def is_ragged_dot(dims: lax.RaggedDotDimensionNumbers) -> bool:
    """Whether `ragged_dot_general`'s dimension numbers are `lax.ragged_dot`'s own (lhs `[m, k]` ragged over m,
    rhs `[groups, k, n]`): the form `fp8_ragged_dot` runs."""
    (lc, rc), (lb, rb) = dims.dot_dimension_numbers
    return ((tuple(lc), tuple(rc), tuple(lb), tuple(rb)) == ((1,), (1,), (), ())
            and tuple(dims.lhs_ragged_dimensions) == (0,) and tuple(dims.rhs_group_dimensions) == (0,))


def takes_recipe(recipe: Recipe) -> bool:
    """Whether `fp8_ragged_dot` runs `recipe`: per-tensor scales (`current`, `current-pow2`), not tiles."""
    return recipe.x.tile is None and recipe.w.tile is None and recipe.g.tile is None


def group_ids(group_sizes: jax.Array, rows: int) -> jax.Array:
    """`i32[rows]`: the group of each row (`groups` for the rows past the last group, which `ragged_dot` leaves 0)."""
    ends = jnp.cumsum(group_sizes)  # group i ends before row ends[i]
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=ends.dtype), side="right").astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Static:
    recipe: Recipe
    out_dtype: jnp.dtype
    x_dtype: jnp.dtype
    w_dtype: jnp.dtype


def _quantize_weights(w: jax.Array, recipe: Recipe):
    """`(f8[groups, k, n], f32[groups + 1])`: each group's weight with its own scale (1 for the rows in no group)."""
    q, scale = fp8_quant.quantize_current(w, recipe.w.dtype, power_of_2=recipe.w.power_of_2, batch_axes=1)
    return q, jnp.concatenate([scale.reshape(-1), jnp.ones((1,), jnp.float32)])


def _rows(x, ids, op):
    """Each group's rows quantized with their own scale; the rows in no group (which `ragged_dot` skips) as zeros,
    so a NaN there (padding) cannot reach the output through its scale."""
    x = jnp.where((ids[0] < ids[1])[:, None], x, jnp.zeros((), x.dtype))
    return fp8_quant.quantize_grouped(x, ids[0], ids[1], op.dtype, power_of_2=op.power_of_2)


def _scaled(out: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    return (out * scale).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged(x: jax.Array, w: jax.Array, sizes: jax.Array, static: _Static) -> jax.Array:
    return _ragged_fwd_values(x, w, sizes, static)[0]


def _ragged_fwd_values(x, w, sizes, static: _Static):
    r, groups = static.recipe, w.shape[0]
    ids = (group_ids(sizes, x.shape[0]), groups)
    (xq, sx), (wq, sw) = _rows(x, ids, r.x), _quantize_weights(w, r)
    with jax.named_scope(fp8_scope(r.x.dtype, r.w.dtype)):
        out = lax.ragged_dot_general(xq, wq, sizes, _FORWARD, preferred_element_type=jnp.float32)  # f32[m, n]
        out = _scaled(out, (sx * sw)[ids[0]][:, None], static.out_dtype)
    return out, (xq, sx, wq, sw, ids[0])


def _ragged_fwd(x, w, sizes, static: _Static):
    # symbolic_zeros: an operand nothing differentiates (a frozen expert stack, a raw input) gets no gradient GEMM
    need_dx, need_dw = x.perturbed, w.perturbed
    out, (xq, sx, wq, sw, ids) = _ragged_fwd_values(x.value, w.value, sizes.value, static)
    return out, (xq if need_dw else None, sx, wq if need_dx else None, sw, ids, sizes.value)


def _ragged_bwd(static: _Static, res, g):
    xq, sx, wq, sw, ids, sizes = res
    if isinstance(g, SymbolicZero):
        return None, None, None
    r = static.recipe
    gq, sg = _rows(g, (ids, sw.shape[0] - 1), r.g)  # f8[m, n], f32[groups + 1]
    dx = dw = None
    with jax.named_scope(fp8_scope(r.g.dtype, r.w.dtype)):
        if wq is not None:  # dgrad: g [m, n] . w^T [groups, n, k] -> [m, k]
            dx = lax.ragged_dot_general(gq, jnp.swapaxes(wq, 1, 2), sizes, _FORWARD,
                                        preferred_element_type=jnp.float32)
            dx = _scaled(dx, (sg * sw)[ids][:, None], static.x_dtype)
    with jax.named_scope(fp8_scope(r.x.dtype, r.g.dtype)):
        if xq is not None:  # wgrad: x^T g over each group's rows -> [groups, k, n]
            dw = lax.ragged_dot_general(xq, gq, sizes, _WGRAD, preferred_element_type=jnp.float32)
            dw = _scaled(dw, (sx * sg)[:-1, None, None], static.w_dtype)
    return dx, dw, None


_ragged.defvjp(_ragged_fwd, _ragged_bwd, symbolic_zeros=True)


def fp8_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, recipe: str | Recipe = "current",
                   compute_dtype=jnp.bfloat16, preferred_element_type=None, power_of_2: bool | None = None
                   ) -> jax.Array:
    """`lax.ragged_dot(lhs, rhs, group_sizes)` with FP8 operands, each group scaled alone (see the module).

    Args:
      lhs: `bf16[m, k]`, the rows (tokens) sorted by group (expert); any float dtype.
      rhs: `bf16[groups, k, n]`, one weight per group.
      group_sizes: `i32[groups]`, the rows of each group in order (their sum at most m; the rest give zeros).
      recipe: a per-tensor recipe of `jaxamp.fp8_recipes.RECIPES` (`"current"`, `"current-pow2"`) or a `Recipe`.
      compute_dtype: the result's dtype (`preferred_element_type` instead where given).
      power_of_2: overrides the recipe's power-of-2 scales where given.

    Returns:
      `compute_dtype[m, n]`; its gradients come back in lhs's and rhs's dtypes (none for `group_sizes`).

    Raises:
      ValueError: a tiled recipe (`block`, `mxfp8`), or shapes `lax.ragged_dot` refuses.
      TypeError: a non-floating operand.
    """
    r = get_recipe(recipe, power_of_2)
    if not takes_recipe(r):
        raise ValueError(f"fp8_ragged_dot runs the per-tensor recipes (current, current-pow2), not {r.name!r}: its "
                         "tiles would cross the groups' edges; use the batched form (einsum over an experts axis)")
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, t in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(t.dtype, jnp.floating):
            raise TypeError(f"fp8_ragged_dot quantizes floating-point operands; {name} is {t.dtype}")
    jax.eval_shape(lax.ragged_dot, jax.ShapeDtypeStruct(lhs.shape, jnp.float32),
                   jax.ShapeDtypeStruct(rhs.shape, jnp.float32), group_sizes)  # lax's own shape checks
    out_dtype = jnp.dtype(preferred_element_type if preferred_element_type is not None else compute_dtype)
    return _ragged(lhs, rhs, jnp.asarray(group_sizes), _Static(r, out_dtype, lhs.dtype, rhs.dtype))
