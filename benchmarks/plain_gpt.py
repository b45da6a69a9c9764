"""nanoGPT in plain Flax: the same computation as `jaxamp.lm.model.TransformerLM` in fp32, from stock linen modules,
for `benchmarks/cpu_step.py`. Module names follow TransformerLM's, so the parameter trees are identical and both
models run on the same weights.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxamp.lm.model import TransformerConfig

# jax.nn.dot_product_attention's mask value (XLA path): finite, so a fully masked row stays finite.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


class PlainAttention(nn.Module):
    """Causal self-attention: `nn.Dense` projections, einsum logits scaled by 1/sqrt(head_dim), finite mask."""

    cfg: TransformerConfig

    @nn.compact
    def __call__(self, x):
        """`f32[batch, seq, width]` -> same."""
        cfg, (b, t, c) = self.cfg, x.shape
        qkv = nn.Dense(3 * c, use_bias=cfg.use_bias, name="c_attn")(x)
        q, k, v = (a.reshape(b, t, cfg.num_heads, cfg.head_dim) for a in jnp.split(qkv, 3, axis=-1))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.float32(1.0 / math.sqrt(cfg.head_dim))
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, jnp.float32(MASK_VALUE))
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v).reshape(b, t, c)
        return nn.Dense(c, use_bias=cfg.use_bias, name="c_proj")(y)


class PlainMLP(nn.Module):
    """`nn.Dense` -> GELU (exact erf, or tanh) -> `nn.Dense`."""

    cfg: TransformerConfig
    tanh_gelu: bool = False

    @nn.compact
    def __call__(self, x):
        """`f32[batch, seq, width]` -> same."""
        cfg, width = self.cfg, x.shape[-1]
        h = nn.gelu(nn.Dense(cfg.mlp_ratio * width, use_bias=cfg.use_bias, name="c_fc")(x), approximate=self.tanh_gelu)
        return nn.Dense(width, use_bias=cfg.use_bias, name="c_proj")(h)


class PlainBlock(nn.Module):
    """Pre-norm block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`, with `nn.LayerNorm`."""

    cfg: TransformerConfig
    fast_variance: bool = False
    tanh_gelu: bool = False

    @nn.compact
    def __call__(self, x):
        """`f32[batch, seq, width]` -> same."""
        cfg = self.cfg

        def norm(name):
            return nn.LayerNorm(epsilon=1e-5, use_bias=cfg.use_bias, use_fast_variance=self.fast_variance, name=name)

        x = x + PlainAttention(cfg, name="attn")(norm("ln_1")(x))
        return x + PlainMLP(cfg, self.tanh_gelu, name="mlp")(norm("ln_2")(x))


class PlainGPT(nn.Module):
    """nanoGPT in plain Flax: `nn.Embed` tokens + positions, blocks, final `nn.LayerNorm`, head tied via `attend`.

    Attributes:
      cfg: sizes (dropout is not applied).
      fast_variance: `nn.LayerNorm`'s default one-pass variance instead of the two-pass one jaxamp computes.
      tanh_gelu: the tanh approximation instead of the exact (erf) GELU.
    """

    cfg: TransformerConfig
    fast_variance: bool = False
    tanh_gelu: bool = False

    @nn.compact
    def __call__(self, tokens):
        """`i32[batch, seq]` -> `f32[batch, seq, vocab]` logits."""
        cfg = self.cfg
        wte = nn.Embed(cfg.vocab_size, cfg.width, name="wte")
        x = wte(tokens) + nn.Embed(cfg.seq_len, cfg.width, name="wpe")(jnp.arange(tokens.shape[1]))
        for i in range(cfg.num_layers):
            x = PlainBlock(cfg, self.fast_variance, self.tanh_gelu, name=f"h_{i}")(x)
        x = nn.LayerNorm(epsilon=1e-5, use_bias=cfg.use_bias, use_fast_variance=self.fast_variance, name="ln_f")(x)
        return wte.attend(x)

