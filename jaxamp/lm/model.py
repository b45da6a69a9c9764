"""GPT-style decoder-only Transformer language model (nanoGPT architecture) in Flax linen.

The architecture follows Andrej Karpathy's nanoGPT ``model.py``
(https://github.com/karpathy/nanoGPT): token + learned position embeddings,
embedding dropout, ``num_layers`` pre-norm blocks (LayerNorm -> causal
self-attention -> residual; LayerNorm -> MLP with exact-erf GELU -> residual),
a final LayerNorm and an output head tied to the token embedding. Weights are
initialised like nanoGPT: normal(0.02) for Dense and Embed kernels, zero
biases, and normal(0.02 / sqrt(2 * num_layers)) for the two residual output
projections (attention ``c_proj`` and MLP ``c_proj``).

Precision contract
------------------
The model holds no dtype fields and casts nothing except inside its float32
islands. The training step casts the float32 master parameters to the compute
dtype (float16, bfloat16 or float32) *before* calling ``model.apply``, and the
model then computes in whatever dtype its parameters arrive in:

* Dense layers are built with ``dtype=None``, so linen infers the
  computation dtype from inputs and parameters. The embedding lookups gather
  rows from the tables as they arrive and cast them to the compute dtype, the
  dtype of the blocks' weights (``jaxamp.layers.embed_lookup``), so the
  residual stream is in the compute dtype and every Dense matmul runs in it.
  Under ``get_policy(precision, keep_float32=LM_KEEP_FLOAT32)`` the tables stay
  float32 and their gradients (lookup scatter-add plus tied head) are exact
  float32 sums; with a plain preset they arrive in the compute dtype and the
  lookups' gradients still accumulate in float32, rounded once.
* Float32 islands, whatever the parameter dtype:
  (a) LayerNorm: statistics and normalisation in float32 (two-pass mean and
      variance), result cast back to the input's dtype;
  (b) attention: q, k, v are cast to float32 and go through
      ``jax.nn.dot_product_attention(..., is_causal=True)``, whose XLA path
      computes logits and softmax in float32 and masks with a finite large
      negative value, so even a fully masked row is finite; the output is cast
      back to the compute dtype (see :func:`dot_product_attention` for why the
      half-precision inputs are not passed to JAX directly);
  (c) logits: the tied head (``jaxamp.layers.attend``) multiplies in the
      compute dtype with ``preferred_element_type=jnp.float32``, so logits
      are float32 and are never rounded through float16; its backward
      matmuls also take compute-dtype operands (the float32 logit gradient
      is rounded to the compute dtype once, as torch.amp's half-precision
      logits would be) and accumulate in float32.

Depth
-----
``TransformerConfig.scan_layers`` runs the blocks as one ``nn.scan`` over parameters stacked on a leading
``[num_layers]`` axis (the tree ``{wte, wpe, h, ln_f}``, ``h`` holding every block's leaves ``[num_layers, ...]``,
the FP8 scales and amax histories ``[num_layers, 1]`` and ``[num_layers, history]``): one block is traced and
compiled for all layers, so compile time stops growing with depth. Off (the default), the blocks are unrolled as
``h_0 .. h_{L-1}``, the parameter names and numerics of every earlier version. :func:`stack_params` and
:func:`unstack_params` convert between the two trees; from the same weights both give the same loss and gradients, to
float32 rounding in float32 (in half precision to that precision's rounding: XLA fuses the two programs otherwise).
``TransformerConfig.remat`` names a rematerialisation policy (:data:`REMAT_POLICIES`) applied to each block, scanned
or not: the backward pass recomputes what the policy does not save, the same math in less memory.

Everything, gradients included, runs under
``jax_numpy_dtype_promotion="strict"``: there is no implicit dtype promotion
anywhere. Because LayerNorm casts its own scale and bias to float32, a
policy that keeps LayerNorm parameters in float32 while casting the rest also
works.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxamp.attention import dot_product_attention
from jaxamp.fp8_collection import FP8_COLLECTION
from jaxamp.layers import Dense, Embed, add_bias
from jaxamp.remat import recompute_elementwise

__all__ = [
    "LM_KEEP_FLOAT32",
    "REMAT_POLICIES",
    "STACK_NAME",
    "TransformerConfig",
    "LayerNorm",
    "CausalSelfAttention",
    "MLP",
    "Block",
    "TransformerLM",
    "cross_entropy_loss",
    "count_params",
    "generate",
    "remat_policy",
    "stack_params",
    "unstack_params",
]

# The LM's leaves that stay float32 in the compute copy: `get_policy(precision, keep_float32=LM_KEEP_FLOAT32)`.
# Its lookups then accumulate their gradients exactly in float32 (see jaxamp.layers).
LM_KEEP_FLOAT32 = ("wte/embedding", "wpe/embedding")

# `TransformerConfig.remat` -> the `jax.checkpoint_policies` entry each block is rematerialised with (None: none).
# full: nothing saved, the whole block recomputed in the backward pass (`nn.remat`'s default); dots: every matmul
# output saved, the rest (LayerNorm, GELU, softmax, dropout masks) recomputed; dots_with_no_batch_dims: only the
# matmuls without batch dimensions saved (the Dense layers' outputs), the attention core's batched einsums recomputed;
# elementwise: every op's output saved but the elementwise ops' (`jaxamp.remat.recompute_elementwise`: matmul
# outputs in the compute dtype, attention and norm statistics saved; GELU, bias adds, casts, FP8 quantization
# recomputed; no matmul runs twice).
REMAT_POLICIES = {
    "none": None,
    "full": "nothing_saveable",
    "dots": "dots_saveable",
    "dots_with_no_batch_dims": "dots_with_no_batch_dims_saveable",
    "elementwise": "recompute_elementwise",
}
# The scanned stack's parameter subtree (`h_0 .. h_{L-1}` stacked) and the unrolled blocks' names.
STACK_NAME = "h"
_LAYER_NAME = re.compile(r"h_(\d+)")

# nanoGPT initialisation scale for every Dense and Embed kernel.
_INIT_STD = 0.02
_F32_TINY = float(jnp.finfo(jnp.float32).tiny)  # smallest normal float32: a smaller temperature flushes to 0
# PyTorch's nn.LayerNorm default epsilon, as used by nanoGPT.
_LAYER_NORM_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of :class:`TransformerLM`.

    Attributes:
        vocab_size: Number of distinct tokens.
        seq_len: Maximum context length in tokens (size of the position table).
        num_layers: Number of Transformer blocks.
        num_heads: Number of attention heads; must divide ``width``.
        width: Model width ``d_model`` (features per token).
        mlp_ratio: MLP hidden width as a multiple of ``width``.
        dropout: Dropout probability in [0, 1).
        use_bias: Whether Dense layers and LayerNorms have biases (nanoGPT's
            ``bias`` flag).
        fp8: Whether the Dense matmuls (attention projections and MLP) run in
            FP8 through Flax's ``Fp8DirectDotGeneralOp`` (e4m3 inputs and
            kernels, e5m2 output gradients, delayed per-tensor scaling). The
            tied head and the attention core stay in the 16-bit compute dtype,
            as Transformer Engine keeps them: the head's logits feed the
            float32 loss directly and are the most sensitive matmul, and the
            attention core runs in cuDNN's fused kernel. The scales and amax
            histories are variables of the ``"_overwrite_with_gradient"``
            collection: pass the whole variables dict to ``TrainState.create``.
        fp8_amax_history: Steps of amax history per FP8 tensor.
        loss_chunk: Tokens per block of the fused head + cross-entropy
            (``jaxamp.layers.attend_cross_entropy``) when the model is called
            with ``targets``; 0 materialises the ``f32[batch, seq, vocab]``
            logits and takes the cross-entropy of them. Either way the loss
            is the same to float32 rounding; the fused form never holds more
            than ``f32[loss_chunk, vocab]`` logits.
        scan_layers: Whether the blocks run as one ``nn.scan`` over
            parameters stacked on a leading ``[num_layers]`` axis (subtree
            ``h``; one block compiled for all layers) instead of unrolled as
            ``h_0 .. h_{L-1}``. Dropout draws each layer's mask from its own
            split of the ``'dropout'`` stream (``split_rngs``), and ``init``
            each layer's weights from its own split of ``'params'`` (so
            ``init`` of a scanned model is not the stacked ``init`` of the
            unrolled one; ``stack_params`` of that is a valid scanned tree).
        remat: Rematerialisation of each block, a key of
            :data:`REMAT_POLICIES`: ``none`` | ``full`` | ``dots`` |
            ``dots_with_no_batch_dims``. Same parameters and math whatever the
            name; only what the backward pass keeps or recomputes changes.

    Raises:
        ValueError: On a non-positive size, a ``num_heads`` that does not
            divide ``width``, a ``dropout`` outside [0, 1), a ``scan_layers``
            that is not a bool or an unknown ``remat`` name.
    """

    vocab_size: int  # tokens
    seq_len: int  # tokens (maximum context length)
    num_layers: int = 4  # blocks
    num_heads: int = 4  # attention heads
    width: int = 128  # features per token (d_model)
    mlp_ratio: int = 4  # MLP hidden features per model feature (multiple of width)
    dropout: float = 0.0  # probability in [0, 1)
    use_bias: bool = True  # flag: biases in Dense layers and LayerNorms
    fp8: bool = False  # flag: Dense matmuls in FP8 (e4m3/e5m2, delayed scaling); head and attention stay 16-bit
    fp8_amax_history: int = 1024  # steps of amax history per FP8 tensor
    loss_chunk: int = 0  # tokens per block of the fused head + loss; 0 = whole f32 logits
    scan_layers: bool = False  # flag: blocks as one nn.scan over stacked parameters (subtree "h")
    remat: str = "none"  # rematerialisation of each block: a key of REMAT_POLICIES

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "num_heads", "width", "mlp_ratio", "fp8_amax_history"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"TransformerConfig.{name} must be a positive integer, got {value!r}; "
                    f"set {name} to an integer >= 1"
                )
        if self.width % self.num_heads != 0:
            raise ValueError(
                f"TransformerConfig: heads ({self.num_heads}) must divide width ({self.width}); "
                f"choose num_heads that divides width, or a width that is a multiple of num_heads"
            )
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                f"TransformerConfig.dropout must be a probability in [0, 1), got {self.dropout!r}; "
                f"use e.g. 0.0 (no dropout) or 0.1"
            )
        if isinstance(self.loss_chunk, bool) or not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise ValueError(
                f"TransformerConfig.loss_chunk must be an integer >= 0 (tokens), got {self.loss_chunk!r}; "
                f"use 0 (whole logits) or e.g. 4096"
            )
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"TransformerConfig.scan_layers must be a bool, got {self.scan_layers!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"TransformerConfig.remat must be one of {', '.join(REMAT_POLICIES)}, got "
                             f"{self.remat!r}")

    @property
    def head_dim(self) -> int:
        """Features per attention head: ``width // num_heads``."""
        return self.width // self.num_heads


