"""Tests for jaxamp.lm.model: precision contract, causality, numerics islands, nanoGPT shape/init, generate."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

from jaxamp.lm.model import (
    LayerNorm,
    TransformerConfig,
    TransformerLM,
    count_params,
    cross_entropy_loss,
    dot_product_attention,
    generate,
)

HALF_AND_FULL = [jnp.float32, jnp.float16, jnp.bfloat16]
# Small model for fast tests (2 CPU cores).
SMALL = TransformerConfig(vocab_size=65, seq_len=16, num_layers=2, num_heads=4, width=32)


@pytest.fixture(autouse=True)
def _strict_promotion():
    """Any implicit dtype promotion inside a test is an error (also set by conftest; kept so the file stands alone)."""
    with jax.numpy_dtype_promotion("strict"):
        yield


@pytest.fixture(scope="module")
def small():
    """(model, float32 variables, jitted apply, tokens i32[2, 16])."""
    model = TransformerLM(SMALL)
    tokens = jax.random.randint(jax.random.key(1), (2, SMALL.seq_len), 0, SMALL.vocab_size, dtype=jnp.int32)
    variables = jax.jit(model.init)(jax.random.key(0), tokens)
    return model, variables, jax.jit(model.apply), tokens


def cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype), tree)


def all_eqns(jaxpr):
    """Every equation of a jaxpr, recursing into sub-jaxprs (jit, custom_jvp, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jex_core.ClosedJaxpr):
                    yield from all_eqns(sub.jaxpr)
                elif isinstance(sub, jex_core.Jaxpr):
                    yield from all_eqns(sub)


def test_strict_promotion_is_in_effect():
    assert jax.config.jax_numpy_dtype_promotion == "strict"
    with pytest.raises(jax.dtypes.TypePromotionError):
        jnp.ones(2, jnp.float16) + jnp.ones(2, jnp.float32)


# ----------------------------------------------------------------------------- precision contract


