"""Stateless FP8 recipes (jaxamp.fp8_quant, jaxamp.fp8_recipes): quantization round trips within each format's
rounding, block scaling against outliers, `fp8_dot_general` against float32 and against its recipe written out by
hand, statelessness (no state in the jaxpr, loss-scale invariance, one trace), the FP8 GEMM pattern of `current` in
the jaxpr, mxfp8 against `jax.nn.scaled_dot_general`, and the errors."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jex

from jaxamp import fp8_quant as fq
from jaxamp import fp8_recipes as fr

MATMUL = (((1,), (0,)), ((), ()))  # x @ w for 2-D operands
RECIPE_NAMES = ("current", "current-pow2", "block", "mxfp8")


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def normal(seed: int, shape, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32) * np.float32(scale))


# --- quantize / dequantize ---

# (name, quantize, dequantize, FP8 dtype, mantissa bits, smallest subnormal, shape)
QUANTIZERS = [
    ("current-e4m3", lambda x: fq.quantize_current(x), fq.dequantize_current, fq.E4M3, 3, 2.0**-9, (64, 256)),
    ("current-e5m2", lambda x: fq.quantize_current(x, fq.E5M2), fq.dequantize_current, fq.E5M2, 2, 2.0**-16,
     (64, 256)),
    ("current-pow2", lambda x: fq.quantize_current(x, power_of_2=True), fq.dequantize_current, fq.E4M3, 3, 2.0**-9,
     (64, 256)),
    ("block-1x128", fq.quantize_block, fq.dequantize_block, fq.E4M3, 3, 2.0**-9, (64, 256)),
    ("block-1x128-partial", fq.quantize_block, fq.dequantize_block, fq.E4M3, 3, 2.0**-9, (10, 200)),
    ("block-1x128-fp32-scales", functools.partial(fq.quantize_block, power_of_2=False), fq.dequantize_block,
     fq.E4M3, 3, 2.0**-9, (64, 256)),
    ("block-128x128-partial", functools.partial(fq.quantize_block, weight=True),
     functools.partial(fq.dequantize_block, weight=True), fq.E4M3, 3, 2.0**-9, (200, 136)),
    ("mxfp8", fq.quantize_mxfp8, fq.dequantize_mxfp8, fq.E4M3, 3, 2.0**-9, (64, 256)),
]


@pytest.mark.parametrize("name,quantize,dequantize,dtype,mantissa,subnormal,shape", QUANTIZERS,
                         ids=[q[0] for q in QUANTIZERS])
def test_round_trip_within_the_formats_rounding(name, quantize, dequantize, dtype, mantissa, subnormal, shape):
    x = normal(0, shape, 0.3)
    q, scale = jax.jit(quantize)(x)
    assert q.dtype == dtype and q.shape == x.shape and scale.dtype == jnp.float32
    back = np.asarray(dequantize(q, scale), np.float64)
    x64 = np.asarray(x, np.float64)
    # Each element's scale, broadcast back over its tile (scales are per tensor, per 1x128, 128x128 or 1x32 tile).
    per_element = np.asarray(dequantize(jnp.ones_like(q), scale), np.float64)
    # Round to nearest: half an ulp, 2^-(mantissa+1) relative for normal values, half the smallest subnormal's
    # spacing (in units of the scale) below the normal range; plus float32's own roundings.
    bound = np.maximum(2.0 ** -(mantissa + 1) * np.abs(x64), subnormal / 2 * per_element) * (1 + 2.0**-20)
    err = np.abs(back - x64)
    assert np.all(err <= bound), f"{name}: worst excess {np.max(err - bound)}"
    normal_range = np.abs(x64) / per_element >= subnormal * 2**mantissa  # the format's smallest normal and up
    assert normal_range.mean() > 0.5
    worst = np.max(err[normal_range] / np.abs(x64[normal_range]))
    assert worst > 2.0 ** -(mantissa + 2), f"{name}: {worst} is too exact for {mantissa} mantissa bits"
    assert np.max(np.abs(x64)) / np.max(per_element) <= fq.FP8_MAX[jnp.dtype(dtype)]  # no scale saturates


def test_scale_shapes_and_rounding():
    x, x96 = normal(1, (10, 200)), normal(1, (4, 96))

    @jax.jit
    def scales(x, x96):
        return (fq.quantize_block(x)[1], fq.quantize_block(x, weight=True)[1], fq.quantize_mxfp8(x96)[1],
                fq.quantize_current(x, power_of_2=True)[1], fq.quantize_block(x, power_of_2=False)[1],
                fq.quantize_current(x, fq.E5M2)[1], fq.quantize_current(jnp.zeros((4, 4))))

    block, weight, mx, pow2, fp32_scales, e5m2, (zero_q, zero_scale) = scales(x, x96)
    assert block.shape == (10, 2)  # 1x128 tiles, the second one partial (72 elements)
    assert weight.shape == (1, 2)  # 128x128 blocks of a [10, 200] weight
    assert mx.shape == (4, 3)
    for scale in (block, weight, mx, pow2):
        assert np.all(np.exp2(np.round(np.log2(scale))) == scale)  # powers of 2
    assert np.array_equal(np.asarray(mx).astype(jnp.float8_e8m0fnu).astype(np.float32), mx)  # e8m0 values
    # amax / fmt_max, unrounded (DeepSeek-V3's scale; XLA on CPU may divide by the constant as a multiplication by
    # its rounded reciprocal: one float32 ulp).
    ax = np.abs(np.asarray(x, np.float64))
    np.testing.assert_allclose(fp32_scales[:, 0], ax[:, :128].max(axis=1) / 448, rtol=2.0**-23)
    np.testing.assert_allclose(fp32_scales[:, 1], ax[:, 128:].max(axis=1) / 448, rtol=2.0**-23)  # partial tile
    np.testing.assert_allclose(e5m2, ax.max() / 57344, rtol=2.0**-23)
    assert zero_scale == 1.0 and not np.any(np.asarray(zero_q, np.float32))  # amax == 0: no 0/0


def test_block_scaling_keeps_the_small_values_an_outlier_flushes_per_tensor():
    x = normal(2, (8, 256), 1e-3)  # small values everywhere...
    x = x.at[0, :4].set(jnp.array([1e4, -1e4, 5e3, 2e3]))  # ...and a few huge ones in row 0's first 128-tile
    small = np.ones(x.shape, bool)
    small[0, :4] = False

    def flushed(q, scale, dequantize):
        return (np.asarray(dequantize(q, scale)) == 0) & small

    per_tensor = flushed(*jax.jit(fq.quantize_current)(x), fq.dequantize_current)
    block = flushed(*jax.jit(fq.quantize_block)(x), fq.dequantize_block)
    mx = flushed(*jax.jit(fq.quantize_mxfp8)(x), fq.dequantize_mxfp8)
    assert per_tensor.sum() > 0.99 * small.sum()  # the outlier's scale (1e4 / 448) flushes nearly all of them
    outlier_tile = np.zeros(x.shape, bool)
    outlier_tile[0, :128] = True
    assert block.sum() <= 124 and not np.any(block & ~outlier_tile)  # only the outlier's own 1x128 tile loses them
    assert mx.sum() <= 28 and not np.any(mx[:, 32:]) and not np.any(mx[1:])  # only its 1x32 block


# --- fp8_dot_general against float32 ---

# (subscripts, lhs shape, rhs shape): sizes multiples of 32 (mxfp8), 160 is not a multiple of 128 (partial tiles).
CASES = {
    "x@w": ("mk,kn->mn", (64, 256), (256, 96)),
    "btd,dk->btk": ("btd,dk->btk", (2, 32, 160), (160, 96)),
    "bqd,bkd->bqk": ("bqd,bkd->bqk", (2, 32, 64), (2, 32, 64)),
    "bthd,hdk->btk": ("bthd,hdk->btk", (2, 32, 2, 32), (2, 32, 64)),
}


def _einsum(subscripts, dot_general):
    return lambda a, b: jnp.einsum(subscripts, a, b, _dot_general=dot_general).astype(jnp.float32)


def _value_and_grads(f, x, w, ct):
    out, vjp = jax.vjp(f, x, w)
    return out, *vjp(ct)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_forward_and_gradients_close_to_float32(recipe, case):
    subscripts, lhs_shape, rhs_shape = CASES[case]
    x, w = normal(3, lhs_shape), normal(4, rhs_shape, lhs_shape[-1] ** -0.5)
    fp8 = _einsum(subscripts, fr.recipe_dot_general(recipe, compute_dtype=jnp.float32))
    ref = _einsum(subscripts, lax.dot_general)
    ct = normal(5, jax.eval_shape(ref, x, w).shape)
    got = jax.jit(functools.partial(_value_and_grads, fp8))(x, w, ct)
    want = _value_and_grads(ref, x, w, ct)
    assert [g.dtype for g in got[1:]] == [jnp.float32, jnp.float32]
    # e4m3 operands: ~2.6% relative RMS each (measured); the e5m2 output gradient of `current`: ~5.3%.
    tolerances = (0.05, 0.08, 0.08) if recipe.startswith("current") else (0.05, 0.05, 0.05)
    errors = [rel_l2(g, r) for g, r in zip(got, want)]
    assert all(e < t for e, t in zip(errors, tolerances)), errors
    assert all(e > 0.005 for e in errors), errors  # and FP8 did round the operands


def _by_hand(recipe, x, w, g):
    """The recipe written out with the public quantizers, for x [m, k], w [k, n], g [m, n]: (out, dx, dw)."""
    if recipe.startswith("current"):
        pow2 = recipe == "current-pow2"
        dq_x = dq_w = lambda t: fq.dequantize_current(*fq.quantize_current(t, power_of_2=pow2))
        dq_g = lambda t: fq.dequantize_current(*fq.quantize_current(t, fq.E5M2, power_of_2=pow2))
        dq_w_rows = dq_w
    elif recipe == "block":
        dq_x = dq_g = lambda t: fq.dequantize_block(*fq.quantize_block(t))  # 1x128 along the last axis
        dq_w = dq_w_rows = lambda t: fq.dequantize_block(*fq.quantize_block(t, weight=True), weight=True)
    else:
        dq_x = dq_g = dq_w = dq_w_rows = lambda t: fq.dequantize_mxfp8(*fq.quantize_mxfp8(t))
    out = dq_x(x) @ dq_w(w.T).T  # w's tiles run along k, the forward's contraction
    dx = dq_g(g) @ dq_w_rows(w).T  # dgrad contracts over n: g tiled along n, w along n (128x128: the same blocks)
    dw = dq_x(x.T) @ dq_g(g.T).T  # wgrad contracts over m: x and g tiled along m
    return out, dx, dw


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_fp8_dot_general_is_its_recipe(recipe):
    """Forward and both gradients equal the recipe's quantizers written out (so the backward uses the prescribed
    tilings: quantizing x along k instead of m for the block wgrad would miss by ~1e-2, not 1e-6)."""
    x, w, g = normal(6, (64, 160)), normal(7, (160, 96), 0.1), normal(8, (64, 96))
    f = lambda x, w: fr.fp8_dot_general(x, w, MATMUL, recipe=recipe, compute_dtype=jnp.float32)
    got = jax.jit(functools.partial(_value_and_grads, f))(x, w, g)
    for a, b in zip(got, jax.jit(functools.partial(_by_hand, recipe))(x, w, g)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_a_batched_matmul_quantizes_each_batch_entry_alone(recipe):
    """Batch dims are independent matmuls (an MoE's experts, `"egcd,edf->egcf"`): value and both gradients equal
    one `fp8_dot_general` per entry, stacked, so an expert whose weights are 1e5x smaller than its neighbour's keeps
    FP8's precision instead of flushing under one scale for the whole stack."""
    dims = (((3,), (1,)), ((0,), (0,)))  # [e, g, c, d] . [e, d, f] -> [e, g, c, f]
    x, g = normal(40, (2, 4, 8, 64)), normal(42, (2, 4, 8, 32))
    w = normal(41, (2, 64, 32), 0.1) * jnp.array([1.0, 1e-5])[:, None, None]
    f = lambda x, w: fr.fp8_dot_general(x, w, dims, recipe=recipe, compute_dtype=jnp.float32)
    got = jax.jit(functools.partial(_value_and_grads, f))(x, w, g)
    one = lambda x, w: fr.fp8_dot_general(x, w, (((2,), (0,)), ((), ())), recipe=recipe, compute_dtype=jnp.float32)
    per_entry = [jax.jit(functools.partial(_value_and_grads, one))(x[e], w[e], g[e]) for e in range(2)]
    for a, b in zip(got, zip(*per_entry)):
        np.testing.assert_allclose(a, jnp.stack(b), rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(jnp.stack(b)))))
    exact = jnp.einsum("egcd,edf->egcf", x, w, precision="highest")
    assert rel_l2(got[0][1], exact[1]) < 0.05, rel_l2(got[0][1], exact[1])  # the small expert, at e4m3's ~3%


