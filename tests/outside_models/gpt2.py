"""Hugging Face Flax GPT-2 (`transformers.FlaxGPT2LMHeadModel`) with a tiny `GPT2Config`, random init.

Source: the PyPI package `transformers==4.57.6` (the last line with Flax models; 5.x has none),
`transformers/models/gpt2/modeling_flax_gpt2.py`, imported unchanged. Licence: Apache-2.0, (c) The Google Flax Team
Authors and The HuggingFace Inc. team. transformers 4.57 pins `tokenizers<=0.23.0` and `huggingface-hub<1.0` (it
checks them at import), so installing it brings tokenizers 0.22.2 and huggingface-hub 0.36.2 into the venv.

Where its precision lives, as shipped:
- The model's `dtype` constructor argument (`FlaxGPT2LMHeadModel(config, dtype=jnp.float32)`) is the computation
  dtype: every `FlaxConv1D` casts its inputs, kernel and bias to it (`jnp.asarray(kernel.transpose(), self.dtype)`),
  and it goes to `nn.Embed` (wte, wpe), every `nn.LayerNorm`, the attention's softmax
  (`dot_product_attention_weights(dtype=self.dtype)`), its mask bias (`finfo(self.dtype).min`) and the tied lm_head
  `nn.Dense`. Its docstring: "this only specifies the dtype of the computation and does not influence the dtype of
  model parameters"; `model.to_bf16(params)` / `to_fp16` cast params.
- Params are float32 at init. Under jaxamp's cast policy with dtype=float32 the explicit `jnp.asarray(..., dtype)`
  casts put every matmul back in float32.
- The lm_head is tied: `wte.embedding.T` is applied through the Dense.

Trial: built with `_do_init=False` and `jax.jit(model.init_weights)` (the default constructor inits op by op, 4 s
more here); vocab 256, 16 positions, width 32, 2 layers, 2 heads, dropout 0.1 (GPT2Config's default resid/embd/attn
pdrop) with `train=True` and jaxamp's per-step rng as `dropout_rng`. Batch: 4 x 16 ids, `attention_mask` all ones,
`labels = input_ids` (run_clm_flax's `group_texts` packs, no padding). Loss: run_clm_flax.py's `loss_fn` (shifted
logits/labels, `optax.softmax_cross_entropy` with `onehot`, mean) over `model(**batch, params=params,
dropout_rng=rng, train=True)[0]`; the labels are read from the batch, not popped.
"""

from __future__ import annotations

import functools
import importlib.metadata

import jax
import jax.numpy as jnp
import optax
from flax.training.common_utils import onehot

from .trial import Trial

VOCAB, LENGTH, BATCH = 256, 16, 4


def make_batch(key, batch: int = BATCH):
    """{"input_ids": i32[B, 16], "attention_mask": i32[B, 16] (ones), "labels": i32[B, 16] (= input_ids)}."""
    ids = jax.random.randint(key, (batch, LENGTH), 0, VOCAB, dtype=jnp.int32)
    return {"input_ids": ids, "attention_mask": jnp.ones_like(ids), "labels": ids}


def trial(batch: int = BATCH, dropout: float | None = None) -> Trial:
    """The trial at `batch` sequences; `dropout`: GPT2Config's resid/embd/attn pdrop (None: its default, 0.1)."""
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    rates = {} if dropout is None else {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, n_inner=None, **rates)
    # Transformers' documented path for initialising params yourself: `_do_init=False`, then `init_weights` (here
    # under jax.jit: one compile instead of op-by-op init; the same random init as the default constructor's).
    with jax.numpy_dtype_promotion("standard"):  # init traces the forward pass (see loss_fn on strict promotion)
        model = FlaxGPT2LMHeadModel(config, input_shape=(BATCH, LENGTH), seed=0, dtype=jnp.float32, _do_init=False)
        params = jax.jit(model.init_weights, static_argnums=1)(jax.random.key(0), (BATCH, LENGTH))

    def loss_fn(params, batch, rng):
        """run_clm_flax.py's compute_loss: next-token cross-entropy over all positions (no padding).

        Under "standard" promotion: the model is not strict-clean (its attention combines the int32
        `attention_mask` with a bool causal mask in `flax.linen.combine_masks`, `jnp.logical_and` of int32 and bool).
        """
        with jax.numpy_dtype_promotion("standard"):
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            logits = model(**inputs, params=params, dropout_rng=rng, train=True)[0]
            shift_logits = logits[..., :-1, :]
            shift_labels = batch["labels"][..., 1:]
            loss = optax.softmax_cross_entropy(shift_logits, onehot(shift_labels, shift_logits.shape[-1]))
            return loss.mean()

    return Trial(
        name="gpt2_hf", kind="hf", model=model, params=params,
        make_batch=functools.partial(make_batch, batch=batch), loss_fn=loss_fn,
        source=f"transformers {importlib.metadata.version('transformers')} (PyPI): FlaxGPT2LMHeadModel; Apache-2.0",
        precision="model dtype= argument (float32 here) casts inputs, kernels, biases in every FlaxConv1D, Embed, "
                  "LayerNorm, attention softmax; params float32 (to_bf16/to_fp16 to cast them)",
        notes="loss as run_clm_flax.py's loss_fn / compute_loss (labels read, not popped); dropout_rng = jaxamp's "
              "per-step rng; no pmap; loss under standard promotion (not strict-clean)")