@pytest.mark.slow
@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=lambda d: jnp.dtype(d).name)
def test_logits_float32_and_activations_in_param_dtype(small, dtype):
    model, variables, apply, tokens = small
    reference = apply(variables, tokens)
    apply_capture = jax.jit(functools.partial(model.apply, capture_intermediates=True, mutable=["intermediates"]))
    logits, state = apply_capture(cast(variables, dtype), tokens)
    assert logits.dtype == jnp.float32
    assert logits.shape == (2, SMALL.seq_len, SMALL.vocab_size)
    assert bool(jnp.all(jnp.isfinite(logits)))
    tol = {jnp.float32: 1e-5, jnp.float16: 1e-2, jnp.bfloat16: 5e-2}[dtype]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(reference), atol=tol, rtol=0)
    if dtype != jnp.float32:  # the half-precision forward really is a different computation
        assert float(jnp.max(jnp.abs(logits - reference))) > 0
    inter = state["intermediates"]
    assert inter["wte"]["__call__"][0].dtype == dtype  # embedding lookup keeps the params' dtype
    for i in range(SMALL.num_layers):
        block = inter[f"h_{i}"]
        assert block["__call__"][0].dtype == dtype
        assert block["ln_1"]["__call__"][0].dtype == dtype  # LayerNorm returns the compute dtype
        assert block["attn"]["__call__"][0].dtype == dtype
        assert block["mlp"]["c_fc"]["__call__"][0].dtype == dtype
    assert inter["ln_f"]["__call__"][0].dtype == dtype
    assert inter["__call__"][0].dtype == jnp.float32


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_matmuls_run_in_param_dtype_except_float32_islands(small, dtype):
    model, variables, _, tokens = small
    jaxpr = jax.make_jaxpr(model.apply)(cast(variables, dtype), tokens)
    dots = [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    L = SMALL.num_layers
    assert len(dots) == 6 * L + 1  # per layer: c_attn, QK^T, PV, c_proj, c_fc, mlp c_proj; plus the tied head
    in_dtypes = [tuple(v.aval.dtype for v in e.invars) for e in dots]
    half = [e for e, d in zip(dots, in_dtypes) if d == (dtype, dtype)]
    f32 = [e for e, d in zip(dots, in_dtypes) if d == (jnp.float32, jnp.float32)]
    assert len(half) == 4 * L + 1  # every Dense layer and the head run in the compute dtype
    assert len(f32) == 2 * L  # the attention island's two matmuls run in float32
    head = half[-1]
    assert head.outvars[0].aval.dtype == jnp.float32  # preferred_element_type=float32
    assert head.outvars[0].aval.shape == (2, SMALL.seq_len, SMALL.vocab_size)
    assert sum(e.outvars[0].aval.dtype == dtype for e in half) == 4 * L


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_grad_through_half_precision_model_under_strict_jit(small, dtype):
    model, variables, _, tokens = small

    def loss(params32):  # like the training step: cast float32 master params, then apply
        logits = model.apply(cast(params32, dtype), tokens)
        return cross_entropy_loss(logits[:, :-1], tokens[:, 1:])

    value, grads = jax.jit(jax.value_and_grad(loss))(variables)
    assert value.dtype == jnp.float32 and math.isfinite(float(value))
    assert abs(float(value) - math.log(SMALL.vocab_size)) < 0.1  # tiny init: near-uniform predictions
    leaves = jax.tree.leaves(grads)
    assert all(g.dtype == jnp.float32 for g in leaves)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert float(jnp.max(jnp.abs(grads["params"]["wte"]["embedding"]))) > 0


# ----------------------------------------------------------------------------- causality and islands


def test_causality_bitwise_in_float32(small):
    model, variables, apply, tokens = small
    base = np.asarray(apply(variables, tokens))
    for t in (0, 5, SMALL.seq_len - 2):
        changed = tokens.at[:, t + 1].set((tokens[:, t + 1] + 1) % SMALL.vocab_size)
        out = np.asarray(apply(variables, changed))
        assert np.array_equal(out[:, : t + 1], base[:, : t + 1]), f"positions <= {t} saw token {t + 1}"
        assert not np.array_equal(out[:, t + 1], base[:, t + 1])  # the change itself is visible


@pytest.mark.slow
def test_fully_masked_attention_row_is_finite_in_float16():
    q, k, v = (jax.random.normal(key, (1, 4, 2, 8), jnp.float32).astype(jnp.float16)
               for key in jax.random.split(jax.random.key(0), 3))  # [batch, seq, heads, head_dim]
    mask = np.tril(np.ones((4, 4), bool))
    mask[2, :] = False  # query 2 may attend to nothing
    mask = jnp.asarray(mask)[None, None]  # [1, 1, q_seq, kv_seq]
    # JAX itself (eager; its first line is a promote_types query that strict mode rejects).
    with jax.numpy_dtype_promotion("standard"):
        raw = jax.nn.dot_product_attention(q, k, v, mask=mask)
    assert raw.dtype == jnp.float16 and bool(jnp.all(jnp.isfinite(raw)))
    # The model's wrapper, jitted under strict promotion.
    out = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask=mask))(q, k, v)
    assert out.dtype == jnp.float16 and bool(jnp.all(jnp.isfinite(out)))
    # A fully masked row attends uniformly (finite mask value), i.e. averages all values.
    expected = jnp.mean(v.astype(jnp.float32), axis=1)  # [batch, heads, head_dim]
    np.testing.assert_allclose(np.asarray(out[:, 2], np.float32), np.asarray(expected), atol=2e-3)
    np.testing.assert_allclose(np.asarray(raw[:, 2], np.float32), np.asarray(expected), atol=2e-3)
    # The other rows agree with JAX's own result (which also rounds the probabilities to float16).
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(raw, np.float32), atol=2e-3)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_layernorm_is_a_float32_island(dtype):
    norm = LayerNorm()
    rows = np.stack([
        np.full(64, 300.0),  # constant row: variance 0
        300.0 + np.linspace(-8.0, 8.0, 64),  # large mean, small spread: x^2 = 9e4 overflows float16
        np.linspace(-3.0, 3.0, 64),
    ])
    x = jnp.asarray(rows, jnp.float32).astype(dtype)  # [3, 64]
    variables = cast(norm.init(jax.random.key(0), x), dtype)
    y = jax.jit(norm.apply)(variables, x)
    assert y.dtype == dtype
    y32 = np.asarray(y, np.float32)
    assert np.all(np.isfinite(y32))
    assert np.array_equal(y32[0], np.zeros(64, np.float32))  # (x - mean) == 0 exactly; bias 0
    xr = np.asarray(x, np.float64)  # reference on the rounded inputs, in float64
    ref = (xr - xr.mean(-1, keepdims=True)) / np.sqrt(xr.var(-1, keepdims=True) + 1e-5)
    tol = 1e-2 if dtype == jnp.float16 else 4e-2
    np.testing.assert_allclose(y32[1:], ref[1:], atol=tol)
    assert np.abs(y32[1]).max() > 1.5  # really normalised, not collapsed to 0