def test_flax_dense_drop_in():
    x = normal(9, (4, 16, 256)).astype(jnp.bfloat16)
    fp8_dense = nn.Dense(128, dtype=jnp.bfloat16, dot_general=fr.recipe_dot_general("block"))
    ref_dense = nn.Dense(128, dtype=jnp.float32)
    params = ref_dense.init(jax.random.PRNGKey(0), x)
    loss = lambda model, p: jnp.mean(jnp.square(model.apply(p, x).astype(jnp.float32)))
    y = jax.jit(fp8_dense.apply)(params, x)
    assert y.dtype == jnp.bfloat16
    assert rel_l2(y, jax.jit(ref_dense.apply)(params, x.astype(jnp.float32))) < 0.05
    grads = jax.jit(jax.grad(functools.partial(loss, fp8_dense)))(params)
    ref_grads = jax.jit(jax.grad(functools.partial(loss, ref_dense)))(params)
    assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(lambda p: p.dtype, params)  # f32 master params
    assert rel_l2(grads["params"]["kernel"], ref_grads["params"]["kernel"]) < 0.06


# --- stateless ---

def _loss(recipe, x, w, loss_scale=1.0):
    y = fr.fp8_dot_general(x, w, MATMUL, recipe=recipe)  # bf16
    return jnp.mean(jnp.tanh(y.astype(jnp.float32))) * loss_scale


