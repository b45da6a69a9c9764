"""ESM2 in Equinox (`esm2quinox.ESM2`): a BERT-style masked-language-model encoder, by Equinox's author.

Stands in for Equinox's BERT example (`docs/examples/bert.ipynb`), which is in no package: Equinox's wheel and
sdist ship no docs. esm2quinox is Patrick Kidger's Equinox implementation of Meta's ESM2 protein language model: a
pre-LayerNorm Transformer encoder (`eqx.nn.MultiheadAttention` with rotary embeddings, `eqx.nn.Linear`,
`eqx.nn.LayerNorm`, GELU, tied embedding / logit head, a padding mask), the same building blocks as the BERT
example. Source: the PyPI package `esm2quinox==0.2.0`, imported unchanged. Licence: Apache-2.0.

Where its precision lives, as shipped:
- No dtype option on `ESM2`: its `eqx.nn.Linear`/`LayerNorm` params are created in Equinox's default float dtype
  (float32 unless jax_enable_x64).
- `eqx.nn.LayerNorm` computes in `result_type(x, float32)` and returns the input's dtype.
- `eqx.nn.MultiheadAttention`'s softmax runs in float32 (`dot_product_attention_weights` upcasts the logits) and
  returns the logits' dtype.
- `eqx.nn.RotaryPositionalEmbedding(dtype=float32)`: its cos/sin tables are static float32 (not params, so a cast
  policy leaves them float32); bf16 queries/keys meet them (strict promotion: an error; standard: float32, then
  cast back to the input dtype).
- `eqx.nn.Linear` computes `weight @ x` in the promotion of the two: a bf16 weight (jaxamp's cast) and a float32
  embedding output stay float32 under standard promotion.
- The embedding is `logit_head.linear2.weight` (tied): the cast policy casts the lookup table too.

Trial: `ESM2(num_layers=2, embed_size=32, num_heads=2, token_dropout=True, ...)` (ESM2's published models use
token dropout); the model works on one sequence, the batch is `jax.vmap`ped as its README shows. Batch: 4 random
proteins of 6-14 residues tokenised by `esm2quinox.tokenise` to length 16 (BOS/EOS, `.` padding), 15% of the
residues replaced by the mask token `#` (at least one per row). Loss: masked-LM cross-entropy over the masked
positions (ESM2's pretraining objective; esm2quinox ships no training script). Params: `eqx.partition(model,
eqx.is_inexact_array)`; the loss `eqx.combine`s them with the static half.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .trial import Trial

LENGTH, BATCH = 16, 4
_RESIDUES = "LAGVSERTIDPKQNFYMHWC"


def make_batch(key, batch: int = BATCH):
    """{"tokens": i32[B, 16] with masks, "labels": i32[B, 16] the unmasked tokens, "weights": f32[B, 16]}."""
    import esm2quinox

    alphabet = esm2quinox._esm2._alphabet  # pylint: disable=protected-access
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
    proteins = ["".join(rng.choice(list(_RESIDUES), size=int(rng.integers(6, LENGTH - 1))))
                for _ in range(batch)]
    labels = np.asarray(esm2quinox.tokenise(proteins, length=LENGTH), np.int32)
    residue = labels >= alphabet["L"]  # not BOS/EOS/pad/unknown
    masked = residue & (rng.random(labels.shape) < 0.15)
    for row in range(batch):  # at least one masked residue per sequence
        if not masked[row].any():
            masked[row, rng.choice(np.flatnonzero(residue[row]))] = True
    tokens = np.where(masked, alphabet["#"], labels).astype(np.int32)
    return {"tokens": jnp.asarray(tokens), "labels": jnp.asarray(labels),
            "weights": jnp.asarray(masked, jnp.float32)}


def trial(batch: int = BATCH) -> Trial:
    import esm2quinox

    model = esm2quinox.ESM2(num_layers=2, embed_size=32, num_heads=2, token_dropout=True, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_fn(params, batch, rng):
        """Masked-LM cross-entropy: the mean over the masked positions."""
        del rng  # ESM2 has no dropout
        model = eqx.combine(params, static)
        logits = jax.vmap(model)(batch["tokens"]).logits
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        return jnp.sum(loss * batch["weights"]) / jnp.sum(batch["weights"])

    return Trial(
        name="esm2_equinox", kind="equinox", model=model, params=params, static=static,
        make_batch=functools.partial(make_batch, batch=batch),
        loss_fn=loss_fn,
        source=f"esm2quinox {_version('esm2quinox')} (PyPI), equinox {_version('equinox')}; Apache-2.0",
        precision="no dtype option: params in Equinox's default float dtype (float32); LayerNorm and attention "
                  "softmax upcast to float32; RoPE tables static float32; Linear computes in promote(weight, x)",
        notes="stands in for Equinox's BERT example (docs only, in no package); loss written by us: masked-LM "
              "cross-entropy (esm2quinox ships no training loop)")


def _version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)