def _dense(cfg: TransformerConfig, features: int, std: float, name: str) -> Dense:
    """A nanoGPT-initialised Dense layer that computes in its inputs'/params' dtype (bias gradient summed in
    float32, FP8 matmul when `cfg.fp8`: `jaxamp.layers.Dense`)."""
    return Dense(
        features,
        use_bias=cfg.use_bias,
        fp8=cfg.fp8,
        fp8_amax_history=cfg.fp8_amax_history,
        kernel_init=nn.initializers.normal(stddev=std),
        bias_init=nn.initializers.zeros,
        name=name,
    )


class LayerNorm(nn.Module):
    """LayerNorm over the last axis whose arithmetic is a float32 island.

    Statistics (two-pass mean and variance), normalisation, scale and bias are
    all computed in float32 whatever the dtypes of the input and parameters;
    the result is cast back to the input's dtype. linen's ``nn.LayerNorm`` is
    not used because (i) it raises under ``jax_numpy_dtype_promotion="strict"``
    when given float16/bfloat16 inputs (it subtracts a float32 mean from the
    half-precision input), and (ii) by default it computes the variance as
    ``E[x^2] - E[x]^2``, which cancels catastrophically for large-mean,
    small-variance rows (e.g. values around 300).

    Attributes:
        use_bias: Whether to learn an additive bias (nanoGPT's ``bias`` flag).
        epsilon: Added to the variance (PyTorch/nanoGPT default 1e-5).
    """

    use_bias: bool = True
    epsilon: float = _LAYER_NORM_EPS

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalises ``x``.

        Args:
            x: ``float[..., features]`` in any floating dtype.

        Returns:
            ``float[..., features]`` in ``x.dtype``.
        """
        features = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (features,), jnp.float32)
        x32 = x.astype(jnp.float32)  # f32[..., features]
        mean = jnp.mean(x32, axis=-1, keepdims=True)  # f32[..., 1]
        centered = x32 - mean  # f32[..., features]
        var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)  # f32[..., 1]
        y = centered * lax.rsqrt(var + self.epsilon) * scale.astype(jnp.float32)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (features,), jnp.float32)
            y = y + bias.astype(jnp.float32)
        return y.astype(x.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (nanoGPT ``CausalSelfAttention``).

    The attention core is ``jax.nn.dot_product_attention`` (float32 logits and
    softmax, finite mask value). nanoGPT additionally applies dropout to the
    attention probabilities; that is not expressible through
    ``jax.nn.dot_product_attention``, so here dropout is applied to the
    attention output projection only (nanoGPT's ``resid_dropout``).

    Attributes:
        config: Model hyper-parameters.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """Attends causally over the sequence.

        Args:
            x: ``float[batch, seq, width]`` in the compute dtype.
            deterministic: Disables dropout when True.

        Returns:
            ``float[batch, seq, width]`` in the compute dtype.
        """
        cfg = self.config
        batch, seq, width = x.shape
        resid_std = _INIT_STD / math.sqrt(2 * cfg.num_layers)
        qkv = _dense(cfg, 3 * width, _INIT_STD, "c_attn")(x)  # [batch, seq, 3*width]
        q, k, v = jnp.split(qkv, 3, axis=-1)  # each [batch, seq, width]
        q = q.reshape(batch, seq, cfg.num_heads, cfg.head_dim)  # [batch, seq, heads, head_dim]
        k = k.reshape(batch, seq, cfg.num_heads, cfg.head_dim)  # [batch, seq, heads, head_dim]
        v = v.reshape(batch, seq, cfg.num_heads, cfg.head_dim)  # [batch, seq, heads, head_dim]
        # Float32 island (b): attention core in float32; output back in q's dtype.
        y = dot_product_attention(q, k, v, is_causal=True)  # [batch, seq, heads, head_dim]
        y = y.reshape(batch, seq, width)  # [batch, seq, width]
        y = _dense(cfg, width, resid_std, "c_proj")(y)  # [batch, seq, width]
        return nn.Dropout(rate=cfg.dropout)(y, deterministic=deterministic)


class MLP(nn.Module):
    """Position-wise MLP: Dense -> exact (erf) GELU -> Dense -> dropout (nanoGPT ``MLP``).

    Attributes:
        config: Model hyper-parameters.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """Applies the MLP.

        Args:
            x: ``float[batch, seq, width]`` in the compute dtype.
            deterministic: Disables dropout when True.

        Returns:
            ``float[batch, seq, width]`` in the compute dtype.
        """
        cfg = self.config
        width = x.shape[-1]
        resid_std = _INIT_STD / math.sqrt(2 * cfg.num_layers)
        h = _dense(cfg, cfg.mlp_ratio * width, _INIT_STD, "c_fc")(x)  # [batch, seq, hidden]
        # PyTorch's nn.GELU() (used by nanoGPT) is the exact erf form.
        h = nn.gelu(h, approximate=False)
        y = _dense(cfg, width, resid_std, "c_proj")(h)  # [batch, seq, width]
        return nn.Dropout(rate=cfg.dropout)(y, deterministic=deterministic)