# ----------------------------------------------------------------------------- nanoGPT shape and init


def test_output_shape_and_sequence_length_check(small):
    model, variables, apply, _ = small
    tokens = jnp.zeros((3, 5), jnp.int32)
    assert apply(variables, tokens).shape == (3, 5, SMALL.vocab_size)
    with pytest.raises(ValueError, match="exceeds config.seq_len=16"):
        model.apply(variables, jnp.zeros((1, SMALL.seq_len + 1), jnp.int32))
    with pytest.raises(ValueError, match="2-D"):
        model.apply(variables, jnp.zeros((SMALL.seq_len,), jnp.int32))


def nanogpt_param_count(L, d, V, T, bias=True):
    """Independent count of nanoGPT's parameters with a tied head (lm_head shares wte)."""
    ln = 2 * d if bias else d
    per_layer = (
        ln  # ln_1
        + 3 * d * d + (3 * d if bias else 0)  # c_attn
        + d * d + (d if bias else 0)  # attn c_proj
        + ln  # ln_2
        + 4 * d * d + (4 * d if bias else 0)  # c_fc
        + 4 * d * d + (d if bias else 0)  # mlp c_proj
    )
    return L * per_layer + ln + V * d + T * d  # blocks, ln_f, wte, wpe


@pytest.mark.parametrize("use_bias", [True, False])
def test_param_count_matches_nanogpt_formula(use_bias):
    cfg = TransformerConfig(vocab_size=65, seq_len=64, num_layers=4, num_heads=4, width=128, use_bias=use_bias)
    shapes = jax.eval_shape(TransformerLM(cfg).init, jax.random.key(0), jnp.zeros((1, 64), jnp.int32))
    L, d, V, T = 4, 128, 65, 64
    assert count_params(shapes) == nanogpt_param_count(L, d, V, T, bias=use_bias)
    if use_bias:
        assert count_params(shapes) == 12 * L * d**2 + 13 * L * d + 2 * d + V * d + T * d == 809_856
    assert set(shapes["params"]) == {"wte", "wpe", "ln_f", *(f"h_{i}" for i in range(L))}  # no separate head


@pytest.mark.slow
def test_nanogpt_initialisation():
    cfg = TransformerConfig(vocab_size=65, seq_len=64, num_layers=2, num_heads=4, width=128)
    p = jax.jit(TransformerLM(cfg).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(p))
    resid_std = 0.02 / math.sqrt(2 * cfg.num_layers)
    stds = {
        "wte": float(jnp.std(p["wte"]["embedding"])),
        "wpe": float(jnp.std(p["wpe"]["embedding"])),
        "c_attn": float(jnp.std(p["h_0"]["attn"]["c_attn"]["kernel"])),
        "c_fc": float(jnp.std(p["h_1"]["mlp"]["c_fc"]["kernel"])),
    }
    for name, std in stds.items():
        assert abs(std - 0.02) < 0.02 * 0.06, (name, std)
    for proj in (p["h_0"]["attn"]["c_proj"]["kernel"], p["h_1"]["mlp"]["c_proj"]["kernel"]):
        assert abs(float(jnp.std(proj)) - resid_std) < resid_std * 0.06
    assert float(jnp.max(jnp.abs(p["h_0"]["attn"]["c_attn"]["bias"]))) == 0.0
    assert float(jnp.max(jnp.abs(p["h_0"]["mlp"]["c_proj"]["bias"]))) == 0.0
    np.testing.assert_array_equal(np.asarray(p["ln_f"]["scale"]), np.ones(128, np.float32))
    np.testing.assert_array_equal(np.asarray(p["ln_f"]["bias"]), np.zeros(128, np.float32))


