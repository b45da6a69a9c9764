"""Attention with its softmax in float32: a float32 island for half-precision inputs.

`dot_product_attention` is `jax.nn.dot_product_attention` for half-precision query, key and value: cuDNN's fused
kernel on a GPU (bf16/fp16 matmuls, its softmax in float32 inside the kernel), else JAX's XLA path on float32 copies
of the inputs (logits and softmax in float32), the output cast back to the inputs' dtype. jaxamp's LM uses it; so
can any model's attention.

Under `jaxamp.autocast` (torch.amp's autocast runs `scaled_dot_product_attention` in the compute dtype, its flash
kernels included) a call of it runs as attention in the compute dtype: float32 query, key and value (float32 model
code) are cast to bfloat16/float16 and go to cuDNN's fused kernel on a GPU, its output in the compute dtype. The
call is one named `jax.jit` (`ATTENTION_JIT_NAMES`) so that autocast can find it in the traced program; where cuDNN
does not apply (a CPU, a mask, a head size it refuses), autocast runs the call's traced body under its op classes
(the two matmuls in the compute dtype, the softmax in float32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["ATTENTION_JIT_NAMES", "cudnn_attention", "dot_product_attention"]


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    mask: jax.Array | None = None,
    is_causal: bool = False,
) -> jax.Array:
    """Attention with its softmax in float32, built on ``jax.nn.dot_product_attention``.

    Under ``jaxamp.autocast`` a call runs in the compute dtype instead: cuDNN's kernel on a GPU, elsewhere its two
    matmuls in the compute dtype and the softmax in float32 (see the module).

    Half-precision (float16/bfloat16) query, key and value are cast to
    float32, passed to ``jax.nn.dot_product_attention`` (XLA path: logits and
    softmax in float32, masking with the finite value -0.7 * max(float32), so
    a fully masked row yields a finite uniform average of the values instead
    of NaN), and the output is cast back to the input dtype. float32 (or
    wider) inputs pass through unchanged.

    Why cast instead of passing half-precision arrays straight in (checked
    with jax 0.10.2, CPU):

    * For float16/bfloat16 the XLA path requests the dot algorithms
      ``F16_F16_F32``/``BF16_BF16_F32``. XLA:CPU rejects ``F16_F16_F32`` when
      the call is inside ``jit`` (JAX's ``try``/``except`` fallback only
      catches that in eager mode), and the *backward* dots of those
      algorithms fail to lower under ``jax_numpy_dtype_promotion="strict"``
      (``DotAlgorithmPreset.supported_output_types`` calls ``promote_types``
      on float32 x bfloat16 while lowering the transposed dot).
    * Its first line, ``jnp.promote_types(query.dtype, float32)``, raises under
      strict promotion for half-precision inputs.

    Numerically the logits are unchanged (products of float16/bfloat16 numbers
    are exact in float32 and JAX accumulates them in float32 anyway); the
    probabilities are no longer rounded to the compute dtype before the value
    matmul, which is slightly more accurate. The cost is that the two
    attention matmuls run in float32 (about ``seq / (6 * width)`` of the
    model's matmul FLOPs). ``implementation=None`` in jax 0.10.2 always
    selects the XLA path.

    Args:
        query: ``float[batch, q_seq, heads, head_dim]``.
        key: ``float[batch, kv_seq, heads, head_dim]``, same dtype as ``query``.
        value: ``float[batch, kv_seq, heads, head_dim]``, same dtype as ``query``.
        mask: Optional ``bool`` mask broadcastable to
            ``[batch, heads, q_seq, kv_seq]``; True = may attend.
        is_causal: Apply a causal (lower-triangular) mask.

    Returns:
        ``float[batch, q_seq, heads, head_dim]`` in ``query.dtype``.

    Raises:
        ValueError: If query, key and value dtypes differ.
    """
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}; "
            f"cast them explicitly"
        )
    return (_causal_attention if is_causal else _attention)(query, key, value, mask)


def _island(query, key, value, mask, is_causal: bool) -> jax.Array:
    dtype = query.dtype
    if jnp.finfo(dtype).bits < 32:
        fused = cudnn_attention(query, key, value, mask=mask, is_causal=is_causal)
        if fused is not None:
            return fused
        query, key, value = (a.astype(jnp.float32) for a in (query, key, value))
    out = jax.nn.dot_product_attention(query, key, value, mask=mask, is_causal=is_causal)
    return out.astype(dtype)


# The jits' names are what `jaxamp.autocast` looks for: name -> is_causal.
ATTENTION_JIT_NAMES = {"jaxamp_attention": False, "jaxamp_causal_attention": True}


def _named_jit(name: str, is_causal: bool):
    def core(query, key, value, mask):
        return _island(query, key, value, mask, is_causal)

    core.__name__ = core.__qualname__ = name  # the jit equation's `name` param
    return jax.jit(core)


_attention, _causal_attention = (_named_jit(name, causal) for name, causal in ATTENTION_JIT_NAMES.items())


def cudnn_attention(query, key, value, *, mask=None, is_causal=False) -> jax.Array | None:
    """cuDNN's fused attention for float16/bfloat16 on a GPU (softmax in float32 inside the kernel), else None.

    Used only on the GPU backend (``jax.nn.dot_product_attention(..., implementation="cudnn")``; its default
    ``implementation=None`` picks the XLA path) and without a mask. Shapes or head sizes that cuDNN rejects at
    trace time give None too (the caller falls back). Not exercised on CPU, where the tests run.

    Args:
        query, key, value: ``f16|bf16[batch, seq, heads, head_dim]``, one dtype.
        mask: must be None for the fused kernel (a mask gives None).
        is_causal: Apply a causal (lower-triangular) mask.

    Returns:
        ``[batch, q_seq, heads, head_dim]`` in the inputs' dtype, or None.
    """
    if jax.default_backend() != "gpu" or mask is not None or jnp.finfo(query.dtype).bits >= 32:
        return None
    try:
        with jax.numpy_dtype_promotion("standard"):  # jax's own promote_types(dtype, float32) inside
            return jax.nn.dot_product_attention(query, key, value, is_causal=is_causal, implementation="cudnn")
    except (ValueError, NotImplementedError, RuntimeError):
        return None