class Block(nn.Module):
    """Pre-norm Transformer block (nanoGPT ``Block``).

    ``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))``.

    Attributes:
        config: Model hyper-parameters.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        """Applies the block.

        Args:
            x: ``float[batch, seq, width]`` in the compute dtype.
            deterministic: Disables dropout when True (positional too: a static argument of ``nn.remat``).

        Returns:
            ``float[batch, seq, width]`` in the compute dtype.
        """
        cfg = self.config
        x = x + CausalSelfAttention(cfg, name="attn")(
            LayerNorm(use_bias=cfg.use_bias, name="ln_1")(x), deterministic=deterministic
        )
        x = x + MLP(cfg, name="mlp")(
            LayerNorm(use_bias=cfg.use_bias, name="ln_2")(x), deterministic=deterministic
        )
        return x


class _ScanBlock(Block):
    """A :class:`Block` in ``nn.scan``'s form: ``(x, deterministic) -> (x, None)``, the residual stream the carry and
    ``deterministic`` broadcast to every layer. Its parameters are the block's own (``ln_1, attn, ln_2, mlp``)."""

    def __call__(self, x: jax.Array, deterministic: bool = True) -> tuple[jax.Array, None]:
        return super().__call__(x, deterministic), None


def remat_policy(name: str):
    """The ``jax.checkpoint_policies`` entry of a :data:`REMAT_POLICIES` name (None for ``none``).

    Raises:
        ValueError: An unknown name.
    """
    if name not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {name!r}")
    policy = REMAT_POLICIES[name]
    if policy == "recompute_elementwise":
        return recompute_elementwise
    return None if policy is None else getattr(jax.checkpoint_policies, policy)