def test_the_gradients_jaxpr_holds_no_state():
    x, w = normal(10, (64, 128)), normal(11, (128, 64))
    for recipe in RECIPE_NAMES:
        closed = jax.make_jaxpr(jax.grad(functools.partial(_loss, recipe), argnums=(0, 1)))(x, w)
        assert [v.aval.shape for v in closed.jaxpr.invars] == [(64, 128), (128, 64)]  # x and w: no amax history
        assert [v.aval.shape for v in closed.jaxpr.outvars] == [(64, 128), (128, 64)]
        assert all(np.ndim(c) == 0 for c in closed.consts)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_a_power_of_2_loss_scale_leaves_the_gradients_bitwise_unchanged(recipe):
    x, w = normal(12, (64, 128)).astype(jnp.bfloat16), normal(13, (128, 64), 0.1)
    grads = jax.jit(jax.grad(functools.partial(_loss, recipe), argnums=(0, 1)))
    plain = grads(x, w)

    def unscaled(loss_scale):
        return [(g.astype(jnp.float32) / loss_scale).astype(g.dtype) for g in grads(x, w, jnp.float32(loss_scale))]

    assert all(jnp.array_equal(a, b) for a, b in zip(plain, unscaled(2.0**10)))
    assert all(jnp.array_equal(a, b) for a, b in zip(plain, unscaled(2.0**-6)))
    if recipe == "current":  # the check can fail: a scale of 3 rounds differently
        assert not all(jnp.array_equal(a, b) for a, b in zip(plain, unscaled(3.0)))


