"""The fused, chunked head + cross-entropy (`jaxamp.layers.attend_cross_entropy`, `TransformerConfig.loss_chunk`):
the same loss and gradients as the whole-logits path to float32 rounding, matmuls in the compute dtype, and no
`f32[tokens, vocab]` logits in the compiled step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from asserts import leaf_pairs

from jaxamp import get_policy
from jaxamp.layers import attend, attend_cross_entropy
from jaxamp.lm.config import ConfigError, TrainConfig
from jaxamp.lm.model import LM_KEEP_FLOAT32, TransformerConfig, TransformerLM
from jaxamp.lm.setup import build, train_batch

B, T, D, V = 3, 7, 16, 50  # batch, seq, features, vocab: 21 tokens, a prime number of them


def _inputs(dtype):
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (B, T, D)).astype(dtype)  # [batch, seq, features]
    table = jax.random.normal(k[1], (V, D)) * 0.3  # f32[vocab, features]
    targets = jax.random.randint(k[2], (B, T), 0, V)  # i32[batch, seq]
    return x, table, targets


def _reference(x, table, targets):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(attend(x, table), targets))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("chunk", [1, 4, 21, 100])  # one token, padded blocks, one block, chunk > tokens
def test_loss_and_gradients_equal_the_whole_logits_path(dtype, chunk):
    x, table, targets = _inputs(dtype)
    ref, (rx, rt) = jax.value_and_grad(_reference, argnums=(0, 1))(x, table, targets)
    fused_fn = lambda x, table: jnp.mean(attend_cross_entropy(x, table, targets, chunk))  # noqa: E731
    loss, (gx, gt) = jax.value_and_grad(fused_fn, argnums=(0, 1))(x, table)
    assert loss.dtype == jnp.float32 and gx.dtype == dtype and gt.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-6)
    # x's gradient: the same rounded logit gradient times the same table, row by row.
    np.testing.assert_allclose(np.asarray(gx, np.float32), np.asarray(rx, np.float32), rtol=0, atol=1e-7)
    # The table's gradient sums blocks in float32 instead of one long dot: float32 rounding of the largest entry.
    np.testing.assert_allclose(np.asarray(gt), np.asarray(rt), rtol=0, atol=2e-6 * float(jnp.max(jnp.abs(rt))))


def test_per_token_losses_keep_the_leading_shape_and_flag_bad_ids():
    x, table, targets = _inputs(jnp.float32)
    bad = targets.at[1, 2].set(V)  # out of range: a NaN loss, not a silently clamped one
    losses = attend_cross_entropy(x, table, bad, 4)
    ref = optax.softmax_cross_entropy_with_integer_labels(attend(x, table), targets)
    assert losses.shape == (B, T) and bool(jnp.isnan(losses[1, 2]))
    mask = np.ones((B, T), bool)
    mask[1, 2] = False
    np.testing.assert_allclose(np.asarray(losses)[mask], np.asarray(ref)[mask], rtol=1e-6)


def test_bad_arguments_name_the_problem():
    x, table, targets = _inputs(jnp.float32)
    with pytest.raises(ValueError, match="shapes do not fit"):
        attend_cross_entropy(x, table, targets[:, :3], 4)
    with pytest.raises(ValueError, match="integer"):
        attend_cross_entropy(x, table, targets.astype(jnp.float32), 4)
    with pytest.raises(ValueError, match="positive"):
        attend_cross_entropy(x, table, targets, 0)
    with pytest.raises(ValueError, match="loss_chunk"):
        TransformerConfig(vocab_size=V, seq_len=T, loss_chunk=-1)
    with pytest.raises(ConfigError, match="--loss-chunk"):
        build(TrainConfig(loss_chunk=-2))


def _dots(jaxpr) -> list:
    found = []
    for eqn in jaxpr.eqns:
        found += [eqn] if eqn.primitive.name == "dot_general" else []
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                found += _dots(inner) if hasattr(inner, "eqns") else []
    return found


def test_head_matmuls_take_compute_dtype_operands():
    """Forward, recomputed and both backward matmuls of the head: bfloat16 operands, float32 accumulation."""
    x, table, targets = _inputs(jnp.bfloat16)
    fn = jax.grad(lambda x, table: jnp.mean(attend_cross_entropy(x, table, targets, 8)), argnums=(0, 1))
    dots = _dots(jax.make_jaxpr(fn)(x, table).jaxpr)
    assert len(dots) == 4, len(dots)
    assert all(v.aval.dtype == jnp.bfloat16 for eqn in dots for v in eqn.invars)
    assert all(eqn.params["preferred_element_type"] == jnp.float32 for eqn in dots)


def _lm(loss_chunk, tokens=256, vocab=2048):
    cfg = TransformerConfig(vocab_size=vocab, seq_len=64, num_layers=1, num_heads=2, width=32, loss_chunk=loss_chunk)
    model = TransformerLM(cfg)
    ids = jax.random.randint(jax.random.key(3), (tokens // 64, 64), 0, vocab)  # i32[batch, seq]
    params = model.init(jax.random.key(0), ids)["params"]
    params_c = get_policy("bf16", keep_float32=LM_KEEP_FLOAT32).cast_to_compute(params)
    return model, params_c, ids


@pytest.mark.slow
def test_the_compiled_step_never_holds_the_whole_logits():
    """Temporary memory of the LM's value-and-grad: the whole-logits path holds several f32[256, 2048] arrays
    (2 MiB each); the fused one (64-token blocks) stays under one of them."""
    logits_bytes = 256 * 2048 * 4
    temp = {}
    for chunk in (0, 64):
        model, params_c, ids = _lm(chunk)
        fn = jax.jit(jax.value_and_grad(lambda p, m=model, i=ids: m.apply({"params": p}, i, i)))
        temp[chunk] = fn.lower(params_c).compile().memory_analysis().temp_size_in_bytes
    assert temp[0] > 2 * logits_bytes and temp[64] < logits_bytes, temp


@pytest.mark.slow
def test_lm_loss_with_targets_equals_the_logits_path():
    model, params_c, ids = _lm(0)
    fused, _, _ = _lm(48)  # 48 does not divide 256 tokens: the last block is padded
    whole = jax.value_and_grad(lambda p: model.apply({"params": p}, ids, ids))(params_c)
    split = jax.value_and_grad(lambda p: fused.apply({"params": p}, ids, ids))(params_c)
    np.testing.assert_allclose(float(split[0]), float(whole[0]), rtol=1e-6)
    for _, a, b in leaf_pairs(split[1], whole[1]):
        scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-2 * scale + 1e-8)
    with pytest.raises(ValueError, match="targets must have the shape"):
        model.apply({"params": params_c}, ids, ids[:, :5])


@pytest.mark.slow
def test_training_with_loss_chunk_follows_the_whole_logits_run(tmp_path):
    """Five bf16 steps of the experiment's step function, with and without fusion: the first losses are equal to
    float32 rounding; later ones drift by the table gradient's last bits, which Adam passes on (measured: 2e-5
    relative by step 5, against ~1e-3 between bf16 and fp32)."""
    losses = {}
    for chunk in (0, 100):  # 100 does not divide the 12 x 64 tokens of a batch
        run = build(TrainConfig(precision="bf16", loss_chunk=chunk, steps=5, workdir=str(tmp_path / str(chunk))))
        state, seen = run.state, []
        for step in range(5):
            state, metrics = run.step_fn(state, train_batch(run, step))
            seen.append(float(metrics["loss"]))
        losses[chunk] = seen
    np.testing.assert_allclose(losses[100][0], losses[0][0], rtol=1e-6)
    np.testing.assert_allclose(losses[100], losses[0], rtol=1e-4)
    assert losses[0][-1] < losses[0][0]


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int8, jnp.int16])
def test_narrow_integer_targets_give_the_int32_gradients(dtype):
    # A vocabulary past the targets' dtype range (300 > 255): the backward's one-hot must not wrap arange(vocab)
    # (uint8 made row 256 hit for target 0: table gradient off by 0.13).
    k = jax.random.split(jax.random.key(1), 3)
    x, table = jax.random.normal(k[0], (3, 7, 16)), jax.random.normal(k[1], (300, 16)) * 0.3
    targets = jax.random.randint(k[2], (3, 7), 0, 120)
    fused = lambda x, table, t: jnp.mean(attend_cross_entropy(x, table, t, 4))  # noqa: E731
    loss, (gx, gt) = jax.value_and_grad(fused, argnums=(0, 1))(x, table, targets.astype(dtype))
    rloss, (rx, rt) = jax.value_and_grad(_reference, argnums=(0, 1))(x, table, targets)
    np.testing.assert_allclose(float(loss), float(rloss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), rtol=0, atol=1e-7)
    np.testing.assert_allclose(np.asarray(gt), np.asarray(rt), rtol=0, atol=2e-6 * float(jnp.max(jnp.abs(rt))))


def test_negative_targets_give_nan_losses_and_no_tokens_give_no_losses():
    x, table, targets = _inputs(jnp.float32)
    losses = attend_cross_entropy(x, table, targets.at[1, 2].set(-1), 4)  # not a wrap-around to the last id
    assert bool(jnp.isnan(losses[1, 2])) and int(jnp.isnan(losses).sum()) == 1
    empty = attend_cross_entropy(x[:, :0], table, targets[:, :0], 4)
    assert empty.shape == (B, 0) and empty.dtype == jnp.float32