def _block_class(cfg: TransformerConfig, block: type[Block]) -> type[nn.Module]:
    """``block``, rematerialised by ``cfg.remat``'s policy (``deterministic``, argument 2, static)."""
    if cfg.remat == "none":
        return block
    # Inside nn.scan the loop already keeps XLA from merging the recomputation into the forward pass.
    return nn.remat(block, policy=remat_policy(cfg.remat), prevent_cse=not cfg.scan_layers, static_argnums=(2,))


def _blocks(cfg: TransformerConfig, x: jax.Array, deterministic: bool) -> jax.Array:
    """The ``num_layers`` blocks, unrolled (``h_0 .. h_{L-1}``) or as one ``nn.scan`` (``h``, stacked)."""
    if not cfg.scan_layers:
        block = _block_class(cfg, Block)
        for i in range(cfg.num_layers):
            x = block(cfg, name=f"h_{i}")(x, deterministic)  # [batch, seq, width]
        return x
    stack = nn.scan(
        _block_class(cfg, _ScanBlock),
        # Each layer's slice of the stacked parameters and FP8 state ([num_layers, ...], axis 0).
        variable_axes={"params": 0, FP8_COLLECTION: 0, "intermediates": 0},
        split_rngs={"params": True, "dropout": True},  # each layer its own init and dropout keys
        in_axes=nn.broadcast,  # `deterministic`, the same for every layer
        length=cfg.num_layers,
    )
    x, _ = stack(cfg, name=STACK_NAME)(x, deterministic)  # [batch, seq, width]
    return x