def test_power_of_2_quantization_scales_leave_it_unchanged_too():
    x, w = normal(12, (64, 128)), normal(13, (128, 64), 0.1)
    loss = lambda x, w, s: _loss(fr.get_recipe("current", power_of_2=True), x, w, s)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))
    plain, scaled = grads(x, w, jnp.float32(1.0)), grads(x, w, jnp.float32(2.0**12))
    assert all(jnp.array_equal(a, b / 2.0**12) for a, b in zip(plain, scaled))


def test_a_jitted_training_loop_traces_once():
    traces = []

    @jax.jit
    def step(params, x, y):
        traces.append(1)

        def loss(p):
            h = jax.nn.relu(fr.fp8_dot_general(x, p["w1"], MATMUL, recipe="current").astype(jnp.float32))
            out = fr.fp8_dot_general(h, p["w2"], MATMUL, recipe="block", compute_dtype=jnp.float32)
            return jnp.mean(jnp.square(out - y))

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), value

    params = {"w1": normal(14, (64, 128), 0.125), "w2": normal(15, (128, 32), 0.09)}
    x, y = normal(16, (32, 64)), normal(17, (32, 32))
    losses = []
    for _ in range(5):
        params, value = step(params, x, y)
        losses.append(float(value))
    assert len(traces) == 1
    assert losses[-1] < losses[0] and np.all(np.isfinite(losses))


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_non_finite_values_stay_non_finite(recipe):
    """An overflowed gradient reaches the loss scale's finite check as inf/NaN, not as finite FP8 numbers."""
    x, w = normal(18, (32, 128)), normal(19, (128, 32))
    f = lambda x, w: fr.fp8_dot_general(x, w, MATMUL, recipe=recipe, compute_dtype=jnp.float32)
    run = jax.jit(functools.partial(_value_and_grads, f))
    for bad in (np.inf, np.nan):
        ct = np.ones((32, 32), np.float32)
        ct[3, 5] = bad
        _, dx, dw = run(x, w, ct)
        assert not np.all(np.isfinite(dx)) and not np.all(np.isfinite(dw))
    x_inf = np.array(x)
    x_inf[0, 0] = np.inf
    out, _, _ = run(x_inf, w, np.ones((32, 32), np.float32))
    assert not np.all(np.isfinite(out))


