"""Embedding lookups and tied output heads that keep their gradients exact under mixed precision.

Why (measured on jax 0.10.2): a lookup `table[ids]` into a float16/bfloat16 table differentiates into a scatter-add
in that dtype. A row looked up n times in a batch accumulates n contributions one by one, and once the running sum is
about 2^8 (bfloat16) or 2^11 (float16) times one contribution, further ones round away: a row looked up 4096 times
keeps ~1/16 of its gradient in bfloat16. Stock Flax `nn.Embed(dtype=bf16)` casts the whole table before the lookup
and has this fault; torch.amp never autocasts embeddings.

* `embed_lookup(table, ids, dtype)` gathers the rows from the table as it is stored, casts them to `dtype`, and its
  gradient is a float32 scatter-add, cast to the table's dtype once at the end. With the table kept float32 in the
  compute copy (`get_policy(..., keep_float32=("*embedding",))`) the gradient is exact; with a half-precision table it
  is rounded once, not once per contribution.
* `attend(x, table)` is the tied output head: `x @ table.T` with half-precision operands and float32 accumulation and
  output, whose backward runs in `x`'s dtype too (the float32 logit gradient is rounded to `x`'s dtype once, as
  torch.amp's half-precision logits would be) and returns the table's gradient accumulated in float32. Plain
  autodiff would run both backward matmuls in float32 (one operand, the logit gradient, is float32): on an H200
  that made them TF32 GEMMs, 16 of 84 ms of a GPT-2-124M bf16 step.
* `attend_cross_entropy(x, table, targets, chunk)` is `attend` followed by the float32 cross-entropy, computed
  `chunk` tokens at a time without materialising the float32 logits of the whole batch: the forward keeps only each
  token's log-normaliser, and the backward recomputes each block's logits. On a GPT-2-124M bf16 step on an H200,
  the f32[32768, 50304] logits (6.6 GB) cost about 15 ms of memory traffic (`benchmarks/results/gpu_analysis.md`);
  the fused form trades that for one more head matmul (Liger-Kernel's fused linear cross-entropy does the same).
* `add_bias(y, bias)` is `y + bias` broadcast over the leading axes, whose backward sums the bias gradient in
  float32: autodiff would transpose the broadcast into a reduction in `y`'s dtype, over every token of the batch
  (26% relative error on a bfloat16 attention bias over 4,096 tokens, measured with `jaxamp.fidelity`).
* `Embed` and `Dense` are linen modules built on them (parameter names and initialisers as `nn.Embed`/`nn.Dense`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["Dense", "Embed", "add_bias", "attend", "attend_cross_entropy", "embed_lookup"]

# The name scope of the tied head's matmuls: `jaxamp.autocast(..., fp8=...)`'s default `fp8_exclude` matches it.
HEAD_SCOPE = "head"


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup(table: jax.Array, ids: jax.Array, dtype) -> jax.Array:
    return jnp.take(table, ids, axis=0, mode="fill").astype(dtype)  # out-of-range ids give NaN rows, not clamps


def _lookup_fwd(table, ids, dtype):
    # The residuals carry the table's row count and dtype in an empty array: [num, 0], no data.
    return _lookup(table, ids, dtype), (ids, jnp.zeros((table.shape[0], 0), table.dtype))


def _lookup_bwd(dtype, residuals, g):
    del dtype
    ids, empty = residuals
    shape = (empty.shape[0], g.shape[-1])  # [num, features]
    grad = jnp.zeros(shape, jnp.float32).at[ids].add(g.astype(jnp.float32), mode="drop")  # f32[num, features]
    return grad.astype(empty.dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def embed_lookup(table: jax.Array, ids: jax.Array, dtype: Any = None) -> jax.Array:
    """Rows of `table` at `ids`, cast to `dtype`; the table's gradient accumulates in float32.

    Args:
      table: `float[num, features]`, float32 (kept by the policy) or the compute dtype.
      ids: `int[...]` row indices in `[0, num)`; out-of-range ids (negative ones included) give NaN rows.
      dtype: dtype of the returned rows (the compute dtype); None = the table's dtype.

    Returns:
      `dtype[..., features]`.

    Raises:
      ValueError: `table` is not a 2-D float array or `ids` is not an integer array.
    """
    if jnp.ndim(table) != 2 or not jnp.issubdtype(table.dtype, jnp.floating):
        raise ValueError(f"table must be a 2-D float array [num, features], got {jnp.result_type(table)}"
                         f"{jnp.shape(table)}")
    if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
        raise ValueError(f"ids must be an integer array, got {jnp.result_type(ids)}; cast with .astype(jnp.int32)")
    # Negative ids would wrap around (Python indexing); send them past the end, where the gather fills NaN.
    ids = jnp.where(ids < 0, table.shape[0], ids)
    return _lookup(table, ids, jnp.dtype(dtype or table.dtype))


def _dot_f32(a: jax.Array, b: jax.Array, spec: str) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _attend_half(x: jax.Array, table: jax.Array) -> jax.Array:
    return _dot_f32(x, table.astype(x.dtype), "...d,vd->...v")


def _attend_fwd(x, table):
    return _attend_half(x, table), (x, table)


def _attend_bwd(residuals, g):
    x, table = residuals
    g_c = g.astype(x.dtype)  # f32[..., vocab] -> the compute dtype, once
    dx = _dot_f32(g_c, table.astype(x.dtype), "...v,vd->...d").astype(x.dtype)  # [..., features]
    g2 = g_c.reshape(-1, g_c.shape[-1])  # [tokens, vocab]
    x2 = x.reshape(-1, x.shape[-1])  # [tokens, features]
    dtable = _dot_f32(g2, x2, "nv,nd->vd").astype(table.dtype)  # [vocab, features], accumulated in float32
    return dx, dtable


_attend_half.defvjp(_attend_fwd, _attend_bwd)


def attend(x: jax.Array, table: jax.Array) -> jax.Array:
    """Tied output head: float32 logits `x @ table.T`, computed with `table` cast to `x`'s dtype.

    The forward and both backward matmuls take `x`'s dtype as operands and accumulate in float32. The logits' gradient
    is rounded to `x`'s dtype once (as torch.amp's half-precision logits); `x`'s gradient comes back in `x`'s dtype,
    `table`'s in `table`'s dtype (exact float32 when the policy keeps the table float32). For float32 `x` and table it
    is the plain einsum.

    Args:
      x: `float[..., features]` activations in the compute dtype.
      table: `float[vocab, features]` embedding table (float32 or the compute dtype).

    Returns:
      `f32[..., vocab]` logits.

    Raises:
      ValueError: `x` and `table` disagree on `features`.
    """
    if x.shape[-1] != table.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} features but the table {table.shape[-1]}: shapes {x.shape}, "
                         f"{table.shape}")
    with jax.named_scope(HEAD_SCOPE):  # the output head, by name (FP8 recipes under autocast leave it bf16)
        if x.dtype == table.dtype == jnp.float32:
            return _dot_f32(x, table, "...d,vd->...v")
        return _attend_half(x, table)


def attend_cross_entropy(x: jax.Array, table: jax.Array, targets: jax.Array, chunk: int) -> jax.Array:
    """Per-token cross-entropy of the tied head's logits, `chunk` tokens at a time, without the full logits.

    Equals `optax.softmax_cross_entropy_with_integer_labels(attend(x, table), targets)` to float32 rounding (the
    same logits, block by block; the table's gradient sums the blocks in float32), with the same dtypes as `attend`:
    matmul operands in `x`'s dtype, float32 accumulation, logits and loss in float32, the logit gradient rounded to
    `x`'s dtype once. Memory: `f32[chunk, vocab]` logits at a time instead of `f32[tokens, vocab]`; the backward
    recomputes them (one more `[tokens, features] x [features, vocab]` matmul).

    Args:
      x: `float[..., features]` activations in the compute dtype.
      table: `float[vocab, features]` embedding table (float32 or the compute dtype).
      targets: `int[...]` target ids in `[0, vocab)`, `x`'s leading shape, any integer dtype; out-of-range
        ids (negative ones included) give NaN losses.
      chunk: tokens per block (a positive int); the token count is padded up to a multiple of it.

    Returns:
      `f32[...]` per-token losses in nats.

    Raises:
      ValueError: mismatched shapes, non-integer targets or a non-positive `chunk`.
    """
    if x.shape[-1] != table.shape[-1] or targets.shape != x.shape[:-1]:
        raise ValueError(f"shapes do not fit: x {x.shape}, table {table.shape}, targets {targets.shape}; expected "
                         f"x [..., features], table [vocab, features], targets x.shape[:-1]")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be an integer array, got {targets.dtype}; cast with .astype(jnp.int32)")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk!r}")
    lead, n = x.shape[:-1], math.prod(x.shape[:-1])
    if n == 0:
        return jnp.zeros(lead, jnp.float32)
    chunk = min(chunk, n)
    pad = -n % chunk
    x2 = jnp.pad(x.reshape(n, x.shape[-1]), ((0, pad), (0, 0)))  # [tokens + pad, features]
    # int32 ids: the backward's one-hot compares them with arange(vocab), which would wrap in int8/uint8. Negative
    # ids would wrap around in the forward's gather (a finite loss whose gradient has no one-hot); send them past the
    # end, where the gather fills NaN, as for ids >= vocab.
    t2 = targets.reshape(n).astype(jnp.int32)
    t2 = jnp.pad(jnp.where(t2 < 0, table.shape[0], t2), (0, pad))  # i32[tokens + pad]
    with jax.named_scope(HEAD_SCOPE):
        return _chunked_ce(chunk, x2, table, t2)[:n].reshape(lead)


def _block_logits(xc: jax.Array, table_c: jax.Array) -> jax.Array:
    """`f32[chunk, vocab]` logits of one block, exactly as `attend` computes them (`table_c`: the table cast to
    `xc`'s dtype once, outside the loop over blocks)."""
    return _dot_f32(xc, table_c, "nd,vd->nv")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_ce(chunk: int, x: jax.Array, table: jax.Array, targets: jax.Array) -> jax.Array:
    return _chunked_ce_fwd(chunk, x, table, targets)[0]


def _chunked_ce_fwd(chunk, x, table, targets):
    table_c = table.astype(x.dtype)

    def block(args):
        xc, tc = args  # [chunk, features], [chunk]
        logits = _block_logits(xc, table_c)  # f32[chunk, vocab]
        lse = jax.nn.logsumexp(logits, axis=-1)  # f32[chunk]
        label = jnp.take_along_axis(logits, tc[:, None], axis=-1, mode="fill")[:, 0]  # f32[chunk]
        return lse - label, lse

    xs = x.reshape(-1, chunk, x.shape[-1])  # [blocks, chunk, features]
    losses, lse = lax.map(block, (xs, targets.reshape(-1, chunk)))  # f32[blocks, chunk] each
    return losses.reshape(-1), (x, table, targets, lse.reshape(-1))


def _chunked_ce_bwd(chunk, residuals, g):
    x, table, targets, lse = residuals
    table_c = table.astype(x.dtype)
    vocab = table.shape[0]

    def block(dtable, args):
        xc, tc, lc, gc = args  # [chunk, features], [chunk], f32[chunk], f32[chunk]
        logits = _block_logits(xc, table_c)  # f32[chunk, vocab]
        hit = (jnp.arange(vocab, dtype=tc.dtype) == tc[:, None]).astype(jnp.float32)  # [chunk, vocab] one-hot
        dlogits = ((jnp.exp(logits - lc[:, None]) - hit) * gc[:, None]).astype(x.dtype)  # compute dtype, once
        dxc = _dot_f32(dlogits, table_c, "nv,vd->nd").astype(x.dtype)  # [chunk, features]
        return dtable + _dot_f32(dlogits, xc, "nv,nd->vd"), dxc  # f32[vocab, features] summed over blocks

    blocks = (x.reshape(-1, chunk, x.shape[-1]), targets.reshape(-1, chunk), lse.reshape(-1, chunk),
              g.reshape(-1, chunk))
    dtable, dxs = lax.scan(block, jnp.zeros(table.shape, jnp.float32), blocks)
    return dxs.reshape(x.shape), dtable.astype(table.dtype), None


_chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)


class Embed(nn.Module):
    """`nn.Embed` whose lookup gradient accumulates in float32 (`embed_lookup`) and whose `attend` is `attend`.

    Keep its table float32 in the compute copy with `get_policy(..., keep_float32=("*embedding",))` and give it the
    compute dtype here: the rows come back in that dtype and the table's gradient is exact. The parameter is named
    `embedding`, as in `nn.Embed`.

    Attributes:
      num_embeddings: rows of the table (vocabulary size).
      features: columns (embedding width).
      dtype: dtype of the looked-up rows (the compute dtype); None = the table's dtype as it arrives.
      embedding_init: initializer of the `f32[num_embeddings, features]` table.
    """

    num_embeddings: int
    features: int
    dtype: Any = None
    embedding_init: Callable = nn.initializers.normal(stddev=1.0)

    def setup(self) -> None:
        self.embedding = self.param("embedding", self.embedding_init, (self.num_embeddings, self.features),
                                    jnp.float32)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """`int[...]` ids -> `dtype[..., features]` rows."""
        return embed_lookup(self.embedding, ids, self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """`float[..., features]` -> `f32[..., num_embeddings]` logits (`attend`)."""
        return attend(x, self.embedding)

    def cross_entropy(self, x: jax.Array, targets: jax.Array, chunk: int) -> jax.Array:
        """`float[..., features]`, `int[...]` -> `f32[...]` per-token losses of `attend`'s logits, `chunk` tokens
        at a time (`attend_cross_entropy`)."""
        return attend_cross_entropy(x, self.embedding, targets, chunk)


def add_bias(y: jax.Array, bias: jax.Array) -> jax.Array:
    """`y + bias` (bias cast to `y`'s dtype, broadcast over `y`'s leading axes); the bias gradient sums in float32.

    Args:
      y: `float[..., *bias.shape]`, e.g. `bf16[batch, seq, features]`.
      bias: `float[*trailing]` whose shape is a suffix of `y`'s (`[features]`, or `[seq, width]` for positions).

    Returns:
      `y.dtype[y.shape]`.

    Raises:
      ValueError: `bias.shape` is not a suffix of `y.shape`.
    """
    if bias.ndim > y.ndim or y.shape[y.ndim - bias.ndim:] != bias.shape:
        raise ValueError(f"bias shape {bias.shape} must be a suffix of y's shape {y.shape}")
    return _add_bias_n(bias.ndim)(y, bias)


@functools.cache
def _add_bias_n(ndim: int):
    """`_add_bias` for a bias of `ndim` trailing axes (the reduced axes are static)."""

    @jax.custom_vjp
    def f(y, bias):
        return y + bias.astype(y.dtype)

    def fwd(y, bias):
        return f(y, bias), jnp.zeros((0,), bias.dtype)  # the residual carries the bias dtype only

    def bwd(empty, g):
        lead = tuple(range(g.ndim - ndim))
        return g, jnp.sum(g.astype(jnp.float32), axis=lead).astype(empty.dtype)  # f32 accumulation

    f.defvjp(fwd, bwd)
    return f


class Dense(nn.Module):
    """`nn.Dense` (same parameters, initialisers and forward numerics) whose bias gradient sums in float32.

    Computes `x @ kernel + bias` in the dtype the inputs and parameters share (the compute dtype; no promotion), with
    `add_bias` for the bias. With `fp8=True` the matmul goes through Flax's `Fp8DirectDotGeneralOp`: inputs and
    kernel quantized to e4m3, the output gradient to e5m2, each with a per-tensor scale from an amax history of
    `fp8_amax_history` steps (delayed scaling, as Transformer Engine); those scales and histories are variables of
    the `"_overwrite_with_gradient"` collection, which `jaxamp.train_step` updates. With float16 compute the FP8 op
    runs its quantization and accumulation in float32 (float16 cannot hold the sum of FP8 products before
    dequantization, up to 448^2 per term). `dot_general_cls` is passed through as in `nn.Dense` otherwise.

    Attributes:
      features: output features.
      use_bias: whether to add a bias.
      kernel_init, bias_init: initializers of `f32[in, features]` and `f32[features]`.
      fp8: run the matmul in FP8 (see above).
      fp8_amax_history: steps of amax history per tensor (FP8 only).
      dot_general_cls: optional module class whose instances replace `lax.dot_general` (ignored with `fp8`).

    Raises:
      ValueError: the inputs and the kernel arrive in different dtypes.
    """

    features: int
    use_bias: bool = True
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()
    fp8: bool = False
    fp8_amax_history: int = 1024
    dot_general_cls: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """`float[..., in]` -> `float[..., features]` in `x`'s dtype."""
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), jnp.float32)
        bias = self.param("bias", self.bias_init, (self.features,), jnp.float32) if self.use_bias else None
        if kernel.dtype != x.dtype:
            raise ValueError(f"Dense inputs are {x.dtype} but its kernel arrived as {kernel.dtype}: cast the inputs "
                             "to the compute dtype (the dtype the policy gives the weights)")
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        if self.fp8:
            op = nn.Fp8DirectDotGeneralOp(amax_history_length=self.fp8_amax_history, name="fp8")
            # float16 cannot hold the FP8 product's sum before dequantization (448^2 per term): with float16 compute
            # the op quantizes and accumulates in float32, and the result is cast back.
            op_dtype = jnp.float32 if x.dtype == jnp.float16 else x.dtype
            y = op(x.astype(op_dtype), kernel.astype(op_dtype), dims).astype(x.dtype)  # [..., features]
        else:
            dot_general = self.dot_general_cls() if self.dot_general_cls is not None else lax.dot_general
            y = dot_general(x, kernel, dims)  # [..., features]
        return y if bias is None else add_bias(y, bias)