class TransformerLM(nn.Module):
    """GPT-style decoder-only language model (nanoGPT ``GPT``) with a tied output head.

    Parameters are created in float32; callers may cast the whole tree to
    float16/bfloat16 before ``apply`` and the model then computes in that
    dtype (see the module docstring's precision contract). The parameter tree
    is ``{wte, wpe, h_0 .. h_{L-1}, ln_f}`` (with ``config.scan_layers``,
    ``{wte, wpe, h, ln_f}``, ``h``'s leaves stacked ``[num_layers, ...]``);
    the head has no parameters of its own (it reuses ``wte/embedding``).

    Attributes:
        config: Model hyper-parameters.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, targets: jax.Array | None = None, *,
                 deterministic: bool = True) -> jax.Array:
        """Computes next-token logits, or with ``targets`` the mean cross-entropy (as nanoGPT's ``forward``).

        Args:
            tokens: ``i32[batch, seq]`` token ids in ``[0, vocab_size)`` with
                ``seq <= config.seq_len``. (Out-of-range ids cannot be checked
                under ``jit``; their embedding, negative ids' included, is NaN,
                so the logits and loss are NaN rather than silently wrong.)
            targets: Optional ``i32[batch, seq]`` next-token ids. Given, the
                call returns the loss, through the fused head + cross-entropy
                when ``config.loss_chunk > 0``.
            deterministic: When False and ``config.dropout > 0``, applies
                dropout using the ``'dropout'`` rng stream.

        Returns:
            ``f32[batch, seq, vocab_size]`` logits, float32 whatever the
            parameter dtype; with ``targets``, the ``f32[]`` mean
            cross-entropy in nats per token.

        Raises:
            ValueError: If ``tokens`` is not a 2-D integer array or
                ``seq > config.seq_len``.
        """
        cfg = self.config
        if tokens.ndim != 2:
            raise ValueError(
                f"tokens must be a 2-D array i32[batch, seq], got shape {tokens.shape}; "
                f"add a batch axis with tokens[None] for a single sequence"
            )
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must have an integer dtype, got {tokens.dtype}; cast with .astype(jnp.int32)")
        if targets is not None and targets.shape != tokens.shape:
            raise ValueError(f"targets must have the shape of tokens {tokens.shape}, got {targets.shape}")
        _, seq = tokens.shape
        if seq > cfg.seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds config.seq_len={cfg.seq_len}; "
                f"crop the input to the last {cfg.seq_len} tokens or build the model with a larger seq_len"
            )
        embed_init = nn.initializers.normal(stddev=_INIT_STD)
        dtype = self._compute_dtype()
        # Lookups in the tables as they arrive (float32 under LM_KEEP_FLOAT32), rows cast to the compute dtype; the
        # tables' gradients accumulate in float32 (jaxamp.layers.embed_lookup). Out-of-range ids give NaN rows.
        wte = Embed(cfg.vocab_size, cfg.width, dtype=dtype, embedding_init=embed_init, name="wte")
        wpe = Embed(cfg.seq_len, cfg.width, dtype=dtype, embedding_init=embed_init, name="wpe")
        tok_emb = wte(tokens)  # [batch, seq, width]
        pos_emb = wpe(jnp.arange(seq, dtype=jnp.int32))  # [seq, width]
        x = add_bias(tok_emb, pos_emb)  # [batch, seq, width]; pos_emb's gradient summed over the batch in float32
        x = nn.Dropout(rate=cfg.dropout)(x, deterministic=deterministic)
        x = _blocks(cfg, x, deterministic)  # [batch, seq, width]
        x = LayerNorm(use_bias=cfg.use_bias, name="ln_f")(x)  # [batch, seq, width]
        # Float32 island (c): tied head in the compute dtype, accumulated and returned in float32; its backward
        # matmuls run in the compute dtype too (jaxamp.layers.attend).
        if targets is None:
            return wte.attend(x)  # [batch, seq, vocab]
        if cfg.loss_chunk:
            return jnp.mean(wte.cross_entropy(x, targets, cfg.loss_chunk))  # f32[]
        return cross_entropy_loss(wte.attend(x), targets)  # logits f32[batch, seq, vocab]

    def _compute_dtype(self):
        """The dtype the blocks' weights arrive in (`h_0/attn/c_attn/kernel`, scanned `h/...`): the compute dtype.

        float32 while initialising. The embedding tables may arrive in float32 (`LM_KEEP_FLOAT32`) or in the compute
        dtype; the residual stream runs in this one either way.
        """
        params = self.variables.get("params", {})
        try:
            return params[STACK_NAME if self.config.scan_layers else "h_0"]["attn"]["c_attn"]["kernel"].dtype
        except (KeyError, TypeError):
            return jnp.float32


def cross_entropy_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy.

    Args:
        logits: ``float[batch, seq, vocab]`` (any float dtype; cast to float32
            before the log-softmax).
        targets: ``i32[batch, seq]`` target token ids.

    Returns:
        ``f32[]`` mean cross-entropy in nats per token.
    """
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)  # f32[batch, seq]
    return jnp.mean(losses)


