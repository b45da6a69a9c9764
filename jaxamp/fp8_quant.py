"""Stateless FP8 quantization: per-tensor current scaling, 1x128 / 128x128 block scaling, MXFP8 (OCP MX).

Every helper returns `(q, scale)`: the FP8 values `q` (the input's shape, `float8_e4m3fn` or `float8_e5m2`) and the
float32 dequantization factor(s) `scale`, so that `x ~= q.astype(f32) * scale` (broadcast per tile). `scale` is
Transformer Engine's `scale_inv` (TE keeps its reciprocal, `fmt_max / amax`, as `scale` and multiplies by it): with
power-of-2 scales the two conventions give bitwise the same FP8 values; otherwise x / (amax / fmt_max) here and
x * (fmt_max / amax) in TE may differ by one float32 rounding before the FP8 rounding. Nothing is remembered between
calls (no amax history): the scale of a tensor comes from that tensor alone.

* `current` (TE `Float8CurrentScaling`, torchao tensorwise): one f32[] scale for the whole tensor, amax / fmt_max
  (one per entry of its leading batch axes where asked: an MoE's experts).
* `block` (DeepSeek-V3, TE `Float8BlockScaling`): one f32 scale per 1x128 tile (activations, output gradients) or
  128x128 block (weights), powers of 2 by default (TE's default).
* `mxfp8` (OCP MX, TE `MXFP8BlockScaling`, `jax.nn.scaled_dot_general`): one f32 scale per 32 consecutive elements,
  a power of 2 (an e8m0 value).

Tiles run over the last two axes, the last one being the contraction dim of the matmul the tensor feeds (`x[..., rows,
cols]`). Numerics choices:

* amax == 0 (an all-zero tensor or tile) gives scale 1, so no 0/0; a non-finite amax gives a non-finite scale, and
  the non-finite values stay non-finite through quantize, dequantize and the matmul (NaN/inf reach the loss scale's
  finite check instead of turning into finite FP8 numbers).
* Power-of-2 scales round amax / fmt_max *up* to a power of 2 (`pow2_ceil`), so no value saturates: the rounding of
  OCP MX's e8m0 scales in TE and `jax.nn.scaled_dot_general` (exponent of amax / 448, plus one where the mantissa is
  non-zero). TE's block scaling zeroes the mantissa of its reciprocal `fmt_max / amax`: the same power of 2 except
  where amax / fmt_max lies within one float32 rounding of a power of 2.
* Values are clipped to +-fmt_max before the conversion (`float8_e4m3fn` has no inf: an unclipped overflow would be
  NaN), as TE, Flax's FP8 ops and XLA's FP8 GEMM pattern do.
* Dims that are not a multiple of a block tile (`block`) make partial tiles at the end: implemented by padding |x|
  with zeros for the amax (zeros change no amax), so a partial tile's scale comes from its real elements only; `q`
  keeps the input's shape. `mxfp8` refuses a last dim that is not a multiple of 32 (TE's MXFP8 and
  `jax.nn.scaled_dot_general` do too): see `check_mxfp8_dim`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
ROW_TILE = (1, 128)  # activations and output gradients: 128 consecutive elements of a row (DeepSeek-V3's 1x128)
WEIGHT_TILE = (128, 128)  # weights: 128x128 blocks
MX_TILE = (1, 32)  # OCP MX: 32 consecutive elements
MX_BLOCK = 32

__all__ = ["E4M3", "E5M2", "FP8_MAX", "MX_BLOCK", "MX_TILE", "ROW_TILE", "WEIGHT_TILE", "check_mxfp8_dim",
           "dequantize", "dequantize_block", "dequantize_current", "dequantize_mxfp8", "pow2_ceil", "quantize_block",
           "quantize_current", "quantize_grouped", "quantize_mxfp8", "quantize_tiles", "scale_from_amax"]


def _fp8_max(dtype) -> float:
    dtype = jnp.dtype(dtype)
    if dtype not in FP8_MAX:
        raise ValueError(f"FP8 format must be float8_e4m3fn or float8_e5m2, got {dtype}")
    return FP8_MAX[dtype]


def pow2_ceil(v: jax.Array) -> jax.Array:
    """The power of 2 >= `v` (f32, v >= 0), from its bits: the exponent, plus one where the mantissa is non-zero.

    The e8m0 rounding of TE's MXFP8 and of `jax.nn.scaled_dot_general` (`cast_to_e8m0_with_rounding_up`); values
    below 2^-126 give 2^-126 (a float32 normal: e8m0 also has 2^-127, a float32 subnormal that a GPU may flush), and
    zero gives zero. A non-finite `v` is returned as it is.
    """
    bits = lax.bitcast_convert_type(v.astype(jnp.float32), jnp.uint32)
    exponent, mantissa = bits >> 23, bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent < 254)  # 2^127 is e8m0's largest: nothing above it to round to
    exponent = jnp.where(up, exponent + 1, exponent)
    return jnp.where(jnp.isfinite(v), lax.bitcast_convert_type(exponent << 23, jnp.float32), v)


def scale_from_amax(amax: jax.Array, dtype, power_of_2: bool) -> jax.Array:
    """The dequantization scale amax / fmt_max (f32, amax's shape), rounded up to a power of 2 if asked, at least
    2^-126; 1 where amax == 0."""
    scale = amax.astype(jnp.float32) / _fp8_max(dtype)
    # Floor at float32's smallest normal: a subnormal scale (amax < 5e-36) may be flushed to zero on a GPU.
    scale = pow2_ceil(scale) if power_of_2 else jnp.maximum(scale, jnp.finfo(jnp.float32).tiny)
    return jnp.where(amax == 0, 1.0, scale)


def _to_fp8(x32: jax.Array, scale_full: jax.Array, dtype) -> jax.Array:
    """`convert(clamp(x / scale, -max, max) -> f8)`: the quantization half of XLA's FP8 GEMM pattern."""
    fmax = _fp8_max(dtype)
    return lax.convert_element_type(jnp.clip(x32 / scale_full, -fmax, fmax), jnp.dtype(dtype))


def quantize_current(x: jax.Array, dtype=E4M3, *, power_of_2: bool = False,
                     batch_axes: int = 0) -> tuple[jax.Array, jax.Array]:
    """Per-tensor current scaling (TE `Float8CurrentScaling`, torchao tensorwise): `x: bf16[...]` ->
    `(f8[...], f32[])`, scale = amax(|x|) / fmt_max of this very tensor.

    `dtype`: e4m3 (max 448) for activations and weights, e5m2 (max 57344) for output gradients (TE's HYBRID format).
    `power_of_2`: TE's `NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES` (off by default there and here).
    `batch_axes`: how many leading axes index independent tensors (an MoE's experts, `bf16[experts, d, f]`): one
    scale per entry, `f32[experts, 1, 1]` (kept dims, so it broadcasts), as Transformer Engine's grouped GEMMs
    quantize each expert's weight and input alone.
    """
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=tuple(range(batch_axes, x.ndim)), keepdims=batch_axes > 0)
    scale = scale_from_amax(amax, dtype, power_of_2)  # f32[] or f32[b..., 1...]
    return _to_fp8(x32, scale, dtype), scale