# --- what XLA's FP8 GEMM rewrite looks for ---

def _eqns(jaxpr):
    yield from jaxpr.eqns
    for sub in jex.subjaxprs(jaxpr):
        yield from _eqns(sub)


def _fp8_converts(jaxpr) -> dict[str, int]:
    counts = {"float8_e4m3fn": 0, "float8_e5m2": 0}
    for eqn in _eqns(jaxpr):
        if eqn.primitive.name == "convert_element_type" and str(eqn.params["new_dtype"]) in counts:
            counts[str(eqn.params["new_dtype"])] += 1
    return counts


@pytest.mark.parametrize("recipe,forward,backward", [
    ("current", {"float8_e4m3fn": 2, "float8_e5m2": 0}, {"float8_e4m3fn": 2, "float8_e5m2": 1}),  # x, w; g once
    ("block", {"float8_e4m3fn": 2, "float8_e5m2": 0}, {"float8_e4m3fn": 5, "float8_e5m2": 0}),  # + x^T, g, g^T
    ("mxfp8", {"float8_e4m3fn": 2, "float8_e5m2": 0}, {"float8_e4m3fn": 6, "float8_e5m2": 0}),  # + x^T, w^T, g, g^T
])
def test_quantizations_in_the_jaxpr(recipe, forward, backward):
    """Explicit `convert_element_type` to FP8 for both operands in the forward and for the output gradient in the
    backward; the counts also show which quantized copies the backward reuses."""
    x, w = normal(20, (64, 128)), normal(21, (128, 64))
    f = lambda x, w: fr.fp8_dot_general(x, w, MATMUL, recipe=recipe)
    assert _fp8_converts(jax.make_jaxpr(f)(x, w).jaxpr) == forward
    grad = jax.grad(functools.partial(_loss, recipe), argnums=(0, 1))
    assert _fp8_converts(jax.make_jaxpr(grad)(x, w).jaxpr) == backward


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_an_operand_nothing_differentiates_gets_no_gradient_gemm(recipe):
    """A raw input batch (or a frozen weight) needs no gradient: its GEMM is not in the jaxpr at all (the precision
    audit counts only what runs), and the other gradient is bitwise the one computed beside it."""
    x, w = normal(24, (64, 128)), normal(25, (128, 64))
    loss = functools.partial(_loss, recipe)

    def dots(argnums):
        return sum(e.primitive.name == "dot_general" for e in jax.make_jaxpr(jax.grad(loss, argnums))(x, w).jaxpr.eqns)

    assert (dots((0, 1)), dots(1), dots(0)) == (3, 2, 2)  # forward + dgrad + wgrad; forward + one
    dx, dw = jax.grad(loss, (0, 1))(x, w)
    np.testing.assert_array_equal(jax.grad(loss, 1)(x, w), dw)
    np.testing.assert_array_equal(jax.grad(loss, 0)(x, w), dx)
    assert jax.grad(lambda x, w: jax.lax.stop_gradient(loss(x, w)) + jnp.sum(w), 1)(x, w).shape == w.shape