def _layer_index(key) -> int | None:
    match = _LAYER_NAME.fullmatch(key) if isinstance(key, str) else None
    return None if match is None else int(match.group(1))


def _rebuild(tree: Mapping, items: list) -> Mapping:
    """`items` as a mapping of `tree`'s kind (a FrozenDict stays one)."""
    return type(tree)(items) if not isinstance(tree, dict) else dict(items)


def stack_params(tree: Any) -> Any:
    """The unrolled model's tree as the scanned model's: ``h_0 .. h_{L-1}`` -> ``h``, each leaf stacked ``[L, ...]``.

    Works on any nesting of mappings: ``variables['params']``, the whole variables dict (the FP8 collection's
    ``h_i`` entries are stacked too), a gradient tree. Mappings without ``h_i`` keys are copied as they are.

    Raises:
        ValueError: The ``h_i`` keys are not exactly ``h_0 .. h_{L-1}``, or their subtrees differ in structure,
            shapes or dtypes.
    """
    if not isinstance(tree, Mapping):
        return tree
    layers = sorted(i for i in map(_layer_index, tree) if i is not None)
    if not layers:
        return _rebuild(tree, [(k, stack_params(v)) for k, v in tree.items()])
    if layers != list(range(len(layers))) or STACK_NAME in tree:
        raise ValueError(f"stack_params needs layers h_0 .. h_{{L-1}} (and no {STACK_NAME!r}), got "
                         f"{sorted(k for k in tree if _layer_index(k) is not None or k == STACK_NAME)}")
    blocks = [tree[f"h_{i}"] for i in layers]
    shapes = [jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), b) for b in blocks]
    if any(s != shapes[0] for s in shapes[1:]):
        bad = next(i for i, s in enumerate(shapes) if s != shapes[0])
        raise ValueError(f"stack_params: h_{bad} differs from h_0 in structure, shapes or dtypes")
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    items, placed = [], False
    for k, v in tree.items():
        if _layer_index(k) is None:
            items.append((k, stack_params(v)))
        elif not placed:  # where h_0 .. h_{L-1} were
            items.append((STACK_NAME, stacked))
            placed = True
    return _rebuild(tree, items)