def quantize_grouped(x: jax.Array, group_ids: jax.Array, groups: int, dtype=E4M3, *,
                     power_of_2: bool = False) -> tuple[jax.Array, jax.Array]:
    """Current scaling per group of rows (the tokens each expert of an MoE takes, Transformer Engine's grouped
    GEMMs' split quantization): `x: bf16[rows, cols]`, `group_ids: i32[rows]` (a row's group, `groups` for rows in
    none) -> `(f8[rows, cols], f32[groups + 1])`, each group's scale amax / fmt_max of its own rows (1 where it has
    none; the last entry: the rows in no group)."""
    x32 = x.astype(jnp.float32)
    row_amax = jnp.max(jnp.abs(x32), axis=-1)  # f32[rows]
    amax = jnp.maximum(jax.ops.segment_max(row_amax, group_ids, num_segments=groups + 1), 0.0)  # empty: -inf -> 0
    amax = jnp.where(jax.ops.segment_sum(jnp.isnan(row_amax).astype(jnp.int32), group_ids,
                                         num_segments=groups + 1) > 0, jnp.nan, amax)  # a NaN stays a NaN scale
    scale = scale_from_amax(amax, dtype, power_of_2)  # f32[groups + 1]
    return _to_fp8(x32, scale[group_ids][:, None], dtype), scale