def _fp8_value(var, producers, layout_ops=("transpose", "reshape")) -> bool:
    """Whether `var` is an FP8 array (possibly through transposes and reshapes of one)."""
    eqn = producers.get(var)
    while eqn is not None and eqn.primitive.name in layout_ops and var.aval.dtype.itemsize == 1:
        var, eqn = eqn.invars[0], producers.get(eqn.invars[0])
    return jnp.issubdtype(var.aval.dtype, jnp.floating) and var.aval.dtype.itemsize == 1


def _scaled_by_scalars(out, users) -> bool:
    """Whether the dot's float32 output `out` is next multiplied by a float32 scalar (the product of the scales)."""
    return any(e.primitive.name == "mul" and any(v is not out and v.aval.shape == () for v in e.invars)
               for e in users.get(out, []))


def _gemms(recipe) -> list[tuple]:
    """Each GEMM of the recipe's value-and-gradient jaxpr: (operand dtypes, output dtype, scaled by scalars?)."""
    x, w = normal(22, (64, 128)), normal(23, (128, 64))
    jaxpr = jax.make_jaxpr(jax.grad(functools.partial(_loss, recipe), argnums=(0, 1)))(x, w).jaxpr
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    users = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if not isinstance(v, jex.Literal):
                users.setdefault(v, []).append(e)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3  # forward, dgrad, wgrad
    return [(tuple(_fp8_value(v, producers) for v in e.invars), e.outvars[0].aval.dtype,
             _scaled_by_scalars(e.outvars[0], users)) for e in dots]


def test_current_gemms_take_the_fp8_values_and_tiled_recipes_do_not():
    """`current`: each of the 3 GEMMs contracts the FP8 tensors themselves (`f8 . f8 -> f32`, an FP8 GEMM whichever
    kernel XLA:GPU picks), its output times the scalar scales; tiled scales: float32 GEMMs on dequantized operands."""
    assert _gemms("current") == [((True, True), jnp.float32, True)] * 3
    assert all(fp8 == (False, False) and dtype == jnp.float32 for fp8, dtype, _ in _gemms("block"))


@pytest.fixture
def traced_as_on_a_gpu(monkeypatch):
    """`jax.default_backend()` answers "gpu" while the test traces (what `fp8_recipes` reads to pick its GEMM form)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def _bf16_grads(recipe, x, w):
    """`_loss`'s value and gradients for bfloat16 x and w (the GEMM outputs that an epilogue can write in bf16)."""
    return jax.jit(jax.value_and_grad(functools.partial(_loss, recipe), argnums=(0, 1)))(x, w)


def test_power_of_2_scales_on_a_gpu_let_the_gemm_write_bfloat16(traced_as_on_a_gpu):
    """`current-pow2` on a GPU: forward and dgrad are `f8 . f8 -> bf16` times the scale product (a power of 2), the
    form XLA folds into cuBLASLt's FP8 GEMM (no float32 output for another kernel to round); wgrad (a weight-sized
    output) stays float32; `current` (scales not powers of 2) keeps every GEMM float32."""
    x, w = normal(22, (64, 128)).astype(jnp.bfloat16), normal(23, (128, 64)).astype(jnp.bfloat16)
    jaxpr = lambda recipe: jax.make_jaxpr(jax.grad(functools.partial(_loss, recipe), argnums=(0, 1)))(x, w).jaxpr
    dtypes = lambda recipe: [e.outvars[0].aval.dtype for e in jaxpr(recipe).eqns if e.primitive.name == "dot_general"]
    assert dtypes("current-pow2") == [jnp.bfloat16, jnp.bfloat16, jnp.float32]  # forward, dgrad, wgrad
    assert dtypes("current") == [jnp.float32] * 3


