"""Flax NNX Gemma (`examples/gemma/`: transformer.py, transformer_cfg.py, modules.py, layers.py, ...), tiny config.

Source: Flax's PyPI sdist of the installed version (0.12.8 here), `examples/gemma/{transformer, transformer_cfg,
modules, layers, positional_embeddings, sow_lib, helpers, params}.py`, imported unchanged (they import each other
by top-level name: `import layers`, ...; `sources.load_module` lets them, and then takes those generic names out of
`sys.modules` again). The loss is `compute_weighted_cross_entropy` of `examples/gemma/train.py`, run as published,
inside the body of train.py's `nnx_train_step` loss (`weights = (inputs > pad_id)`, `make_causal_attn_mask`).
Licence: Apache-2.0, (c) The Flax Authors. Needs `jaxtyping` (installed with equinox) and `orbax-checkpoint`.

Where its precision lives, as shipped:
- `TransformerConfig.dtype` (activations, default float32) and `TransformerConfig.weight_dtype` (params, default
  float32) go to every `nnx.Einsum` (`dtype=`, `param_dtype=`), the embedder (`ScaledEmbed(dtype=...,
  param_dtype=...)`) and `layers.RMSNorm(dtype=..., weight_dtype=...)`. train.py: "Activations dtype for mixed
  precision, weights dtype is float32": `dtype = bfloat16 if config.use_bfloat16` (its configs: True).
- `layers.RMSNorm` computes in float32 (`jnp.asarray(x, jnp.float32)`), then casts to `dtype`, and casts its scale
  to `dtype`.
- The attention logits einsums (`jnp.einsum('BTNH,BSNH->BTNS', ...)`) run in whatever dtype q/k arrive in; the
  softmax's probs are cast to `key_proj.dtype`.
- `nnx.Einsum(dtype=float32)` promotes a bf16 kernel (jaxamp's cast policy) back to float32.

Trial: `TransformerConfig.from_dict(...)` as train.py builds it from `transformer_params` (configs/tiny.py's
Gemma-1 shape, shrunk): 2 layers, embed 32, hidden 64, 2 heads of 16, 1 kv head, global attention, vocab 256,
dtype = weight_dtype = float32, no sharding (train.py uses `fsdp_tp_sharding` under a mesh), dropout 0 (the
default). Batch: 4 x 16 tokens padded with 0, targets = inputs shifted left (the input pipeline's `shift`),
positions from `build_positions_from_mask` (train.py gets them from packing).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import sources
from .trial import Trial

VOCAB, LENGTH, BATCH, PAD_ID = 256, 16, 4, 0
_SIBLINGS = ("helpers", "layers", "modules", "params", "positional_embeddings", "sow_lib", "transformer_cfg")


def _modules():
    root = sources.flax_source() / "examples" / "gemma"
    transformer = sources.load_module(root / "transformer.py", "outside_gemma_transformer", search_path=root,
                                      siblings=_SIBLINGS)
    train = sources.load_functions(root / "train.py", ("compute_weighted_cross_entropy",),
                                   {"jax": jax, "jnp": jnp, "np": np, "nnx": nnx})
    return transformer, train["compute_weighted_cross_entropy"]


def make_batch(key, batch: int = BATCH):
    """{"inputs", "targets"}: int32[B, 16], 0-padded at the end; targets are inputs shifted left by one."""
    k_ids, k_len = jax.random.split(key)
    ids = jax.random.randint(k_ids, (batch, LENGTH), 1, VOCAB, dtype=jnp.int32)
    lengths = jax.random.randint(k_len, (batch, 1), LENGTH // 2, LENGTH + 1)
    inputs = jnp.where(jnp.arange(LENGTH)[None, :] < lengths, ids, PAD_ID)
    targets = jnp.pad(inputs[:, 1:], [(0, 0), (0, 1)], constant_values=PAD_ID)
    return {"inputs": inputs, "targets": targets}


def trial(batch: int = BATCH) -> Trial:
    transformer_lib, compute_weighted_cross_entropy = _modules()
    attention_type = transformer_lib.modules.AttentionType.GLOBAL
    config = transformer_lib.TransformerConfig.from_dict(
        num_layers=2, embed_dim=32, hidden_dim=64, num_heads=2, head_dim=16, num_kv_heads=1,
        use_post_attn_norm=False, use_post_ffw_norm=False, attention_types=(attention_type,) * 2,
        final_logit_softcap=None, num_embed=VOCAB, dtype=jnp.float32)
    model = transformer_lib.Transformer(config, rngs=nnx.Rngs(params=0))

    def loss_fn(model, batch):
        """train.py's nnx_train_step loss (label_smoothing 0, pad_id 0, no packing).

        Under "standard" promotion: the example is not strict-clean (`build_positions_from_mask` computes
        `positions - (positions >= 1)`, int32 - bool; `positional_embeddings.apply_rope` multiplies int32 positions
        by float32 timescales).
        """
        with jax.numpy_dtype_promotion("standard"):
            inputs, targets = batch["inputs"], batch["targets"]
            input_mask = inputs > PAD_ID
            weights = input_mask.astype(jnp.float32)
            attention_mask = transformer_lib.make_causal_attn_mask(input_mask)  # (B, L, L)
            inputs_positions = transformer_lib.build_positions_from_mask(input_mask)
            logits, _ = model(inputs, positions=inputs_positions, attention_mask=attention_mask, cache=None,
                              rngs=None)
            loss_per_sample = compute_weighted_cross_entropy(logits, targets, weights, 0.0)
            mean_loss = loss_per_sample.mean()
            return mean_loss, (loss_per_sample, logits)

    return Trial(
        name="gemma_nnx", kind="nnx", model=model,
        make_batch=functools.partial(make_batch, batch=batch), loss_fn=loss_fn,
        source=f"flax {sources.flax_version()} sdist: examples/gemma/*.py (+ train.py's loss); Apache-2.0",
        precision="TransformerConfig.dtype (activations) and .weight_dtype (params), both float32 here "
                  "(train.py: dtype bfloat16 if use_bfloat16); RMSNorm in float32; softmax probs cast to k's dtype",
        notes="no sharding config (train.py: fsdp_tp_sharding on a mesh); positions from build_positions_from_mask "
              "instead of packing; dropout_rate 0 so rngs=None; loss under standard promotion (not strict-clean)")