def dequantize_current(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """`convert(q -> f32) * scale`, cast to `dtype`: the dequantization half of XLA's FP8 GEMM pattern."""
    return dequantize(q, scale, None, dtype)


def _padded_tiles(a: jax.Array, tile: tuple[int, int]) -> jax.Array:
    """`a[..., R, C]` zero-padded to whole tiles and split: `[..., ceil(R/tr), tr, ceil(C/tc), tc]`."""
    tr, tc = tile
    *lead, rows, cols = a.shape
    pr, pc = -rows % tr, -cols % tc
    if pr or pc:
        a = jnp.pad(a, [(0, 0)] * len(lead) + [(0, pr), (0, pc)])
    return a.reshape(*lead, (rows + pr) // tr, tr, (cols + pc) // tc, tc)


def _expand(scale: jax.Array, tile: tuple[int, int], shape: tuple[int, ...]) -> jax.Array:
    """Per-tile `scale[..., ceil(R/tr), ceil(C/tc)]` broadcast to every element: `f32[..., R, C]`."""
    tr, tc = tile
    full = jnp.repeat(jnp.repeat(scale, tr, axis=-2), tc, axis=-1) if tr > 1 else jnp.repeat(scale, tc, axis=-1)
    return full[..., : shape[-2], : shape[-1]]


def quantize_tiles(x: jax.Array, tile: tuple[int, int], dtype=E4M3, *,
                   power_of_2: bool = True) -> tuple[jax.Array, jax.Array]:
    """One scale per `tile = (tr, tc)` tile of the last two axes: `x: bf16[..., R, C]` -> `(f8[..., R, C],
    f32[..., ceil(R/tr), ceil(C/tc)])`; a dim that is not a multiple of the tile ends in a partial tile."""
    if x.ndim < 2:
        raise ValueError(f"tile scaling quantizes the last two axes [..., rows, cols]; got shape {x.shape}")
    x32 = x.astype(jnp.float32)
    amax = jnp.max(_padded_tiles(jnp.abs(x32), tile), axis=(-3, -1))  # f32[..., R/tr, C/tc]
    scale = scale_from_amax(amax, dtype, power_of_2)
    return _to_fp8(x32, _expand(scale, tile, x.shape), dtype), scale


def dequantize(q: jax.Array, scale: jax.Array, tile: tuple[int, int] | None, dtype=jnp.float32) -> jax.Array:
    """`q.astype(f32) * scale` (a scalar for `tile=None`, else broadcast per tile), cast to `dtype`."""
    full = scale if tile is None else _expand(scale, tile, q.shape)
    return (lax.convert_element_type(q, jnp.float32) * full).astype(dtype)


def quantize_block(x: jax.Array, *, weight: bool = False, power_of_2: bool = True) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3 / TE `Float8BlockScaling`, e4m3: an activation or output gradient `bf16[..., rows, k]` gets one
    scale per 1x128 tile (`f32[..., rows, ceil(k/128)]`), a weight `bf16[..., n, k]` (`weight=True`) one per
    128x128 block (`f32[..., ceil(n/128), ceil(k/128)]`); `k`, the last axis, is the contraction dim.

    `power_of_2`: TE's default (`NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1` turns it off); DeepSeek-V3's own kernels use
    amax / 448 unrounded (`power_of_2=False`).
    """
    return quantize_tiles(x, WEIGHT_TILE if weight else ROW_TILE, E4M3, power_of_2=power_of_2)


def dequantize_block(q: jax.Array, scale: jax.Array, *, weight: bool = False, dtype=jnp.float32) -> jax.Array:
    """The inverse of `quantize_block` (same `weight`)."""
    return dequantize(q, scale, WEIGHT_TILE if weight else ROW_TILE, dtype)


def check_mxfp8_dim(size: int, what: str) -> None:
    """MX blocks are 32 elements: refuses a dim that is not a multiple of 32 (ValueError naming `what`)."""
    if size % MX_BLOCK:
        raise ValueError(f"mxfp8 scales blocks of {MX_BLOCK} consecutive elements and needs {what} to be a multiple "
                         f"of {MX_BLOCK}, got {size} (as TE's MXFP8BlockScaling and jax.nn.scaled_dot_general do); "
                         "use recipe 'block' (partial 128-element tiles) or 'current' for this shape")


def quantize_mxfp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """OCP MXFP8 (TE `MXFP8BlockScaling`, `jax.nn.get_scaled_dot_general_config("mxfp8")`): `x: bf16[..., rows,
    k]` -> `(e4m3[..., rows, k], f32[..., rows, k/32])`, one power-of-2 scale per 32 consecutive elements of the
    last axis, exactly representable as `float8_e8m0fnu` (`scale.astype(jnp.float8_e8m0fnu)` is lossless).

    Equal to `jax.nn.scaled_dot_general`'s quantization for float32 inputs (it divides in the input's dtype, so a
    bfloat16 input can round amax / 448 differently there).
    """
    check_mxfp8_dim(x.shape[-1], "the last (contraction) dim")
    return quantize_tiles(x, MX_TILE, E4M3, power_of_2=True)


def dequantize_mxfp8(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The inverse of `quantize_mxfp8`."""
    return dequantize(q, scale, MX_TILE, dtype)