def test_the_bfloat16_gemm_form_is_bitwise_the_float32_one():
    """The exactness the GPU form rests on: a power-of-2 scale product applied after the GEMM's one rounding to
    bfloat16 gives the bits of the float32 form (scale, then round once), value and both gradients (XLA:CPU runs
    both forms; cuBLASLt applies the scales in float32 before its rounding, the float32 form's order)."""
    x, w = normal(24, (64, 128), 30.0).astype(jnp.bfloat16), normal(25, (128, 64), 0.01).astype(jnp.bfloat16)
    cpu_form = _bf16_grads("current-pow2", x, w)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(jax, "default_backend", lambda: "gpu")
        gpu_form = _bf16_grads("current-pow2", x, w)
    assert jax.tree.structure(cpu_form) == jax.tree.structure(gpu_form)
    for a, b in zip(jax.tree.leaves(cpu_form), jax.tree.leaves(gpu_form)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a).view(np.uint16 if a.dtype == jnp.bfloat16
                                                                         else np.uint32),
                                                     np.asarray(b).view(np.uint16 if b.dtype == jnp.bfloat16
                                                                        else np.uint32))


# --- mxfp8 against jax.nn.scaled_dot_general ---

@pytest.fixture
def scaled_dot_general():
    """`jax.nn.scaled_dot_general` with mxfp8 configs. Its `scaled_matmul` primitive has no CPU lowering in jax
    0.10.2 (NotImplementedError); on CPU this registers, for the test, the lowering JAX itself uses on ROCm
    (`lax.scaled_dot`, which XLA's CPU backend runs), so JAX's own quantization and custom VJP are what is compared."""
    configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
    fn = functools.partial(jax.nn.scaled_dot_general, configs=configs)
    if jax.default_backend() != "cpu":
        try:
            jax.block_until_ready(fn(jnp.ones((32, 32)), jnp.ones((32, 32)), MATMUL))
        except Exception as e:  # cuDNN's block-scaled dot needs a Blackwell GPU
            pytest.skip(f"jax.nn.scaled_dot_general does not run here: {type(e).__name__}")
        yield fn, None
        return
    try:
        from jax._src.cudnn import scaled_matmul_stablehlo as smm
        from jax._src.interpreters import mlir
        rules = mlir._platform_specific_lowerings["cpu"]
        rule = smm._scaled_matmul_rocm_lowering
    except (ImportError, AttributeError, KeyError) as e:
        pytest.skip(f"this jax has no ROCm lowering of scaled_matmul to borrow: {e}")
    had = smm._scaled_matmul_p in rules
    mlir.register_lowering(smm._scaled_matmul_p, rule, platform="cpu")
    try:
        yield fn, smm.quantize
    finally:
        if not had:
            rules.pop(smm._scaled_matmul_p, None)


@pytest.mark.parametrize("lhs_shape,rhs_shape,dims", [
    ((64, 96), (96, 64), MATMUL),
    ((2, 32, 64), (2, 64, 32), (((2,), (1,)), ((0,), (0,)))),
], ids=["x@w", "batched"])
@pytest.mark.slow
def test_mxfp8_equals_jax_scaled_dot_general(scaled_dot_general, lhs_shape, rhs_shape, dims):
    reference, jax_quantize = scaled_dot_general
    x, w = normal(24, lhs_shape), normal(25, rhs_shape, 0.1)
    ours = lambda x, w: fr.fp8_dot_general(x, w, dims, recipe="mxfp8", compute_dtype=jnp.float32)
    got = jax.jit(functools.partial(_value_and_grads, ours))
    want = jax.jit(functools.partial(_value_and_grads, lambda x, w: reference(x, w, dims)))
    ct = normal(26, jax.eval_shape(ours, x, w).shape)
    for a, b in zip(got(x, w, ct), want(x, w, ct)):
        # The same FP8 values and scales: only float32 summation order differs.
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(b))))
    if jax_quantize is not None:  # and the quantization itself, bitwise
        config = jax.nn.get_scaled_dot_general_config("mxfp8")
        q_jax, s_jax = jax_quantize(x.reshape(1, -1, x.shape[-1]), config)
        q, s = fq.quantize_mxfp8(x.reshape(1, -1, x.shape[-1]))
        assert jnp.array_equal(lax.bitcast_convert_type(q, jnp.uint8), lax.bitcast_convert_type(q_jax, jnp.uint8))
        assert jnp.array_equal(s, s_jax.astype(jnp.float32))


