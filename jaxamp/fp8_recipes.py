"""Stateless FP8 matmuls: `fp8_dot_general`, a drop-in for `lax.dot_general` under Transformer Engine's recipes.

No amax history, no FP8 collection: each matmul quantizes its operands from their current values, so

* a loss scale multiplies the output gradient before its (current-scaled) quantization and the scale cancels: with a
  power-of-2 loss scale the gradients are bitwise those of the unscaled loss;
* gradient accumulation and skipped steps need no rule (there is nothing to combine or to keep);
* a jitted step traces once and holds nothing but params and inputs.

Recipes (`RECIPES`; the quantizers are in `jaxamp.fp8_quant`), for `out = x @ w` with `x: bf16[..., m, k]` (lhs, the
activation), `w: bf16[k, n]` (rhs, the weight) and output gradient `g: bf16[..., m, n]`:

* `current` (and `current-pow2`, its scales rounded up to powers of 2: TE's reciprocal scales rounded down): x and
  w e4m3, g e5m2, one scale per tensor
  (per entry of a batched matmul's batch dims: each expert of an MoE, as TE's grouped GEMMs scale each expert).
  The backward reuses the forward's FP8 x and w (a transpose keeps a per-tensor scale) and quantizes g once for both
  dgrad (`g @ w.T`) and wgrad (`x.T @ g`).
* `block`: x and g e4m3 in 1x128 tiles along the contraction dim, w e4m3 in 128x128 blocks. The backward reuses the
  forward's FP8 w (its blocks transpose with it); x and g are quantized again from high precision along the new
  contraction dim: m (tokens) for wgrad, n for dgrad (DeepSeek-V3's 1x128 forward / 128x1 backward tiles).
* `mxfp8`: all e4m3 in 1x32 blocks along the contraction dim. Every operand of the backward is quantized again from
  high precision along its new contraction dim (TE's columnwise MXFP8 copies).

(TE `Float8CurrentScaling` with its HYBRID format, TE `Float8BlockScaling` with its defaults and DeepSeek-V3's
scheme, TE `MXFP8BlockScaling` / `jax.nn.scaled_dot_general`'s mxfp8 config.) The forward computes the backward's
quantized copies of x and w and keeps only them (FP8 data and float32 scales) as residuals, as TE does.

On a GPU: `current`'s three GEMMs (forward e4m3 x e4m3; dgrad and wgrad e5m2 x e4m3) are dots of the FP8 tensors
themselves, `dot_general(f8[b?, m, k], f8[b?, n, k], preferred_element_type=float32) * (scale_a * scale_b)`, so
XLA:GPU runs them as FP8 GEMMs whichever kernel it picks: a Triton GEMM fusion with FP8 operands, or cuBLASLt's FP8
GEMM (`__cublas$lt$matmul$f8`, the output scale folded in). The first version of this module dequantized first
(`convert(f8 -> f32) * scale`, the pattern XLA's GEMM rewriter matches); on an H200 (jax 0.11.2, 2026-12-04) the
compiled GPT-2 step held no FP8 GEMM at all (0 of 183 GEMMs; 0.46x bf16 tokens/s). A deviceless XLA:GPU compile
for sm_90 (`benchmarks/gpu_compile.py`) shows why: XLA's Triton GEMM rewriter wraps such a dot, float32 operands
and all, before its FP8 rewrite runs. The new form on an H100 (2026-12-05): 144 of 147 GEMMs of GPT-2 124M are
cuBLASLt FP8 GEMMs, at 0.87x bf16 tokens/s (the amax reductions, conversions and FP8 transposes around them cost
21 ms per step, the FP8 GEMMs save 9). cuBLASLt's FP8 kernels write float32 there; `current-pow2` (power-of-2
scales, Transformer Engine's `use_power_2_scales`) lets them write bf16 with the scales in their epilogue (`_dot`).
`block` and `mxfp8` scales are per tile, which neither kernel takes: `block` runs as float32 GEMMs on dequantized
operands, numerics only, until a block-scaled kernel is used (DeepGEMM's on Hopper). `mxfp8` calls
`jax.nn.scaled_dot_general` on a Blackwell GPU (`mx_kernel`), whose MXFP8 tensor cores it reaches through cuDNN,
and runs as numerics elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from jaxamp import fp8_quant
from jaxamp.fp8_quant import E4M3, E5M2, MX_TILE, ROW_TILE, WEIGHT_TILE, check_mxfp8_dim, dequantize
from jaxamp.remat import FP8_OUTPUT_NAME

__all__ = ["FP8_EXCLUDE", "FP8_SCOPE", "MX_KERNEL_ENV", "RECIPES", "Operand", "Recipe", "fp8_dot_general", "fp8_scope",
           "get_recipe", "mx_kernel", "recipe_dot_general"]


@dataclasses.dataclass(frozen=True)
class Operand:
    """How one tensor is quantized: FP8 `dtype`, `tile` over its last two axes `[rows, k]` (None: one scale for the
    tensor) and whether the scales are rounded up to powers of 2."""

    dtype: jnp.dtype
    tile: tuple[int, int] | None
    power_of_2: bool

    @property
    def transposable(self) -> bool:
        """Whether the quantized copy, transposed, is the quantized transpose (per-tensor or square tiles)."""
        return self.tile is None or self.tile[0] == self.tile[1]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A recipe: the quantization of lhs `x` (tiles along k), rhs `w` (stored `[n, k]`) and the output gradient `g`
    (`[m, n]`); `multiple`: the block size every tiled dim must be a multiple of (None: partial tiles allowed)."""

    name: str
    x: Operand
    w: Operand
    g: Operand
    multiple: int | None = None

    def with_power_of_2(self, on: bool) -> Recipe:
        """The recipe with power-of-2 scales on or off for all three tensors (mxfp8's e8m0 scales are always)."""
        if self.multiple is not None and not on:
            raise ValueError(f"recipe {self.name!r} has e8m0 scales, which are powers of 2: power_of_2=False is "
                             "not an option")
        return dataclasses.replace(self, **{k: dataclasses.replace(getattr(self, k), power_of_2=on)
                                            for k in ("x", "w", "g")})