@pytest.mark.slow
def test_dropout_only_when_not_deterministic(small):
    model0, v0, _, tokens = small
    model = TransformerLM(dataclasses.replace(SMALL, dropout=0.3))  # same parameter tree as SMALL
    variables = v0
    apply = jax.jit(model.apply, static_argnames="deterministic")
    k1, k2 = jax.random.key(11), jax.random.key(12)
    det = np.asarray(apply(variables, tokens))
    det_rng = np.asarray(apply(variables, tokens, deterministic=True, rngs={"dropout": k1}))
    assert np.array_equal(det, det_rng)
    train1 = np.asarray(apply(variables, tokens, deterministic=False, rngs={"dropout": k1}))
    train1b = np.asarray(apply(variables, tokens, deterministic=False, rngs={"dropout": k1}))
    train2 = np.asarray(apply(variables, tokens, deterministic=False, rngs={"dropout": k2}))
    assert np.array_equal(train1, train1b)  # same key, same mask
    assert np.abs(train1 - det).max() > 1e-3
    assert np.abs(train1 - train2).max() > 1e-3
    # dropout = 0: deterministic=False changes nothing and needs no rng.
    apply0 = jax.jit(model0.apply, static_argnames="deterministic")
    np.testing.assert_array_equal(np.asarray(apply0(v0, tokens, deterministic=False)), det)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(vocab_size=0), "vocab_size"),
        (dict(seq_len=-1), "seq_len"),
        (dict(num_layers=0), "num_layers"),
        (dict(num_heads=0), "num_heads"),
        (dict(width=0), "width must be a positive integer"),
        (dict(mlp_ratio=0), "mlp_ratio"),
        (dict(width=130, num_heads=4), r"heads \(4\) must divide width \(130\)"),
        (dict(dropout=1.0), r"dropout must be a probability in \[0, 1\)"),
        (dict(dropout=-0.1), "dropout"),
    ],
)
def test_config_errors(kwargs, match):
    base = dict(vocab_size=65, seq_len=16)
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**{**base, **kwargs})


def test_config_head_dim():
    assert TransformerConfig(vocab_size=65, seq_len=16).head_dim == 32
    assert TransformerConfig(vocab_size=65, seq_len=16, width=48, num_heads=6).head_dim == 8


# ----------------------------------------------------------------------------- loss, count, generate


def test_cross_entropy_loss():
    loss_fn = jax.jit(cross_entropy_loss)
    V = 7
    targets = jnp.array([[0, 3, 6]], jnp.int32)
    uniform = jnp.zeros((1, 3, V), jnp.float16)
    loss = loss_fn(uniform, targets)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    assert abs(float(loss) - math.log(V)) < 1e-6
    logits = np.random.default_rng(0).normal(size=(2, 3, V)).astype(np.float32)
    tg = np.array([[1, 2, 3], [4, 5, 6]])
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(logp, tg[..., None], -1).mean()
    got = loss_fn(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(tg, jnp.int32))
    assert got.dtype == jnp.float32
    assert abs(float(got) - expected) < 0.05  # bf16-rounded logits
    assert abs(float(loss_fn(jnp.asarray(logits), jnp.asarray(tg, jnp.int32))) - expected) < 1e-5


def test_count_params():
    assert count_params({"a": jnp.zeros((3, 4)), "b": [jnp.zeros(5), jnp.zeros((2, 2, 2))]}) == 25
    assert count_params({}) == 0
    mixed = {"scalar": 1.0, "shape": jax.ShapeDtypeStruct((2, 5), jnp.float32), "empty": jnp.zeros((0, 3))}
    assert count_params(mixed) == 11 and isinstance(count_params(mixed), int)


TINY = TransformerConfig(vocab_size=11, seq_len=8, num_layers=1, num_heads=2, width=16)
# generate is compiled per (model, prompt shape, num_tokens): both generate tests use these.
GEN_PROMPT = np.array([[1, 9, 4, 4, 0, 2], [3, 3, 7, 1, 8, 5]], np.int32)  # i32[2, 6], shorter than seq_len
GEN_NUM = 5  # 6 + 5 > seq_len: later contexts are cropped to the last seq_len tokens


@pytest.fixture(scope="module")
def tiny():
    model = TransformerLM(TINY)
    return model, jax.jit(model.init)(jax.random.key(3), jnp.zeros((1, 8), jnp.int32))