@pytest.mark.slow
def test_mxfp8_runs_through_jax_scaled_dot_general_where_it_runs(scaled_dot_general, monkeypatch):
    """On a Blackwell GPU (forced here by JAXAMP_MXFP8_KERNEL=jax, with the CPU lowering of the fixture) the mxfp8
    recipe calls `jax.nn.scaled_dot_general`: the same values and gradients as its numerics path, cotangents in the
    operands' dtypes, and the audit counts its block-scaled GEMMs as FP8 with their FLOPs."""
    from jaxamp.audit import audit_jaxpr

    assert not fr.mx_kernel()  # auto: not on a CPU
    x, w = normal(33, (64, 96)), normal(34, (96, 64), 0.1)
    ours = lambda x, w: fr.fp8_dot_general(x, w, MATMUL, recipe="mxfp8", compute_dtype=jnp.float32)
    ct = normal(35, (64, 64))
    numerics = jax.jit(functools.partial(_value_and_grads, ours))(x, w, ct)
    monkeypatch.setenv(fr.MX_KERNEL_ENV, "jax")
    assert fr.mx_kernel()
    kernel = jax.jit(functools.partial(_value_and_grads, ours))(x, w, ct)
    for a, b in zip(kernel, numerics):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(b))))
    closed = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(ours(x, w) * ct), argnums=(0, 1)))(x, w)
    report = audit_jaxpr(closed, policy="mxfp8", compute_dtype=jnp.bfloat16)
    assert [(r["primitive"], r["lhs"], r["rhs"], r["flops"]) for r in report.rows] == [
        ("scaled_matmul_wrapper", "float8_e4m3fn", "float8_e4m3fn", 2 * 64 * 64 * 96)] * 3
    assert report.fp8_fraction == 1.0 and [r["pass"] for r in report.rows] == ["forward", "backward", "backward"]
    monkeypatch.setenv(fr.MX_KERNEL_ENV, "cudnn")
    with pytest.raises(ValueError, match="JAXAMP_MXFP8_KERNEL='cudnn': use 'jax'"):
        ours(x, w)


# --- bad input ---

def test_bad_input_gives_one_clear_error():
    x, w = normal(27, (32, 64)), normal(28, (64, 32))
    with pytest.raises(ValueError,
                       match=r"unknown FP8 recipe 'delayed'; known recipes: block, current, current-pow2, mxfp8"):
        fr.fp8_dot_general(x, w, MATMUL, recipe="delayed")
    with pytest.raises(ValueError, match="known recipes: block, current, current-pow2, mxfp8"):
        fr.recipe_dot_general("tensorwise")
    with pytest.raises(TypeError, match="floating-point operands; rhs is int32"):
        fr.fp8_dot_general(x, jnp.ones((64, 32), jnp.int32), MATMUL)
    with pytest.raises(TypeError):  # lax.dot_general's own check: contraction sizes 64 and 63
        fr.fp8_dot_general(x, normal(29, (63, 32)), MATMUL)
    with pytest.raises(ValueError, match="mxfp8 .* multiple of 32, got 48"):
        fr.fp8_dot_general(normal(30, (32, 48)), normal(31, (48, 32)), MATMUL, recipe="mxfp8")
    with pytest.raises(ValueError, match="non-contracting size .* multiple of 32, got 40"):
        jax.grad(lambda x: jnp.sum(fr.fp8_dot_general(x, w, MATMUL, recipe="mxfp8").astype(jnp.float32)))(
            normal(32, (40, 64)))
    forward = functools.partial(fr.fp8_dot_general, dimension_numbers=MATMUL, recipe="mxfp8")
    assert jax.eval_shape(forward, normal(32, (40, 64)), w).shape == (40, 32)  # the forward alone needs only k
    with pytest.raises(ValueError, match="power_of_2=False"):
        fr.recipe_dot_general("mxfp8", power_of_2=False)
    with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2"):
        fq.quantize_current(x, jnp.bfloat16)