RECIPES: dict[str, Recipe] = {
    "current": Recipe("current", Operand(E4M3, None, False), Operand(E4M3, None, False), Operand(E5M2, None, False)),
    "current-pow2": Recipe("current-pow2", Operand(E4M3, None, True), Operand(E4M3, None, True),
                           Operand(E5M2, None, True)),
    "block": Recipe("block", Operand(E4M3, ROW_TILE, True), Operand(E4M3, WEIGHT_TILE, True),
                    Operand(E4M3, ROW_TILE, True)),
    "mxfp8": Recipe("mxfp8", Operand(E4M3, MX_TILE, True), Operand(E4M3, MX_TILE, True), Operand(E4M3, MX_TILE, True),
                    multiple=fp8_quant.MX_BLOCK),
}


def get_recipe(recipe: str | Recipe, power_of_2: bool | None = None) -> Recipe:
    """`RECIPES[recipe]` (or `recipe` itself), with `power_of_2` overriding its default where given.

    Raises:
      ValueError: an unknown name (the message lists the known ones), or power_of_2=False for mxfp8.
    """
    if not isinstance(recipe, Recipe):
        if recipe not in RECIPES:
            raise ValueError(f"unknown FP8 recipe {recipe!r}; known recipes: {', '.join(sorted(RECIPES))}")
        recipe = RECIPES[recipe]
    return recipe if power_of_2 is None else recipe.with_power_of_2(power_of_2)


# --- the matmuls on the canonical form: x [batch?, m, k], w [batch?, n, k], contraction over the last axes ---

def _quantize(t: jax.Array, op: Operand) -> tuple[jax.Array, jax.Array]:
    """`t: [batch?, rows, k]` quantized: per-tensor scales are one per batch entry (`f32[b, 1, 1]`: each expert of
    an MoE's batched matmul its own tensor), tiles run over the last two axes of each entry."""
    if op.tile is None:
        return fp8_quant.quantize_current(t, op.dtype, power_of_2=op.power_of_2, batch_axes=t.ndim - 2)
    return fp8_quant.quantize_tiles(t, op.tile, op.dtype, power_of_2=op.power_of_2)