def unstack_params(tree: Any) -> Any:
    """The scanned model's tree as the unrolled model's: ``h`` (leaves ``[L, ...]``) -> ``h_0 .. h_{L-1}``.

    The inverse of :func:`stack_params`, on any nesting of mappings.

    Raises:
        ValueError: The leaves under ``h`` do not share one leading length, or ``h_i`` keys are there already.
    """
    if not isinstance(tree, Mapping):
        return tree
    if STACK_NAME not in tree or not isinstance(tree[STACK_NAME], Mapping):
        return _rebuild(tree, [(k, unstack_params(v)) for k, v in tree.items()])
    if any(_layer_index(k) is not None for k in tree):
        raise ValueError(f"unstack_params: the tree holds both {STACK_NAME!r} and h_i layers")
    lengths = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in jax.tree.leaves(tree[STACK_NAME])}
    if len(lengths) != 1 or None in lengths:
        raise ValueError(f"unstack_params: the leaves under {STACK_NAME!r} must share one leading (layer) axis, got "
                         f"lengths {sorted(map(str, lengths))}")
    (length,) = lengths
    items = []
    for k, v in tree.items():
        if k == STACK_NAME:
            items.extend((f"h_{i}", jax.tree.map(lambda x, i=i: x[i], v)) for i in range(length))
        else:
            items.append((k, unstack_params(v)))
    return _rebuild(tree, items)


def count_params(params: Any) -> int:
    """Total number of scalar parameters in a pytree (e.g. ``variables`` or ``variables['params']``).

    Leaves may be arrays, `jax.ShapeDtypeStruct`s (from `jax.eval_shape`) or Python scalars (one each).
    """
    return sum(math.prod(jnp.shape(leaf)) for leaf in jax.tree.leaves(params))


