"""Grouped FP8 matmuls (jaxamp.fp8_grouped): `fp8_ragged_dot` is one current-scaled `fp8_dot_general` per group,
value and gradients; rows past the groups stay zero; a power-of-2 loss scale cancels bitwise; an operand nothing
differentiates gets no gradient GEMM; an MoE written with `lax.ragged_dot` trains under `fp8-current` beside bf16."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxamp import NoOpLossScale, TrainState, train_step
from jaxamp import fp8_recipes as fr
from jaxamp.fp8_grouped import fp8_ragged_dot, group_ids

SIZES = jnp.array([10, 0, 12, 14], jnp.int32)  # 36 of 40 rows, one empty group


def normal(seed: int, shape, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32) * np.float32(scale))


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def value_and_grads(f, x, w, ct):
    out, vjp = jax.vjp(f, x, w)
    return out, *vjp(ct)


def operands():
    x, g = normal(1, (40, 64)), normal(3, (40, 32))
    w = normal(2, (4, 64, 32), 0.1) * jnp.array([1.0, 1.0, 1e-5, 1.0])[:, None, None]  # group 2: 1e5x smaller
    return x, w, g


@pytest.mark.parametrize("recipe", ["current", "current-pow2"])
def test_each_group_is_its_own_current_scaled_matmul(recipe):
    x, w, g = operands()
    got = jax.jit(functools.partial(value_and_grads, lambda x, w: fp8_ragged_dot(
        x, w, SIZES, recipe=recipe, compute_dtype=jnp.float32)))(x, w, g)
    one = jax.jit(functools.partial(value_and_grads, lambda x, w: fr.fp8_dot_general(
        x, w, (((1,), (0,)), ((), ())), recipe=recipe, compute_dtype=jnp.float32)))
    starts = np.concatenate([[0], np.cumsum(SIZES)])
    for e in range(4):
        rows = slice(int(starts[e]), int(starts[e + 1]))
        if rows.start == rows.stop:  # the empty group: no rows, no weight gradient
            assert not jnp.any(got[2][e])
            continue
        out, dx, dw = one(x[rows], w[e], g[rows])
        for a, b in ((got[0][rows], out), (got[1][rows], dx), (got[2][e], dw)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(b))))
    assert not jnp.any(got[0][36:]) and not jnp.any(got[1][36:])  # rows in no group: zeros, as lax.ragged_dot's
    exact = jax.lax.ragged_dot(x, w, SIZES, precision="highest")
    assert rel_l2(got[0][10:22], exact[10:22]) < 0.05  # the small group at e4m3's rounding, not flushed
    assert 0.005 < rel_l2(got[0], exact) < 0.05
    assert got[1].dtype == x.dtype and got[2].dtype == w.dtype
    assert group_ids(SIZES, 40).tolist() == [0] * 10 + [2] * 12 + [3] * 14 + [4] * 4


def test_a_power_of_2_loss_scale_cancels_bitwise_and_an_input_gets_no_gradient_gemm():
    x, w, g = operands()
    grads = jax.jit(lambda ct: jax.vjp(lambda x, w: fp8_ragged_dot(x, w, SIZES), x, w)[1](ct))
    plain = grads(g.astype(jnp.bfloat16))
    scaled = grads((g * 1024.0).astype(jnp.bfloat16))
    for a, b in zip(plain, scaled):
        assert jnp.array_equal(a.astype(jnp.float32) * 1024.0, b.astype(jnp.float32))
    w_only = jax.make_jaxpr(jax.grad(lambda w: jnp.sum(fp8_ragged_dot(x, w, SIZES).astype(jnp.float32))))(w)
    count = str(w_only).count("ragged_dot_general[")
    assert count == 2, w_only  # the forward and the weight gradient: no dgrad for x


def test_bad_input_gives_one_clear_error():
    x, w, _ = operands()
    with pytest.raises(ValueError, match="per-tensor recipes .* not 'block'"):
        fp8_ragged_dot(x, w, SIZES, recipe="block")
    with pytest.raises(TypeError, match="lhs is int32"):
        fp8_ragged_dot(x.astype(jnp.int32), w, SIZES)
    with pytest.raises((TypeError, ValueError)):
        fp8_ragged_dot(x[:, :32], w, SIZES)  # k does not match: lax.ragged_dot's own message


class RaggedMoE(nn.Module):
    """Top-2 routing to 4 experts run as grouped matmuls over the tokens sorted by expert (MaxText's GPU path)."""

    @nn.compact
    def __call__(self, x):  # f32[tokens, 32]
        weights, chosen = jax.lax.top_k(nn.Dense(4, use_bias=False, name="router")(x), 2)
        weights = jax.nn.softmax(weights, axis=-1)
        order = jnp.argsort(chosen.reshape(-1))  # the tokens * 2 picks, grouped by expert
        token = jnp.repeat(jnp.arange(x.shape[0]), 2)[order]
        sizes = jnp.bincount(chosen.reshape(-1), length=4).astype(jnp.int32)
        w_in = self.param("w_in", nn.initializers.lecun_normal(), (4, 32, 64))
        w_out = self.param("w_out", nn.initializers.lecun_normal(), (4, 64, 32))
        h = nn.gelu(jax.lax.ragged_dot(nn.Dense(32, name="up")(x)[token], w_in, sizes))
        y = jax.lax.ragged_dot(h, w_out, sizes) * weights.reshape(-1)[order][:, None]  # [tokens * 2, 32]
        return nn.Dense(4, name="head")(x + jnp.zeros_like(x).at[token].add(y))


def test_an_moe_written_with_ragged_dot_trains_in_fp8_beside_bf16_in_one_trace():
    net = RaggedMoE()
    x = normal(5, (64, 32))
    batch = {"x": x, "y": jnp.argmax(x[:, :4], axis=-1)}
    params = net.init(jax.random.key(0), x)["params"]
    traces = []

    def loss(p, b, rng):
        traces.append(1)
        return optax.softmax_cross_entropy_with_integer_labels(net.apply({"params": p}, b["x"]), b["y"]).mean()

    step = jax.jit(train_step, static_argnames="loss_fn")
    losses = {}
    for spec in ("bf16;autocast", "fp8-current"):
        state = TrainState.create(params=jax.tree.map(jnp.copy, params), tx=optax.adam(1e-2), policy=spec,
                                  loss_scale=NoOpLossScale(), rng=jax.random.key(1))
        traces.clear()
        for _ in range(8):
            state, metrics = step(state, batch, loss)
        assert len(traces) == 1 and int(state.step) == 8
        losses[spec] = float(metrics["loss"])
    assert losses["bf16;autocast"] < 1.2  # it learns (ln 4 = 1.39 at the start)
    assert abs(losses["fp8-current"] - losses["bf16;autocast"]) < 0.03 * losses["bf16;autocast"], losses


def test_a_non_finite_row_in_no_group_stays_out_of_the_result():
    """Rows past the groups (padding) are skipped by `ragged_dot`: a NaN or inf there gave every output row a NaN
    through that row's own scale (0 x NaN); now the result and gradients equal those with the row zeroed. A NaN
    inside a group still reaches the loss scale's finite check."""
    x, w, g = operands()
    f = jax.jit(functools.partial(value_and_grads, lambda x, w: fp8_ragged_dot(x, w, SIZES, compute_dtype=jnp.float32)))
    clean = f(x, w, g)
    for bad in (jnp.nan, jnp.inf):
        for a, b in zip(f(x.at[38].set(bad), w, g.at[37].set(bad)), clean):
            assert jnp.array_equal(a, b)
    inside = f(x.at[3].set(jnp.nan), w, g)
    assert not bool(jnp.all(jnp.isfinite(inside[0][:10])))