@pytest.mark.slow
def test_generate_shapes_and_valid_ids(tiny):
    model, variables = tiny
    out = generate(model, variables, GEN_PROMPT, GEN_NUM, jax.random.key(5))
    assert out.shape == (2, 11) and out.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out[:, :6]), GEN_PROMPT)
    assert int(out.min()) >= 0 and int(out.max()) < TINY.vocab_size
    assert len(set(np.asarray(out[:, 6:]).ravel().tolist())) > 1  # sampled, not constant
    again = generate(model, variables, GEN_PROMPT, GEN_NUM, jax.random.key(5))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))  # same key, same sample
    other = generate(model, variables, GEN_PROMPT, GEN_NUM, jax.random.key(6))
    assert not np.array_equal(np.asarray(out), np.asarray(other))
    one = generate(model, cast(variables, jnp.bfloat16), [7], 4, jax.random.key(0))  # 1-D prompt, half params
    assert one.shape == (5,) and one.dtype == jnp.int32
    assert int(one[0]) == 7 and 0 <= int(one.min()) and int(one.max()) < TINY.vocab_size
    np.testing.assert_array_equal(np.asarray(generate(model, variables, GEN_PROMPT, 0, jax.random.key(0))), GEN_PROMPT)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, variables, GEN_PROMPT, 3, jax.random.key(0), temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):  # flushes to 0 in float32
        generate(model, variables, GEN_PROMPT, 3, jax.random.key(0), temperature=1e-39)
    # The smallest accepted temperature is greedy, even with large logits (no inf/inf = NaN).
    big = jax.tree.map(lambda x: x * 20, variables)
    np.testing.assert_array_equal(
        np.asarray(generate(model, big, GEN_PROMPT, 4, jax.random.key(0), temperature=1.2e-38)),
        np.asarray(generate(model, big, GEN_PROMPT, 4, jax.random.key(9), temperature=1e-6)))
    with pytest.raises(ValueError, match="empty"):
        generate(model, variables, jnp.zeros((1, 0), jnp.int32), 3, jax.random.key(0))


@pytest.mark.slow
def test_generate_matches_a_manual_cropped_greedy_loop(tiny):
    """At a tiny temperature sampling is argmax; compare with nanoGPT's crop-to-seq_len loop."""
    model, variables = tiny
    # Larger weights make the prediction depend strongly on the whole context, so a context
    # that is off by one token changes the argmax.
    variables = jax.tree.map(lambda x: x * 10, variables)
    out = np.asarray(generate(model, variables, GEN_PROMPT, GEN_NUM, jax.random.key(0), temperature=1e-6))
    apply = jax.jit(model.apply)
    seq = GEN_PROMPT
    for _ in range(GEN_NUM):
        logits = np.asarray(apply(variables, jnp.asarray(seq[:, -TINY.seq_len:])))[:, -1]  # [2, vocab]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        assert np.all(top2[:, 1] - top2[:, 0] > 1e-4), "near-tie: pick another seed"
        seq = np.concatenate([seq, logits.argmax(-1)[:, None].astype(np.int32)], axis=1)
    np.testing.assert_array_equal(out, seq)


@pytest.mark.slow
@pytest.mark.parametrize("bad_id", [-1, -7, 10_000])
def test_out_of_range_token_ids_give_nan_not_another_token(tiny, bad_id):
    """Ids outside [0, vocab) cannot raise under jit; they must be loud (NaN), never silently another token."""
    model, variables = tiny
    tokens = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    good = jax.jit(model.apply)(variables, tokens)
    bad = jax.jit(model.apply)(variables, tokens.at[0, 2].set(bad_id))
    assert bool(jnp.all(jnp.isfinite(good)))
    assert bool(jnp.all(jnp.isnan(bad[0, 2:])))  # (earlier rows too: 0 x NaN in the masked probs @ values)


@pytest.mark.slow
def test_layers_compile_to_stock_flax_ops_in_float32():
    """In float32, jaxamp.layers' custom-VJP pieces (Embed lookup, Dense with add_bias, tied attend) add nothing:
    forward + backward compiles to the same ops, flops and bytes as nn.Embed / nn.Dense / nn.Embed.attend."""
    import collections
    import re

    import flax.linen as nn

    from jaxamp.layers import Dense, Embed

    def head(embed, dense):
        class Head(nn.Module):
            @nn.compact
            def __call__(self, ids):
                table = embed(65, 32, name="wte")
                return table.attend(dense(32, name="fc")(table(ids)))

        return Head()

    ids = jnp.asarray(np.random.default_rng(0).integers(0, 65, (4, 16)), jnp.int32)

    def compiled(model):
        params = model.init(jax.random.key(0), ids)["params"]
        step = jax.jit(jax.value_and_grad(lambda p: jnp.mean(jnp.square(model.apply({"params": p}, ids)))))
        exe = step.lower(params).compile()
        cost = exe.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        ops = collections.Counter(re.findall(r"= (\w+\[[^\]]*\])\S* (\w[\w-]*)\(", exe.as_text()))
        return jax.tree.structure(params), ops, (cost["flops"], cost["bytes accessed"])

    ours, stock = compiled(head(Embed, Dense)), compiled(head(nn.Embed, nn.Dense))
    assert ours == stock