def _swap(t: jax.Array) -> jax.Array:
    return jnp.swapaxes(t, -1, -2)


def _transposed(qs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """A quantized `[.., r, c]` as the quantized `[.., c, r]`: valid for per-tensor scales and square tiles."""
    q, scale = qs
    return _swap(q), (_swap(scale) if scale.ndim >= 2 else scale)


def _epilogue_scales(op_a: Operand, op_b: Operand, out_dtype) -> bool:
    """Whether the GEMM writes `out_dtype` itself with the scales folded in (see `_dot`): on a GPU, per-tensor
    power-of-2 scales (their product is exact in bfloat16, whose exponent range is float32's), a bfloat16 output."""
    exact = op_a.tile is None and op_b.tile is None and op_a.power_of_2 and op_b.power_of_2
    return exact and jnp.dtype(out_dtype) == jnp.bfloat16 and jax.default_backend() == "gpu"


def _dot(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array], op_a: Operand, op_b: Operand,
         precision, out_dtype=jnp.float32) -> jax.Array:
    """`dequant(a) [.., p, c] . dequant(b) [.., q, c]` over c with float32 accumulation, rounded once to
    `out_dtype`: `out_dtype[.., p, q]`.

    Per-tensor scales (both operands): the FP8 values themselves are the dot's operands (`f8 . f8 -> f32`, the FP8
    GEMM whatever XLA's GEMM rewrites and autotuner pick) and the two scalar scales multiply its output. On a GPU
    with power-of-2 scales the dot is `f8 . f8 -> out_dtype` and the scale product, exact in `out_dtype`, multiplies
    that: XLA folds both into cuBLASLt's FP8 GEMM, which scales its float32 accumulator and writes bf16 (the same
    value as the float32 form rounded once), not float32 for a separate kernel to round (compiled for an H200, GPT-2
    124M: 9.99 GiB of kernel traffic per layer against 12.23; bf16-autocast 8.69). Other scales rounded to bf16
    would change 58% of a dgrad's elements (measured): they keep the float32 form. Per-tile scales: the dot runs on
    the dequantized float32 operands (numerics)."""
    qa, qb = a[0], b[0]
    batch = tuple(range(qa.ndim - 2))
    dims = (((qa.ndim - 1,), (qb.ndim - 1,)), (batch, batch))
    with jax.named_scope(fp8_scope(op_a.dtype, op_b.dtype)):  # the precision audit reads the FP8 formats here
        if _epilogue_scales(op_a, op_b, out_dtype):
            out = lax.dot_general(qa, qb, dims, precision=precision, preferred_element_type=out_dtype)
            return out * (a[1] * b[1]).astype(out_dtype)  # a power of 2: exact
        if op_a.tile is None and op_b.tile is None:
            out = lax.dot_general(qa, qb, dims, precision=precision, preferred_element_type=jnp.float32)
            return (out * (a[1] * b[1])).astype(out_dtype)  # f32[.., p, q] * f32[]
        lhs, rhs = dequantize(*a, op_a.tile), dequantize(*b, op_b.tile)  # convert(f8 -> f32) * per-tile scales
        out = lax.dot_general(lhs, rhs, dims, precision=precision, preferred_element_type=jnp.float32)
        return out.astype(out_dtype)


FP8_SCOPE = "jaxamp_fp8"

