"""Flax linen lm1b decoder-only Transformer (`examples/lm1b/models.py`, `TransformerLM` + `TransformerConfig`).

Source: Flax's PyPI sdist of the installed version (0.12.8 here), `examples/lm1b/models.py`, imported unchanged;
the loss is `compute_weighted_cross_entropy` of `examples/lm1b/train.py`, run as published (see `sources.py`).
Licence: Apache-2.0, (c) The Flax Authors.

Where its precision lives, as shipped:
- `TransformerConfig.dtype` (default float32) is the one knob: every `nn.Dense`, `nn.DenseGeneral`,
  `nn.MultiHeadDotProductAttention` and `nn.LayerNorm` gets `dtype=config.dtype`, the attention masks are made in
  it, the embeddings' output is cast with `y.astype(config.dtype)` and so are the logits (`logits.astype(dtype)`).
  lm1b's train.py sets it to bfloat16 when `config.use_bfloat16` (its default config: True), float32 otherwise.
- No `param_dtype` is passed anywhere: params are float32 (Flax's default).
- `nn.Embed` gets no dtype: under a float32 config it returns its table's dtype.
- Flax's layers `promote_dtype(inputs, kernel, dtype=config.dtype)`: with dtype=float32 a bf16 kernel (jaxamp's cast
  policy) is cast back up to float32 before the matmul, so the cast policy alone computes every Dense in float32.
- LayerNorm computes its statistics in float32 (`promote_types(dtype, float32)`) whatever `dtype` says.

Trial: dtype=float32 (the float32 model a user brings), 2 layers, width 32, 2 heads, mlp 64, vocab 256, batch 4 x
16 tokens, 0 is padding (lm1b's `weights = jnp.where(inputs > 0, 1, 0)`). Dropout 0.1 as in train.py
(`deterministic=False`), its rng is jaxamp's per-step `rng`. Params are unboxed from `nn.LogicallyPartitioned` as
lm1b's `utils.setup_initial_state` does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.training import common_utils

from . import sources
from .trial import Trial

VOCAB, LENGTH, BATCH = 256, 16, 4


def _modules():
    root = sources.flax_source() / "examples" / "lm1b"
    models = sources.load_module(root / "models.py", "outside_lm1b_models")
    train = sources.load_functions(root / "train.py", ("compute_weighted_cross_entropy",),
                                   {"jax": jax, "jnp": jnp, "np": np, "nn": nn, "common_utils": common_utils})
    return models, train["compute_weighted_cross_entropy"]


def make_batch(key, batch: int = BATCH):
    """lm1b's train batch: {"inputs": int32[batch, length]}, ids >= 1, zero padding at the end of each row."""
    k_ids, k_len = jax.random.split(key)
    ids = jax.random.randint(k_ids, (batch, LENGTH), 1, VOCAB, dtype=jnp.int32)
    lengths = jax.random.randint(k_len, (batch, 1), LENGTH // 2, LENGTH + 1)
    return {"inputs": jnp.where(jnp.arange(LENGTH)[None, :] < lengths, ids, 0)}


def trial(batch: int = BATCH) -> Trial:
    models, compute_weighted_cross_entropy = _modules()
    config = models.TransformerConfig(
        vocab_size=VOCAB, output_vocab_size=VOCAB, logits_via_embedding=False, dtype=jnp.float32,
        emb_dim=32, num_heads=2, num_layers=2, qkv_dim=32, mlp_dim=64, max_len=LENGTH,
        dropout_rate=0.1, attention_dropout_rate=0.1, deterministic=False, decode=False,
        kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers.normal(stddev=1e-6))
    eval_config = config.replace(deterministic=True)
    # train.py: `jax.jit(m.init)(init_rng, jnp.ones(input_shape, jnp.float32))` with the eval config
    variables = jax.jit(models.TransformerLM(eval_config).init)(jax.random.key(0),
                                                                jnp.ones((BATCH, LENGTH), jnp.float32))
    params = nn.meta.unbox(variables["params"])
    model = models.TransformerLM(config)

    def loss_fn(params, batch, rng):
        """lm1b's train_step loss: weighted cross-entropy over the non-padding tokens."""
        inputs = batch["inputs"]
        weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
        logits = model.apply({"params": params}, inputs, inputs_positions=None, inputs_segmentation=None,
                             rngs={"dropout": rng})
        loss, weight_sum = compute_weighted_cross_entropy(logits, inputs, weights, 0.0)
        mean_loss = loss / weight_sum
        return mean_loss, logits

    return Trial(
        name="lm1b", kind="linen", model=model, params=params,
        make_batch=functools.partial(make_batch, batch=batch), loss_fn=loss_fn,
        source=f"flax {sources.flax_version()} sdist: examples/lm1b/models.py (+ train.py's loss); Apache-2.0",
        precision="TransformerConfig.dtype (float32 here; train.py: bfloat16 if use_bfloat16) on every layer; "
                  "params float32; nn.Embed without dtype; LayerNorm statistics float32",
        notes="params unboxed (nn.meta.unbox) as lm1b's utils does; dropout rng = jaxamp's per-step rng")
