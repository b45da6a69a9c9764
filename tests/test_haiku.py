"""Haiku's VQ-VAE quantizer (`hk.nets.VectorQuantizer`, dm-haiku, used as published) under jaxamp's audit and
autocast: its codebook search, `argmax(-distances)` over a matmul with the codebook, is named, and the policy the
audit gives keeps the codes float32 picks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp
from jaxamp import NoOpLossScale, TrainState, precision_audit

hk = pytest.importorskip("haiku", reason="dm-haiku is a test extra (pip install -e '.[test]')")


def forward(x):  # f32[8, 16, 16, 3] -> (f32[], i32[8, 8, 8])
    """A small VQ-VAE after Haiku's VQ-VAE example: conv encoder, Haiku's quantizer, transposed-conv decoder."""
    z = hk.Conv2D(16, (1, 1), name="to_vq")(jax.nn.relu(hk.Conv2D(32, (4, 4), stride=2, name="enc")(x)))
    vq = hk.nets.VectorQuantizer(embedding_dim=16, num_embeddings=64, commitment_cost=0.25)(z, is_training=True)
    recon = hk.Conv2DTranspose(3, (4, 4), stride=2, name="dec")(vq["quantize"])  # f32[8, 16, 16, 3]
    return jnp.mean((recon - x) ** 2) + vq["loss"], vq["encoding_indices"]


MODEL = hk.without_apply_rng(hk.transform(forward))
SEARCH = "vector_quantizer.embeddings"


def setup():
    """Params whose codebook holds 64 of the encoder's outputs (a data-dependent init, as VQ-VAE codebooks are
    often started: Haiku's own init leaves one code in use), and a batch."""
    x = jax.random.uniform(jax.random.key(0), (8, 16, 16, 3), minval=-0.5, maxval=0.5)
    params = MODEL.init(jax.random.key(1), x)
    z = hk.without_apply_rng(hk.transform(lambda x: hk.Conv2D(16, (1, 1), name="to_vq")(
        jax.nn.relu(hk.Conv2D(32, (4, 4), stride=2, name="enc")(x))))).apply(params, x)  # f32[8, 8, 8, 16]
    codes = z.reshape(-1, 16)[jax.random.choice(jax.random.key(2), 512, (64,), replace=False)]  # f32[64, 16]
    params = {**params, "vector_quantizer": {"embeddings": codes.T}}  # f32[16, 64]
    return params, x


def audit(policy: str):
    params, x = setup()
    state = TrainState.create(params=params, tx=optax.adam(1e-3), policy=policy, loss_scale=NoOpLossScale(),
                              rng=jax.random.key(3))
    return precision_audit(state, x, lambda p, b, rng: MODEL.apply(p, b)[0])


def test_the_codebook_search_is_named_with_haikus_layer_and_the_policy_that_keeps_it_out_of_fp8():
    """Under `fp8-current` the search is the model's only FP8 matmul (its other matmuls are convolutions): the audit
    named nothing, and its `library` column read Haiku's module wrapper (`wrap_method.<locals>.wrapped`)."""
    report = audit("fp8-current")
    [search] = [r for r in report.half_logits if r["weight"] == SEARCH]
    assert search["into"] == "argmax" and search["lhs"] == "float8_e4m3fn", search
    assert search["library"] == "haiku/_src/nets/vqvae.py:VectorQuantizer.__call__", search["library"]
    policy = (r"fp8-current;fp8_exclude+=^vector_quantizer\.embeddings$;"
              r"float32_results+=^vector_quantizer\.embeddings$")
    assert f"policy '{policy}' keeps it out" in report.summary(), report.summary()
    kept = audit(policy)
    assert [(r["lhs"], r["out"]) for r in kept.rows if r["weight"] == SEARCH and r["pass"] == "forward"] == [
        ("bfloat16", "float32")]
    assert not [r for r in kept.half_logits if r["weight"] == SEARCH], kept.half_logits


def test_the_policy_the_audit_gives_keeps_the_codes_float32_picks():
    """The share of the 512 codes picked otherwise than in float32 (the whole forward under autocast): under
    `fp8-current` 7.4% (e4m3 distances), under the audit's policy (bf16 operands, float32 result) 0.2%."""
    params, x = setup()
    exact = MODEL.apply(params, x)[1]
    kept = {"fp8_exclude": [rf"^{SEARCH}$"], "float32_results": [rf"^{SEARCH}$"]}
    with jax.numpy_dtype_promotion("standard"):
        flipped = {name: float(jnp.mean(jaxamp.autocast(MODEL.apply, "bf16", **kw)(params, x)[1] != exact))
                   for name, kw in [("fp8", {"fp8": "current"}), ("kept", {"fp8": "current", **kept})]}
    assert flipped["fp8"] > 0.03 and flipped["kept"] < 0.01, flipped