# The matmuls `jaxamp.autocast(..., fp8=...)` keeps in the compute dtype by default (regular expressions searched in
# each name on a matmul's name stack, its weight's module and param paths, and the functions on its call stack): the
# output head (lm1b's "logitdense", GPT-2's "lm_head", jaxamp.layers.attend's "head" scope, an NNX or Equinox
# model's untied `head` / `lm_head` by its param path, a method such as `GPT.head` or `GPT.logits`, the
# tied-embedding head `Embed.attend` of linen and NNX, Gemma's, and a head class's call, ESM2's
# `LogitHead.__call__`), which Transformer Engine's recipes also leave in bf16, and an MoE's router (DeepSeek-V3
# keeps its gating in BF16 or FP32; its logits pick the experts) by its usual names: `router` (Switch, Flaxformer,
# DBRX, Llama 4) and the `gate` of an `mlp` / `moe` / `block_sparse_moe` (DeepSeek, Qwen-MoE, OLMoE, Mixtral; a
# dense model's gated projection is `gate_proj` there). Anchored to whole names (or a method's
# name after its class's): a substring "head" would also match Equinox's "eqx.nn.MultiheadAttention" and a linen
# `Dense(name="multihead_proj")`.
FP8_EXCLUDE = (r"(^|\.)(lm_)?head$", r"(^|\.)logits?(dense)?$", r"(^|\.)classifier$", r"(^|\.)Embed\.attend$",
               r"Head\.__call__$", r"(^|\.)router$", r"(^|\.)(mlp|moe|block_sparse_moe)\.gate$")


def fp8_scope(lhs_dtype, rhs_dtype) -> str:
    """The name scope around an FP8 matmul on dequantized operands: `"jaxamp_fp8:float8_e4m3fn:float8_e5m2"`."""
    return f"{FP8_SCOPE}:{jnp.dtype(lhs_dtype).name}:{jnp.dtype(rhs_dtype).name}"


@dataclasses.dataclass(frozen=True)
class _Static:
    recipe: Recipe
    out_dtype: jnp.dtype
    precision: object
    x_dtype: jnp.dtype
    w_dtype: jnp.dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_dot(x: jax.Array, w: jax.Array, static: _Static) -> jax.Array:
    r = static.recipe
    out = _dot(_quantize(x, r.x), _quantize(w, r.w), r.x, r.w, static.precision, static.out_dtype)  # [.., m, n]
    return checkpoint_name(out, FP8_OUTPUT_NAME)  # what recompute_elementwise saves


def _fp8_dot_fwd(x, w, static: _Static):
    # symbolic_zeros: x and w arrive as CustomVJPPrimal. An operand nothing differentiates (a step's raw input batch,
    # a frozen weight) gets no gradient GEMM at all, so the precision audit counts only the GEMMs XLA keeps.
    need_dx, need_dw = x.perturbed, w.perturbed
    x, w = x.value, w.value
    r = static.recipe
    if r.multiple is not None:  # the backward contracts over m (wgrad) and n (dgrad)
        check_mxfp8_dim(x.shape[-2], "the lhs's non-contracting size (rows: wgrad contracts over it)")
        check_mxfp8_dim(w.shape[-2], "the rhs's non-contracting size (dgrad contracts over it)")
    xq, wq = _quantize(x, r.x), _quantize(w, r.w)
    out = checkpoint_name(_dot(xq, wq, r.x, r.w, static.precision, static.out_dtype), FP8_OUTPUT_NAME)
    # The backward's copies: x^T [.., k, m] tiled along m, w^T [.., k, n] tiled along n (or the forward's, transposed).
    # Each is kept only for the gradient that needs it (x^T for the weight's, w^T for the input's): a None residual
    # tells the backward to skip that gradient.
    x_res = None if not need_dw else xq if r.x.transposable else _quantize(_swap(x), r.x)
    w_res = None if not need_dx else wq if r.w.transposable else _quantize(_swap(w), r.w)
    return out, (x_res, w_res)


def _fp8_dot_bwd(static: _Static, res, g):
    r = static.recipe
    x_res, w_res = res
    if isinstance(g, SymbolicZero):  # the output is not differentiated: no gradient for either operand
        return None, None
    gq = _quantize(g, r.g)  # [.., m, n], tiles along n: dgrad's contraction
    dx = dw = None
    if w_res is not None:  # dgrad
        w_t = _transposed(w_res) if r.w.transposable else w_res  # [.., k, n]
        dx = _dot(gq, w_t, r.g, r.w, static.precision, static.x_dtype)  # [.., m, k]
    if x_res is not None:  # wgrad
        g_t = _transposed(gq) if r.g.transposable else _quantize(_swap(g), r.g)  # [.., n, m], tiles along m
        x_t = _transposed(x_res) if r.x.transposable else x_res  # [.., k, m]
        dw = _dot(g_t, x_t, r.g, r.x, static.precision).astype(static.w_dtype)  # f32[.., n, k]: no epilogue
    return dx, dw


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd, symbolic_zeros=True)