@functools.partial(jax.jit, static_argnames=("model", "num_tokens"))
def _generate_jit(
    model: TransformerLM,
    params: Any,
    prompt: jax.Array,
    rng: jax.Array,
    temperature: jax.Array,
    num_tokens: int,
) -> jax.Array:
    """Jitted body of :func:`generate`: a ``fori_loop`` over a fixed-size token buffer."""
    batch, prompt_len = prompt.shape
    total = prompt_len + num_tokens
    window = min(model.config.seq_len, total)  # tokens fed to the model per step
    buf = jnp.zeros((batch, total), jnp.int32)  # i32[batch, total]
    buf = lax.dynamic_update_slice(buf, prompt, (0, 0))

    def body(pos, carry):
        buf, rng = carry
        # Context = the last `window` tokens before `pos` (nanoGPT's crop to block_size).
        # While pos < window the slice starts at 0 and its tail holds not-yet-sampled
        # zeros, which causal attention keeps from influencing position pos - 1.
        start = jnp.clip(pos - window, 0, total - window)
        ctx = lax.dynamic_slice(buf, (0, start), (batch, window))  # i32[batch, window]
        logits = model.apply(params, ctx)  # f32[batch, window, vocab]
        last = lax.dynamic_index_in_dim(logits, pos - 1 - start, axis=1, keepdims=False)  # f32[batch, vocab]
        rng, sub = jax.random.split(rng)
        shifted = last - jnp.max(last, axis=-1, keepdims=True)  # <= 0, the argmax at 0: a tiny temperature -> greedy
        nxt = jax.random.categorical(sub, shifted / temperature, axis=-1).astype(jnp.int32)  # i32[batch]
        buf = lax.dynamic_update_slice(buf, nxt[:, None], (0, pos))
        return buf, rng

    buf, _ = lax.fori_loop(prompt_len, total, body, (buf, rng))
    return buf


def generate(
    model: TransformerLM,
    params: Any,
    prompt_tokens: Any,
    num_tokens: int,
    rng: jax.Array,
    temperature: float = 1.0,
) -> jax.Array:
    """Samples ``num_tokens`` tokens autoregressively after a prompt (nanoGPT ``GPT.generate``).

    Each step feeds the last ``min(config.seq_len, prompt_len + num_tokens)``
    tokens of a fixed-size buffer to the model and samples the next token from
    ``softmax(logits / temperature)``. Compiled once per (model, shapes).

    Args:
        model: The language model.
        params: Its variables as passed to ``model.apply`` (e.g. ``{'params': ...}``),
            in any float dtype.
        prompt_tokens: ``int[prompt_len]`` or ``int[batch, prompt_len]`` token ids,
            ``prompt_len >= 1``; may be longer than ``seq_len`` (it is cropped).
        num_tokens: Number of new tokens to sample (>= 0).
        rng: A ``jax.random`` key.
        temperature: Softmax temperature, a normal float32 (>= ~1.2e-38); near 0 it samples the argmax.

    Returns:
        ``i32[prompt_len + num_tokens]`` or ``i32[batch, prompt_len + num_tokens]``
        (matching the prompt's rank): the prompt followed by the sampled tokens.

    Raises:
        ValueError: On an empty or non-integer prompt, a prompt of rank other
            than 1 or 2, ``num_tokens < 0`` or ``temperature`` below float32's smallest normal number.
    """
    prompt = jnp.asarray(prompt_tokens)
    if not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"prompt_tokens must be integer token ids, got dtype {prompt.dtype}")
    if prompt.ndim not in (1, 2):
        raise ValueError(f"prompt_tokens must be int[prompt_len] or int[batch, prompt_len], got shape {prompt.shape}")
    squeeze = prompt.ndim == 1
    if squeeze:
        prompt = prompt[None, :]  # [1, prompt_len]
    if prompt.shape[1] < 1:
        raise ValueError("prompt_tokens is empty; pass at least one token (e.g. the id of '\\n')")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if not (math.isfinite(temperature) and temperature >= _F32_TINY):
        raise ValueError(f"temperature must be a finite float32 >= {_F32_TINY:.3g} (a normal number), got "
                         f"{temperature}")
    prompt = prompt.astype(jnp.int32)
    if num_tokens == 0:
        out = prompt
    else:
        out = _generate_jit(model, params, prompt, rng, jnp.asarray(temperature, jnp.float32), int(num_tokens))
    return out[0] if squeeze else out