# --- dot_general's dimension numbers onto the canonical form and back ---

def _canonical(t: jax.Array, batch: Sequence[int], contract: Sequence[int]) -> jax.Array:
    """`t` transposed to (batch, free, contract) dims and flattened to `[batch?, free, contract]`."""
    free = [d for d in range(t.ndim) if d not in batch and d not in contract]
    size = lambda dims: math.prod(t.shape[d] for d in dims)
    shape = ((size(batch),) if batch else ()) + (size(free), size(contract))
    perm = (*batch, *free, *contract)
    return (lax.transpose(t, perm) if perm != tuple(range(t.ndim)) else t).reshape(shape)


def _check_operands(lhs, rhs, dims, out_sharding) -> None:
    for name, t in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(t.dtype, jnp.floating):
            raise TypeError(f"fp8_dot_general quantizes floating-point operands; {name} is {t.dtype}")
    if out_sharding is not None:
        raise ValueError("fp8_dot_general does not take out_sharding")
    # lax.dot_general's own checks (and messages) of the dimension numbers, on shapes only.
    jax.eval_shape(functools.partial(lax.dot_general, dimension_numbers=dims),
                   jax.ShapeDtypeStruct(lhs.shape, jnp.float32), jax.ShapeDtypeStruct(rhs.shape, jnp.float32))


def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None, preferred_element_type=None,
                    *, recipe: str | Recipe = "current", compute_dtype=jnp.bfloat16, power_of_2: bool | None = None,
                    out_sharding=None) -> jax.Array:
    """`lax.dot_general(lhs, rhs, dimension_numbers)` with FP8 operands, stateless, under `recipe` (see the module).

    `lhs` is the activation (`bf16[batch, in]`, `bf16[b, t, d]`), `rhs` the weight (`bf16[in, out]`,
    `f32[d, heads, head_dim]`); any dimension numbers `lax.dot_general` takes (batch dims, several contracting
    dims): the operands are transposed and reshaped to `[batch, rows, k]` / `[batch, n, k]` (batch dims, free dims
    and contracting dims each flattened into one), so tiles run along the flattened contraction. The forward
    contracts with float32 accumulation: the FP8 values themselves, times the two per-tensor scales afterwards
    (`current`; with batch dims, one scale per batch entry of each operand: an MoE's `"egcd,edf->egcf"` scales each
    expert's weight and tokens alone, as Transformer Engine's grouped GEMMs do), or the operands dequantized per
    tile (`convert(f8 -> f32) * scale`: `block`, `mxfp8`); the result is `compute_dtype` (`preferred_element_type`
    instead where given: `jnp.einsum` passes its operands' result type). The backward quantizes the output gradient
    (e5m2 for `current`, e4m3 otherwise) and returns cotangents in the operands' dtypes. `precision` goes to the
    inner dots.

    Fits `nn.Dense(dot_general=...)` and `jnp.einsum(..., _dot_general=...)` (through `recipe_dot_general`); in an
    einsum the operand that reaches rhs is the weight: write the activation first (`"btd,dk->btk"`; einsum swaps the
    operands where the output lists the second operand's dims first).

    Raises:
      TypeError: a non-floating operand.
      ValueError: an unknown recipe; dimension numbers `lax.dot_general` refuses; for mxfp8 a contraction size (or,
        when differentiated, a non-contracting size) that is not a multiple of 32.
    """
    r = get_recipe(recipe, power_of_2)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    (lc, rc), (lb, rb) = dimension_numbers
    norm = lambda dims, nd: tuple(int(d) % nd for d in dims)
    lc, lb, rc, rb = norm(lc, lhs.ndim), norm(lb, lhs.ndim), norm(rc, rhs.ndim), norm(rb, rhs.ndim)
    _check_operands(lhs, rhs, ((lc, rc), (lb, rb)), out_sharding)
    x, w = _canonical(lhs, lb, lc), _canonical(rhs, rb, rc)  # [b?, m, k], [b?, n, k]
    if r.multiple is not None:
        check_mxfp8_dim(x.shape[-1], "the contraction size (the product of the contracting dims)")
    out_dtype = jnp.dtype(preferred_element_type if preferred_element_type is not None else compute_dtype)
    precision = tuple(precision) if isinstance(precision, list) else precision
    if r.name == "mxfp8" and mx_kernel():  # Blackwell: JAX's own block-scaled GEMM (cuDNN)
        out = _scaled_dot_general(x, w, out_dtype)
    else:
        out = _fp8_dot(x, w, _Static(r, out_dtype, precision, lhs.dtype, rhs.dtype))  # [b?, m, n]
    free = lambda t, batch, contract: [t.shape[d] for d in range(t.ndim) if d not in batch and d not in contract]
    shape = [lhs.shape[d] for d in lb] + free(lhs, lb, lc) + free(rhs, rb, rc)
    return out.reshape(shape)


MX_KERNEL_ENV = "JAXAMP_MXFP8_KERNEL"  # "jax": always jax.nn.scaled_dot_general; "numerics": never; unset: auto


def mx_kernel() -> bool:
    """Whether the `mxfp8` recipe runs through `jax.nn.scaled_dot_general` (a block-scaled MXFP8 GEMM through
    cuDNN) rather than as float32 GEMMs on dequantized operands: on a CUDA GPU of compute capability 10.0 or more
    (Blackwell), where that kernel exists. The two compute the same FP8 values, scales and gradients (tested on the
    CPU by lowering JAX's `scaled_matmul` as JAX does on ROCm). `JAXAMP_MXFP8_KERNEL=jax` forces it, `=numerics`
    keeps the numerics path; read at trace time.

    Raises:
      ValueError: another value of `JAXAMP_MXFP8_KERNEL`.
    """
    choice = os.environ.get(MX_KERNEL_ENV, "")
    if choice not in ("", "jax", "numerics"):
        raise ValueError(f"{MX_KERNEL_ENV}={choice!r}: use 'jax' (jax.nn.scaled_dot_general), 'numerics' (float32 "
                         "GEMMs on dequantized operands) or leave it unset (scaled_dot_general on Blackwell GPUs)")
    if choice:
        return choice == "jax"
    if jax.default_backend() != "gpu":
        return False
    capability = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return capability is not None and float(capability) >= 10.0
    except ValueError:
        return False


def _scaled_dot_general(x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
    """`x [b?, m, k] . w [b?, n, k]` over k through `jax.nn.scaled_dot_general`'s mxfp8 config (its own custom
    VJP: e4m3 in 1x32 blocks along each GEMM's contraction dim, e8m0 scales); cotangents in the operands' dtypes."""
    config = jax.nn.get_scaled_dot_general_config("mxfp8")
    batch = (0,) if x.ndim == 3 else ()
    dims = (((x.ndim - 1,), (w.ndim - 1,)), (batch, batch))

    @jax.custom_vjp
    def dot(x, w):
        return jax.nn.scaled_dot_general(x, w, dims, preferred_element_type=out_dtype, configs=[config] * 3)

    def fwd(x, w):
        out, vjp = jax.vjp(lambda a, b: jax.nn.scaled_dot_general(a, b, dims, preferred_element_type=out_dtype,
                                                                  configs=[config] * 3), x, w)
        return out, vjp

    def bwd(vjp, g):
        dx, dw = vjp(g)
        return dx.astype(x.dtype), dw.astype(w.dtype)

    dot.defvjp(fwd, bwd)
    return dot(x, w)


def recipe_dot_general(recipe: str | Recipe, *, compute_dtype=jnp.bfloat16,
                       power_of_2: bool | None = None) -> Callable[..., jax.Array]:
    """`fp8_dot_general` bound to a recipe: for `nn.Dense(dot_general=...)`, `jnp.einsum(..., _dot_general=...)`.

    Raises:
      ValueError: an unknown recipe name (the message lists `RECIPES`), or power_of_2=False for mxfp8.
    """
    resolved = get_recipe(recipe, power_of_2)
    return functools.partial(fp8_dot_general, recipe=resolved, compute_dtype=compute_dtype)
