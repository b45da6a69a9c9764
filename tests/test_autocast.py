"""jaxamp.autocast: op classes, transforms, control flow, custom derivatives, models, disabled regions, reference mode.

Each test compares against values computed independently: a hand-cast version of the same function (written out with
`.astype`), the float32 function, or the dtypes in the rewritten jaxpr.
"""

import functools
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.extend import core as jex_core
from jax.extend import source_info_util
from jax.interpreters import mlir

from jaxamp.autocasting import AutocastError, autocast, disabled, float32_reference
from jaxamp.layers import attend

BF, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
HALF = [pytest.param(BF, id="bf16"), pytest.param(F16, id="fp16")]
REPO = Path(__file__).resolve().parents[1]


def normal(seed, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape, F32)


def all_eqns(jaxpr):
    """Every equation of a (closed) jaxpr, recursing into the jaxprs in params (jit, scan, cond, custom_*, ...)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if isinstance(sub, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
                    yield from all_eqns(sub)


def prim_dtypes(jaxpr, name):
    """[(input dtypes, output dtypes)] of every `name` equation."""
    return [([str(v.aval.dtype) for v in e.invars], [str(v.aval.dtype) for v in e.outvars])
            for e in all_eqns(jaxpr) if e.primitive.name == name]


def dot_operand_dtypes(jaxpr):
    return {tuple(ins) for ins, _ in prim_dtypes(jaxpr, "dot_general")}


def jit_split(make, *filters):
    """nnx.split of the module `make()` builds, initialised under jit (eager init dispatches op by op: slow)."""
    graphdef = nnx.split(nnx.eval_shape(make), *filters)[0]
    return (graphdef, *jax.jit(lambda: nnx.split(make(), *filters)[1:])())


def steps(fn, arg_sets, argnums=0, static_argnums=()):
    """jit(value_and_grad(autocast(fn, bf16))) over several argument sets: asserts one trace; returns the outputs."""
    traces = []

    def counted(*args):
        traces.append(1)
        return fn(*args)

    step = jax.jit(jax.value_and_grad(autocast(counted, BF), argnums), static_argnums=static_argnums)
    outs = [step(*args) for args in arg_sets]
    assert len(traces) == 1 and len({float(value) for value, _ in outs}) == len(arg_sets)
    return outs


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def tree_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype, (x.dtype, y.dtype)
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


# ------------------------------------------------------------------------------------------------------- op classes


@pytest.mark.slow
@pytest.mark.parametrize("dt", HALF)
def test_matmul_class_operands_and_results_in_half(dt):
    x, w = normal(0, (4, 8)), normal(1, (8, 6))
    img, ker = normal(2, (1, 2, 5, 5)), normal(3, (3, 2, 3, 3))

    def f(x, w, img, ker):
        return (x @ w, jnp.einsum("ij,jk->ik", x, w), lax.dot_general(x, w, (((1,), (0,)), ((), ()))),
                lax.conv_general_dilated(img, ker, (1, 1), "SAME"))

    def hand(x, w, img, ker):
        return x.astype(dt) @ w.astype(dt), lax.conv_general_dilated(img.astype(dt), ker.astype(dt), (1, 1), "SAME")

    outs = jax.jit(autocast(f, dt))(x, w, img, ker)
    assert [o.dtype for o in outs] == [dt] * 4
    jaxpr = jax.make_jaxpr(autocast(f, dt))(x, w, img, ker)
    name = jnp.dtype(dt).name
    assert prim_dtypes(jaxpr, "dot_general") == [([name, name], [name])] * 3
    assert prim_dtypes(jaxpr, "conv_general_dilated") == [([name, name], [name])]
    tree_equal([outs[0], outs[3]], jax.jit(hand)(x, w, img, ker))


@pytest.mark.parametrize("dt", HALF)
def test_float32_class_upcasts_half_inputs(dt):
    x, w = normal(0, (4, 8), 0.3), normal(1, (8, 6), 0.3)

    def f(x, w):
        h = x @ w  # half
        a = jnp.abs(h) + 1.0
        return (jnp.exp(h), jnp.log(a), jnp.sqrt(a), lax.rsqrt(a), h.sum(), jnp.cumsum(h, 1), a ** 1.5,
                jnp.reciprocal(a), jax.nn.softmax(h), jnp.mean(h), jnp.var(h))

    outs = jax.jit(autocast(f, dt))(x, w)
    assert [o.dtype for o in outs] == [F32] * len(outs)
    jaxpr = jax.make_jaxpr(autocast(f, dt))(x, w)
    for name in ("exp", "log", "sqrt", "rsqrt", "reduce_sum", "cumsum", "pow"):
        seen = prim_dtypes(jaxpr, name)
        assert seen and all(ins[0] == "float32" and outs_ == ["float32"] for ins, outs_ in seen), (name, seen)
    def hand(x, w):
        h = x.astype(dt) @ w.astype(dt)
        m = lax.stop_gradient(jnp.max(h, 1, keepdims=True))  # softmax's max: widest class, exact in `dt`
        e = jnp.exp(h.astype(F32) - m.astype(F32))  # its shift: only the exp reads it, so float32 (torch's upcast)
        return jnp.exp(h.astype(F32)), jnp.sum(h.astype(F32)), e / jnp.sum(e, 1, keepdims=True)

    exp, total, softmax = jax.jit(hand)(x, w)
    np.testing.assert_array_equal(outs[0], exp)
    np.testing.assert_array_equal(outs[4], total)
    np.testing.assert_array_equal(outs[8], softmax)


@pytest.mark.parametrize("dt", HALF)
def test_a_softmax_shifts_its_half_scores_in_float32_as_torch_amp_upcasts_its_input(dt):
    """softmax's and log_softmax's `x - max(x)` is read only by their exp (and log_softmax's `- log(sum)`, float32
    anyway), so it runs in float32: autocast's softmax of half-precision scores is the float32 softmax of those
    scores (torch.amp's), where the shift rounded to `dt` first (bf16: L1 error per row 6.4e-3 against 4.1e-3 at
    unit-scale scores). A shift that is also returned keeps `dt` (nothing float32 is added to what it writes)."""
    q, k = normal(0, (64, 32), 1 / 8), normal(1, (48, 32))

    def f(q, k):
        s = q @ k.T  # f32[64, 48] in dt
        shifted = s - 1.0
        return jax.nn.softmax(s), jax.nn.log_softmax(s), jnp.exp(shifted), shifted, s

    soft, log_soft, e, shifted, s = autocast(f, dt)(q, k)  # op by op: jit lets XLA skip the scores' rounding
    assert s.dtype == jnp.dtype(dt)
    s = s.astype(F32)  # the scores as autocast rounded them
    np.testing.assert_allclose(soft, jax.nn.softmax(s), rtol=2e-7, atol=1e-8)
    np.testing.assert_allclose(log_soft, jax.nn.log_softmax(s), rtol=2e-7, atol=1e-6)
    assert (e.dtype, shifted.dtype) == (F32, jnp.dtype(dt))  # the returned shift: widest class, as written
    np.testing.assert_array_equal(e, jnp.exp(shifted.astype(F32)))
    jaxpr = jax.make_jaxpr(autocast(lambda q, k: jax.nn.softmax(q @ k.T), dt))(q, k)
    assert prim_dtypes(jaxpr, "sub") == [(["float32", "float32"], ["float32"])], prim_dtypes(jaxpr, "sub")
    exact = jax.nn.softmax(q @ k.T)
    assert float(jnp.max(jnp.sum(jnp.abs(soft - exact), -1))) <= \
        1.01 * float(jnp.max(jnp.sum(jnp.abs(jax.nn.softmax(s) - exact), -1)))


def test_squares_and_integer_powers_are_float32_class_so_a_variance_above_256_is_finite():
    """torch.amp's `pow` is float32 class: x ** 2 of float16 values above 256 would overflow (65504)."""
    x, w = normal(0, (16, 8)), normal(1, (8, 8))

    def f(x, w):
        h = (x * 300.0) @ w  # f16 matmul, |h| up to ~1e4
        return jnp.mean(jnp.square(h - jnp.mean(h, 0)), 0), h ** 2, h ** 3, h ** 1, jnp.var(h, 0)

    outs = jax.jit(autocast(f, F16))(x, w)
    assert [str(o.dtype) for o in outs] == ["float32", "float32", "float32", "float16", "float32"]
    jaxpr = jax.make_jaxpr(autocast(f, F16))(x, w)
    assert prim_dtypes(jaxpr, "square") and all(ins == ["float32"] for ins, _ in prim_dtypes(jaxpr, "square"))
    pows = {tuple(ins) for ins, _ in prim_dtypes(jaxpr, "integer_pow")}
    assert ("float32",) in pows
    want = jnp.var(((x * 300.0).astype(F16) @ w.astype(F16)).astype(F32), 0)
    assert np.isfinite(np.asarray(outs[0])).all() and float(jnp.max(want)) > 65504.0
    np.testing.assert_allclose(outs[0], want, rtol=1e-5)
    np.testing.assert_allclose(outs[4], want, rtol=1e-5)


@pytest.mark.parametrize("dt", HALF)
def test_widest_class_promotes_to_the_widest_input(dt):
    x, w, b = normal(0, (4, 8)), normal(1, (8, 6)), normal(2, (6,))
    table, ids = normal(3, (10, 6)), jnp.array([1, 3, 3, 0])

    def f(x, w, b, table, ids):
        h = x @ w  # half
        return (h + b, jnp.tanh(h), h * 0.5, jnp.maximum(h, 0.0), jnp.concatenate([h, table[:4]]), h[ids],
                table[ids], jnp.where(h > 0, h, -1e9), h > 0.1)

    outs = jax.jit(autocast(f, dt))(x, w, b, table, ids)
    h_dt = "float32" if dt == F16 else jnp.dtype(dt).name  # -1e9 overflows float16: that select stays float32
    assert [str(o.dtype) for o in outs] == ["float32", jnp.dtype(dt).name, jnp.dtype(dt).name, jnp.dtype(dt).name,
                                            "float32", jnp.dtype(dt).name, "float32", h_dt, "bool"]
    adds = prim_dtypes(jax.make_jaxpr(autocast(f, dt))(x, w, b, table, ids), "add")
    assert [a for a in adds if a[1] != ["int32"]] == [(["float32", "float32"], ["float32"])]  # bf16 + f32 bias
    def hand(x, w, b):
        h = x.astype(dt) @ w.astype(dt)
        return h.astype(F32) + b, jnp.tanh(h)

    tree_equal(outs[:2], jax.jit(hand)(x, w, b))
    assert not np.isinf(np.asarray(outs[7], np.float32)).any()


@pytest.mark.parametrize("dt", HALF)
def test_every_dot_general_of_the_backward_is_half(dt):
    params = {"w1": normal(0, (8, 16), 0.3), "b1": normal(1, (16,)), "w2": normal(2, (16, 4), 0.3)}
    x = normal(3, (5, 8))

    def loss(p, x):
        h = jax.nn.gelu(x @ p["w1"] + p["b1"])
        return jnp.mean(jax.nn.log_softmax(h @ p["w2"]))

    jaxpr = jax.make_jaxpr(jax.grad(autocast(loss, dt)))(params, x)
    name = jnp.dtype(dt).name
    assert len(prim_dtypes(jaxpr, "dot_general")) == 5  # 2 forward, 3 backward (no gradient for x)
    assert dot_operand_dtypes(jaxpr) == {(name, name)}
    plain = jax.make_jaxpr(jax.grad(loss))(params, x)
    assert dot_operand_dtypes(plain) == {("float32", "float32")}  # the test can fail


def test_explicit_casts_and_preferred_element_type_are_kept():
    x, w = normal(0, (4, 8)), normal(1, (8, 6))
    xi, wi = jnp.ones((4, 8), jnp.int8), jnp.ones((8, 6), jnp.int8)

    def f(x, w, xi, wi):
        mixed = jnp.dot(x.astype(BF), w.astype(BF), preferred_element_type=F32)  # explicit: float32 result
        explicit_f16 = (x @ w).astype(F16)
        ints = jnp.dot(xi, wi, preferred_element_type=jnp.int32)
        return mixed, explicit_f16, (x * 10.0).astype(jnp.int32), ints

    mixed, f16, i32, ints = jax.jit(autocast(f, BF))(x, w, xi, wi)
    assert (mixed.dtype, f16.dtype, i32.dtype, ints.dtype) == (F32, F16, jnp.int32, jnp.int32)
    hand = jax.jit(lambda x, w: ((x.astype(BF) @ w.astype(BF)).astype(F16), (x * 10.0).astype(jnp.int32)))
    tree_equal((f16, i32), hand(x, w))
    np.testing.assert_array_equal(ints, np.full((4, 6), 8))
    dots = prim_dtypes(jax.make_jaxpr(autocast(f, BF))(x, w, xi, wi), "dot_general")
    assert dots == [(["bfloat16", "bfloat16"], ["float32"]), (["bfloat16", "bfloat16"], ["bfloat16"]),
                    (["int8", "int8"], ["int32"])]


@pytest.mark.parametrize("dt", HALF)
def test_the_output_head_writes_float32_logits_and_its_backward_runs_in_half(dt):
    """A matmul named as the output head (`FLOAT32_RESULTS`: a `head` scope, an `lm_head` param, `Embed.attend`)
    keeps half-precision operands but writes float32 logits; its output gradient is rounded to `dt` once, so its
    backward matmuls stay half: the cast policies' `jaxamp.layers.attend`, value and gradients bitwise."""
    params = {"w": normal(0, (8, 16), 0.3), "table": normal(1, (50, 16), 0.3)}
    x = normal(2, (6, 8))

    def logits_fn(p, x):
        h = jnp.tanh(x @ p["w"])
        with jax.named_scope("head"):
            return jnp.einsum("td,vd->tv", h, p["table"])

    def hand(p, x):
        h = jnp.tanh(x.astype(dt) @ p["w"].astype(dt))
        return attend(h, p["table"].astype(dt))  # forward f32[t, v]; backward: logit gradient rounded to dt once

    def loss(fn):
        return lambda p, x: jnp.mean(jax.nn.log_softmax(fn(p, x)) * jnp.arange(50.0) / 50.0)

    assert autocast(logits_fn, dt)(params, x).dtype == F32
    tree_equal(autocast(logits_fn, dt)(params, x), hand(params, x))
    # Op by op (no jit): XLA:CPU's excess precision would drop a bf16 rounding between fused ops on either side.
    tree_equal(jax.grad(autocast(loss(logits_fn), dt))(params, x), jax.grad(loss(hand))(params, x))
    name = jnp.dtype(dt).name
    dots = prim_dtypes(jax.make_jaxpr(jax.grad(autocast(loss(logits_fn), dt)))(params, x), "dot_general")
    assert sorted(dots) == sorted([([name, name], [name]), ([name, name], ["float32"]),  # forward: up, head
                                   ([name, name], [name]), ([name, name], [name]),  # head backward (no forward)
                                   ([name, name], [name])])  # up's backward (no gradient for x)
    torch_rule = prim_dtypes(jax.make_jaxpr(autocast(logits_fn, dt, float32_results=()))(params, x), "dot_general")
    assert torch_rule == [([name, name], [name])] * 2  # float32_results=(): torch.amp's rule, half logits


def test_float32_results_patterns_choose_the_matmuls_and_a_bad_one_is_one_clear_error():
    params = {"w": normal(0, (8, 16)), "proj": normal(1, (16, 4))}

    def f(p, x):
        return (x @ p["w"]) @ p["proj"]  # the param path names each matmul (`proj`, `w`)

    x = normal(2, (3, 8))
    assert [o for _, (o,) in prim_dtypes(jax.make_jaxpr(autocast(f, BF))(params, x), "dot_general")] == \
        ["bfloat16", "bfloat16"]  # neither is a head
    picked = jax.make_jaxpr(autocast(f, BF, float32_results=r"(^|\.)proj$"))(params, x)
    assert [o for _, (o,) in prim_dtypes(picked, "dot_general")] == ["bfloat16", "float32"]
    with pytest.raises(ValueError, match="float32_results must be regular expressions"):
        autocast(f, BF, float32_results=["(unclosed"])
    linear = autocast(lambda p, x: jnp.sum(jnp.tanh(x @ p["proj"])), BF, float32_results=["proj"])  # on the raw input
    grad_dots = prim_dtypes(jax.make_jaxpr(jax.grad(linear))({"proj": normal(3, (8, 4))}, x), "dot_general")
    assert grad_dots == [(["bfloat16", "bfloat16"], ["float32"]), (["bfloat16", "bfloat16"], ["bfloat16"])]  # no dx


def _float32_only_primitive():
    prim = jex_core.Primitive("jaxamp_test_float32_only")

    def abstract_eval(x):
        if x.dtype != F32:
            raise TypeError(f"jaxamp_test_float32_only needs float32, got {x.dtype}")
        return jax.core.ShapedArray(x.shape, x.dtype)

    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: x * 2, multiple_results=False))
    return prim


def test_unknown_primitives_run_at_their_original_dtypes():
    prim = _float32_only_primitive()
    x, w = normal(0, (4, 4)), normal(1, (4, 4))

    def f(x, w):
        h = x @ w  # bf16 under autocast
        return prim.bind(h), jnp.linalg.inv(h @ h.T + 4 * jnp.eye(4)), jnp.fft.fft(h).real

    def hand(x, w):
        h = x.astype(BF) @ w.astype(BF)
        return (2 * h.astype(F32), jnp.linalg.inv((h @ h.T).astype(F32) + 4 * jnp.eye(4)),
                jnp.fft.fft(h.astype(jnp.complex64)).real)  # (h.astype(F32) can differ: excess precision)

    outs = jax.jit(autocast(f, BF))(x, w)  # the primitive's abstract eval raises if it sees bfloat16
    assert [o.dtype for o in outs] == [F32] * 3
    tree_equal(outs, jax.jit(hand)(x, w))
    jaxpr = jax.make_jaxpr(autocast(f, BF))(x, w)
    assert prim_dtypes(jaxpr, "jaxamp_test_float32_only") == [(["float32"], ["float32"])]
    assert prim_dtypes(jaxpr, "fft")[0][0] == ["complex64"]


def test_unhandled_rewrite_raises_naming_the_primitive(monkeypatch):
    from jaxamp import autocast_rules

    prim = _float32_only_primitive()  # a float32-only primitive wrongly listed in the widest class
    monkeypatch.setitem(autocast_rules.FIRST_ORDER_RULES, prim.name, autocast_rules.widest_rule)
    message = r"'jaxamp_test_float32_only' \(.*test_autocast.py:\d+.*on \(bfloat16.*disabled"
    with pytest.raises(AutocastError, match=message):
        jax.make_jaxpr(autocast(lambda x, w: prim.bind(x @ w), BF))(normal(0, (2, 2)), normal(1, (2, 2)))


def test_the_docstring_table_lists_each_class_exactly():
    from jaxamp import autocast_rules as rules

    module = sys.modules["jaxamp.autocasting"]
    rows = {line.split("|")[1].strip(): set(re.findall(r"`([\w-]+)`", line.split("|")[2]))
            for line in module.__doc__.splitlines() if line.startswith("| ") and not line.startswith("| class")}
    assert rows["matmul"] == rules.MATMUL_OPS
    assert rows["float32"] == rules.FLOAT32_OPS | {"integer_pow"}  # with a negative exponent
    assert rows["widest"] == rules.WIDEST_OPS
    assert rows["passthrough"] == rules.PASSTHROUGH_OPS
    assert set(rules.FIRST_ORDER_RULES) == (rules.MATMUL_OPS | rules.FLOAT32_OPS | rules.WIDEST_OPS
                                           | rules.PASSTHROUGH_OPS | {"convert_element_type"})


# ------------------------------------------------------------------------------------- transforms vs hand-cast code


def mlp_params():
    return {"w1": normal(0, (8, 16), 0.3), "b1": normal(1, (16,), 0.1), "w2": normal(2, (16, 4), 0.3)}


def mlp_loss(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"]) ** 2)


def mlp_loss_hand(p, x, dt):
    h = jnp.tanh((x.astype(dt) @ p["w1"].astype(dt)).astype(F32) + p["b1"])
    y = h.astype(dt) @ p["w2"].astype(dt)
    return jnp.mean(y.astype(F32) ** 2)  # a square is float32 class (torch.amp's pow)


@pytest.mark.parametrize("dt", HALF)
def test_jit_grad_vmap_match_hand_cast_bitwise(dt):
    p, x = mlp_params(), normal(3, (6, 8))

    def transforms(loss):  # one compile: value, value_and_grad, vmap, vmap of grad
        return jax.jit(lambda p, x: (loss(p, x), jax.value_and_grad(loss)(p, x), jax.vmap(loss, (None, 0))(p, x),
                                     jax.vmap(jax.grad(loss), (None, 0))(p, x)))(p, x)

    auto = transforms(autocast(mlp_loss, dt))
    tree_equal(auto, transforms(functools.partial(mlp_loss_hand, dt=dt)))
    assert rel_err(auto[1][1]["w1"], jax.jit(jax.grad(mlp_loss))(p, x)["w1"]) > 1e-4  # not float32: can fail


def test_grad_of_a_closed_over_outer_tracer():
    p, x = mlp_params(), normal(3, (6, 8))
    g = jax.jit(jax.grad(lambda p: autocast(lambda x: mlp_loss(p, x), BF)(x)))(p)
    tree_equal(g, jax.jit(jax.grad(lambda p: mlp_loss_hand(p, x, BF)))(p))


def test_static_arguments_are_closed_over():
    x, w = normal(0, (3, 4)), normal(1, (4, 4))

    def f(x, w, *, mode, scale, flag, missing):
        assert isinstance(mode, str) and isinstance(scale, float) and flag is True and missing is None
        return jnp.tanh(x @ w) * scale if mode == "tanh" else x @ w

    out = jax.jit(lambda x, w: autocast(f, "bfloat16")(x, w, mode="tanh", scale=2.0, flag=True, missing=None))(x, w)
    np.testing.assert_array_equal(out, jnp.tanh(x.astype(BF) @ w.astype(BF)) * 2.0)


def test_one_trace_over_many_jitted_steps():
    traces = []

    def loss(p, x):
        traces.append(1)
        return mlp_loss(p, x)

    @jax.jit
    def step(p, x):
        loss_value, g = jax.value_and_grad(autocast(loss, BF))(p, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss_value

    p = mlp_params()
    losses = []
    for i in range(6):
        p, loss_value = step(p, normal(10 + i, (6, 8)))
        losses.append(float(loss_value))
    assert len(traces) == 1 and len(set(losses)) == 6


@pytest.mark.slow
def test_lax_scan_keeps_carries_in_their_dtype_and_matches_hand_cast():
    w, xs = normal(0, (8, 8), 0.4), normal(1, (5, 3, 8))

    def f(w, xs):
        def body(c, x):
            c = jnp.tanh(c @ w + x)
            return c, c @ w  # carry float32 (tanh of f32), stacked output bf16
        c, ys = lax.scan(body, jnp.zeros((3, 8)), xs)
        return jnp.sum(c) + jnp.sum(ys)

    def hand(w, xs):
        def body(c, x):
            c = jnp.tanh((c.astype(BF) @ w.astype(BF)).astype(F32) + x)
            return c, c.astype(BF) @ w.astype(BF)
        c, ys = lax.scan(body, jnp.zeros((3, 8)), xs)
        return jnp.sum(c) + jnp.sum(ys.astype(F32))

    auto = steps(f, [(w, xs), (w, 2 * xs), (w, -xs)])
    tree_equal(auto[0], jax.jit(jax.value_and_grad(hand))(w, xs))
    scan = next(e for e in all_eqns(jax.make_jaxpr(autocast(f, BF))(w, xs)) if e.primitive.name == "scan")
    assert [str(v.aval.dtype) for v in scan.outvars] == ["float32", "bfloat16"]


def test_scan_carry_from_a_half_op_is_cast_back():
    w, x0 = normal(0, (8, 8), 0.4), normal(1, (2, 8))

    def f(w, x0):
        return lax.scan(lambda c, _: (c @ w, None), x0, None, length=3)[0]  # body's carry would be bf16

    def hand(w, x0):
        return lax.scan(lambda c, _: ((c.astype(BF) @ w.astype(BF)).astype(F32), None), x0, None, length=3)[0]

    out = jax.jit(autocast(f, BF))(w, x0)
    assert out.dtype == F32
    tree_equal(out, jax.jit(hand)(w, x0))


def test_while_loop_keeps_carries_and_matches_hand_cast():
    w, x = normal(0, (8, 8), 0.4), normal(1, (3, 8))

    def f(w, x):
        def body(carry):
            i, h = carry
            return i + 1, h @ w  # bf16: cast back to the float32 carry
        return lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

    def hand(w, x):
        def body(carry):
            i, h = carry
            return i + 1, (h.astype(BF) @ w.astype(BF)).astype(F32)
        return lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

    out = jax.jit(autocast(f, BF))(w, x)
    assert out.dtype == F32
    tree_equal(out, jax.jit(hand)(w, x))
    tree_equal(jax.jit(jax.vmap(autocast(f, BF), (None, 0)))(w, x), jax.jit(jax.vmap(hand, (None, 0)))(w, x))


def test_cond_and_remat_match_hand_cast():
    w, x = normal(0, (8, 8), 0.4), normal(1, (3, 8))
    policy = jax.checkpoint_policies.dots_saveable

    def f(w, x):
        h = lax.cond(x.sum() > 0, lambda h: h @ w, lambda h: h * 2.0, x)  # bf16 branch, f32 branch: f32
        return jax.checkpoint(lambda h: jnp.sum(jnp.sin(h @ w) @ w), policy=policy)(h)

    def hand(w, x):
        mm = lambda a: a.astype(BF) @ w.astype(BF)
        h = lax.cond(x.sum() > 0, lambda h: mm(h).astype(F32), lambda h: h * 2.0, x)
        return jax.checkpoint(lambda h: jnp.sum(mm(jnp.sin(mm(h))).astype(F32)), policy=policy)(h)

    auto = steps(f, [(w, x), (w, -x), (w, 2 * x)])  # both branches
    hand_step = jax.jit(jax.value_and_grad(hand))
    tree_equal(auto[:2], [hand_step(w, x), hand_step(w, -x)])
    cond = next(e for e in all_eqns(jax.make_jaxpr(autocast(f, BF))(w, x)) if e.primitive.name == "cond")
    assert [str(v.aval.dtype) for v in cond.outvars] == ["float32"]
    jaxpr = jax.make_jaxpr(jax.grad(autocast(f, BF)))(w, x)
    remat = [e for e in all_eqns(jaxpr) if e.primitive.name == "remat2"]
    assert remat and remat[0].params["policy"] is policy
    assert dot_operand_dtypes(jaxpr) == {("bfloat16", "bfloat16")}


def test_nested_jit_and_custom_jvp_rule_sees_the_original_dtypes():
    seen = []

    @jax.custom_jvp
    def scaled_relu(h):
        return jnp.maximum(h, 0.0) * 2.0

    @scaled_relu.defjvp
    def _(primals, tangents):
        (h,), (t,) = primals, tangents
        seen.append((h.dtype, t.dtype))
        return scaled_relu(h), jnp.where(h > 0, 2.0 * t, 0.0)

    w, x = normal(0, (8, 8)), normal(1, (3, 8))
    f = lambda w, x: jnp.sum(jax.jit(lambda a: scaled_relu(a @ w))(x))  # bf16 into the custom_jvp
    hand = lambda w, x: jnp.sum(scaled_relu(x.astype(BF) @ w.astype(BF)).astype(F32))
    value, g = jax.jit(jax.value_and_grad(autocast(f, BF)))(w, x)
    assert set(seen) == {(jnp.dtype(F32),) * 2}  # the rule ran on the original float32 primals and tangents
    assert value.dtype == F32 and value == jax.jit(hand)(w, x)  # primal: bf16 max/mul, as hand-cast
    seen.clear()
    hand_f32_rule = lambda w, x: jnp.sum(scaled_relu((x.astype(BF) @ w.astype(BF)).astype(F32)))
    g_hand = jax.jit(jax.grad(hand_f32_rule))(w, x)
    assert seen == [(jnp.dtype(F32),) * 2]
    tree_equal(g, g_hand)  # tangent from the float32 rule, cast to bf16 into the backward matmul
    per_row = jax.jit(jax.vmap(jax.grad(autocast(f, BF), 1), (None, 0)))(w, x[:, None])  # vmap of the custom_jvp
    hand_rows = jax.jit(jax.vmap(jax.grad(hand_f32_rule, 1), (None, 0)))(w, x[:, None])
    tree_equal(per_row, hand_rows)


def test_custom_vjp_runs_opaque_at_its_original_dtypes():
    seen = []

    @jax.custom_vjp
    def clip_grad(h):
        return jnp.sin(h)

    def fwd(h):
        seen.append(h.dtype)
        return jnp.sin(h), jnp.cos(h)

    def bwd(cos_h, g):
        seen.append(g.dtype)
        return (jnp.clip(g * cos_h, -0.5, 0.5),)

    clip_grad.defvjp(fwd, bwd)
    w, x = normal(0, (8, 8)), normal(1, (3, 8))
    f = lambda w, x: jnp.sum(clip_grad(x @ w))
    hand = lambda w, x: jnp.sum(clip_grad((x.astype(BF) @ w.astype(BF)).astype(F32)))
    tree_equal(steps(f, [(w, x), (w, 2 * x)])[0], jax.jit(jax.value_and_grad(hand))(w, x))
    assert set(seen) == {jnp.dtype(F32)}


# --------------------------------------------------------------------------------------------------- Flax scans


class ScanCell(nn.Module):
    hand_cast: bool = False

    @nn.compact
    def __call__(self, h, x):
        kernel = self.param("kernel", nn.initializers.normal(0.3), (8, 8))
        bias = self.param("bias", nn.initializers.zeros, (8,))
        y = (h.astype(BF) @ kernel.astype(BF)).astype(F32) if self.hand_cast else h @ kernel
        h = jnp.tanh(y + bias + x)
        return h, h


class ScanModel(nn.Module):
    hand_cast: bool = False

    @nn.compact
    def __call__(self, xs):
        cell = nn.scan(nn.remat(ScanCell), variable_broadcast="params", split_rngs={"params": False}, in_axes=1,
                       out_axes=1)(hand_cast=self.hand_cast)
        h, ys = cell(jnp.zeros((xs.shape[0], 8)), xs)
        return jnp.mean(ys ** 2) + jnp.mean(h)


@pytest.mark.slow
def test_linen_scan_and_remat_match_hand_cast():
    xs = normal(0, (2, 4, 8))
    params = jax.jit(ScanModel().init)(jax.random.key(1), xs)
    loss = lambda p, xs: ScanModel().apply(p, xs)
    hand = lambda p, xs: ScanModel(hand_cast=True).apply(p, xs)
    auto = steps(loss, [(params, xs), (params, xs + 1.0), (params, -xs)])
    tree_equal(auto[0], jax.jit(jax.value_and_grad(hand))(params, xs))
    jaxpr = jax.make_jaxpr(jax.grad(autocast(loss, BF)))(params, xs)
    assert {"scan", "remat2"} <= {e.primitive.name for e in all_eqns(jaxpr)}
    assert dot_operand_dtypes(jaxpr) == {("bfloat16", "bfloat16")}


class NnxLayer(nnx.Module):
    def __init__(self, rngs, hand_cast=False):
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.hand_cast = hand_cast

    def __call__(self, h):
        if self.hand_cast:
            y = (h.astype(BF) @ self.lin.kernel[...].astype(BF)).astype(F32) + self.lin.bias[...]
        else:
            y = self.lin(h)
        return jnp.tanh(y)


def _nnx_stack(hand_cast):
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return NnxLayer(nnx.Rngs(key), hand_cast)

    return lambda: make(jax.random.split(jax.random.key(0), 3))


def nnx_scan_loss(graphdef, state, h):
    layers = nnx.merge(graphdef, state)

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def step(layer, h):
        return layer(h)

    return jnp.mean(step(layers, h) ** 2)


def test_nnx_scan_matches_hand_cast():
    gd, state = jit_split(_nnx_stack(False))
    gd_hand = nnx.split(nnx.eval_shape(_nnx_stack(True)))[0]  # the same state, hand-cast layers
    h = normal(1, (2, 8))
    got = steps(nnx_scan_loss, [(gd, state, h), (gd, state, 2 * h)], argnums=1, static_argnums=0)[0]
    want = jax.jit(jax.value_and_grad(nnx_scan_loss, 1), static_argnums=0)(gd_hand, state, h)
    tree_equal(got, want)
    assert got[0].dtype == F32


# ----------------------------------------------------------------------------------------------- lookups, biases


def test_lookup_and_bias_gradients_accumulate_in_float32():
    table, w, b = normal(0, (8, 16)), normal(1, (16, 16)), normal(2, (16,))
    ids = jnp.zeros(4096, jnp.int32)  # one row, looked up 4096 times in one batch
    c = jax.random.uniform(jax.random.key(3), (4096, 16), F32, 0.5, 1.5)  # positive output weights

    def loss(table, w, b, ids):
        return jnp.sum((table[ids] @ w + b) * c)

    def naive_bf16(table, w, b, ids):  # the table (and bias) cast first, then looked up: bf16 scatter-add
        return jnp.sum(((table.astype(BF)[ids] @ w.astype(BF) + b.astype(BF)) * c.astype(BF)).astype(F32))

    g32 = jax.jit(jax.grad(loss, (0, 2)))(table, w, b, ids)
    auto = jax.jit(jax.grad(autocast(loss, BF), (0, 2)))(table, w, b, ids)
    naive = jax.jit(jax.grad(naive_bf16, (0, 2)))(table, w, b, ids)
    assert rel_err(auto[0][0], g32[0][0]) < 0.01  # the row: float32 scatter-add of bf16-matmul cotangents
    assert rel_err(auto[1], g32[1]) < 1e-5  # the bias: a float32 add, so a float32 reduction
    assert rel_err(naive[0][0], g32[0][0]) > 0.5  # bf16 accumulation keeps ~1/16 of the row's gradient
    assert rel_err(naive[1], g32[1]) > 1e-3  # a bf16 bias gradient: rounded at least once (CPU sums in f32)
    jaxpr = jax.make_jaxpr(jax.grad(autocast(loss, BF), (0, 2)))(table, w, b, ids)
    assert prim_dtypes(jaxpr, "scatter-add") == [(["float32", "int32", "float32"], ["float32"])]


# ------------------------------------------------------------------------------------------------------- models


def check_model(loss, args, tol=0.05):
    """Under autocast every dot_general (forward and backward) is bf16, the loss float32 and near float32's."""
    auto = jax.jit(autocast(loss, BF))(*args)
    ref = jax.jit(loss)(*args)
    assert auto.dtype == F32 and auto.shape == ()
    assert abs(float(auto) - float(ref)) <= tol * abs(float(ref)), (float(auto), float(ref))
    assert auto != ref  # not float32: the test can fail
    jaxpr = jax.make_jaxpr(jax.grad(autocast(loss, BF)))(*args)
    assert dot_operand_dtypes(jaxpr) == {("bfloat16", "bfloat16")}
    assert len(prim_dtypes(jaxpr, "dot_general")) >= 3


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic=True):
        y = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1, deterministic=deterministic)(
            nn.LayerNorm()(x))
        x = x + y
        return x + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))


class LM(nn.Module):
    @nn.compact
    def __call__(self, ids, deterministic=True):
        x = nn.Embed(32, 16)(ids)
        x = Block()(x, deterministic)
        return nn.Dense(32)(nn.LayerNorm()(x))


@pytest.mark.slow
def test_linen_transformer_block_unchanged():
    ids = jax.random.randint(jax.random.key(0), (2, 6), 0, 32)
    params = jax.jit(LM().init)(jax.random.key(1), ids)

    def loss(params, ids, rng):  # training mode: attention dropout with a key argument
        logits = LM().apply(params, ids, deterministic=False, rngs={"dropout": rng})
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[..., None], -1))

    check_model(loss, (params, ids, jax.random.key(2)))


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.ln = nnx.LayerNorm(16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.ln(self.l1(x))))))


def test_nnx_model_unchanged():
    graphdef, params, rest = jit_split(lambda: NnxNet(nnx.Rngs(0, dropout=1)), nnx.Param, ...)
    x = normal(2, (6, 8))

    def forward(graphdef, state, x):  # BatchNorm (training mode) and Dropout update `state` inside the trace
        return nnx.merge(graphdef, state)(x)

    out = jax.eval_shape(autocast(forward, BF), graphdef, nnx.merge_state(params, rest), x)
    assert out.dtype == F32 and out.shape == (6, 4)  # (the last Linear's bias add is float32)

    def loss(params, rest, x):  # tree.map: fresh Variables at this trace level (grad passes `rest` through as is)
        return jnp.mean(forward(graphdef, nnx.merge_state(params, jax.tree.map(jnp.asarray, rest)), x) ** 2)

    check_model(loss, (params, rest, x))


def test_plain_jnp_mlp_unchanged():
    p, x = mlp_params(), normal(3, (6, 8))
    check_model(mlp_loss, (p, x))
    g, g32 = jax.jit(jax.grad(autocast(mlp_loss, BF)))(p, x), jax.jit(jax.grad(mlp_loss))(p, x)
    assert all(rel_err(g[k], g32[k]) < 0.05 for k in p) and g["w1"].dtype == F32


def test_equinox_mlp():
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(8, 2, 16, 2, key=jax.random.key(0))
    x = normal(1, (5, 8))

    def loss(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(autocast(loss, BF)))(mlp, x)
    value32, grads32 = eqx.filter_jit(eqx.filter_value_and_grad(loss))(mlp, x)
    assert value.dtype == F32 and abs(float(value) - float(value32)) < 0.05 * float(value32)
    assert rel_err(grads.layers[0].weight, grads32.layers[0].weight) < 0.05
    params, static = eqx.partition(mlp, eqx.is_array)
    by_parts = lambda p, x: loss(eqx.combine(p, static), x)
    jaxpr = jax.make_jaxpr(jax.grad(autocast(by_parts, BF)))(params, x)
    assert dot_operand_dtypes(jaxpr) == {("bfloat16", "bfloat16")}


# -------------------------------------------------------------------------------------------------- disabled()


@pytest.mark.parametrize("dtype", HALF)
def test_an_integer_operand_of_a_float_matmul_is_converted_with_it(dtype):
    """`int_batch @ w`: JAX passes i32 x f32 to one dot_general (no convert); the float32 code means a float32
    matmul, so autocast runs it in the compute dtype, both operands cast; integers on both sides stay integer."""
    w, ids = normal(0, (6, 4)), jnp.arange(24, dtype=jnp.int32).reshape(4, 6) % 3  # small ints: exact in half
    def user(w, b):
        with jax.numpy_dtype_promotion("standard"):  # (the user's code: strict promotion refuses i32 @ f32)
            return b @ w

    fn = autocast(user, dtype)
    dots = [e for e in all_eqns(jax.make_jaxpr(fn)(w, ids).jaxpr) if e.primitive.name == "dot_general"]
    assert [(str(e.invars[0].aval.dtype), str(e.invars[1].aval.dtype), str(e.outvars[0].aval.dtype))
            for e in dots] == [(jnp.dtype(dtype).name,) * 3]
    expected = (ids.astype(dtype) @ w.astype(dtype)).astype(dtype)  # the hand-cast version
    np.testing.assert_array_equal(np.asarray(fn(w, ids), np.float32), np.asarray(expected, np.float32))
    ints = autocast(lambda a, b: a @ b, dtype)(ids, ids.T)
    assert ints.dtype == jnp.int32 and jnp.array_equal(ints, ids @ ids.T)


def test_disabled_region_runs_float32():
    w, x = normal(0, (8, 8), 0.4), normal(1, (3, 8))

    @disabled()
    def decorated(h):
        return jnp.tanh(h @ w)

    def in_jit(h):
        with disabled():
            return jnp.sin(h @ w)

    def f(w, x):
        h = x @ w  # bf16
        with disabled():
            h = jnp.exp(h @ w) @ w  # float32: h is cast back to float32 first
        h = decorated(h)
        h = jax.jit(in_jit)(h)
        h = lax.scan(lambda c, _: (in_jit(c), None), h, None, length=2)[0]
        return jnp.sum(h @ w)

    def hand(w, x):
        h = (x.astype(BF) @ w.astype(BF)).astype(F32)
        h = jnp.exp(h @ w) @ w
        h = jnp.sin(jnp.sin(jnp.sin(jnp.tanh(h @ w) @ w) @ w) @ w)
        return jnp.sum((h.astype(BF) @ w.astype(BF)).astype(F32))

    jaxpr = jax.make_jaxpr(jax.grad(autocast(f, BF)))(w, x)
    dots = [ins for ins, _ in prim_dtypes(jaxpr, "dot_general")]
    assert dots.count(["float32", "float32"]) >= 6 and dots.count(["bfloat16", "bfloat16"]) >= 2
    assert prim_dtypes(jaxpr, "exp")[0][0] == ["float32"]
    np.testing.assert_allclose(jax.jit(autocast(f, BF))(w, x), jax.jit(hand)(w, x), rtol=1e-6)
    assert autocast.disabled is disabled  # jaxamp.autocast.disabled() also when jaxamp.autocast names the function


# ------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("dtype", [jnp.int32, "int32", jnp.float8_e4m3fn, jnp.float32, "float64", "fp8", None])
def test_bad_dtype_is_one_clear_error(dtype):
    with pytest.raises(ValueError, match="bfloat16.*float16"):
        autocast(mlp_loss, dtype)


@pytest.mark.parametrize("name, dtype", [("bf16", BF), ("bfloat16", BF), ("fp16", F16), ("float16", F16),
                                         (jnp.dtype(BF), BF), (F16, F16)])
def test_dtype_names(name, dtype):
    assert autocast(lambda x: x @ x, name)(jnp.ones((2, 2))).dtype == dtype


def test_non_callable_is_one_clear_error():
    with pytest.raises(ValueError, match="needs a function"):
        autocast(mlp_params(), BF)
    with pytest.raises(ValueError, match="needs a function"):
        float32_reference("model")


# ------------------------------------------------------------------------------------------- float32 reference


class HalfMLP(nn.Module):
    dtype: object = BF

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, dtype=self.dtype)(x))
        h = h * jnp.asarray(0.5, self.dtype) + jnp.arange(32, dtype=self.dtype) / 64
        return nn.Dense(4, dtype=self.dtype)(h)


def test_float32_reference_overrides_the_models_half_precision():
    x, labels = normal(0, (16, 8)), jnp.arange(16) % 4
    params = jax.jit(HalfMLP(F32).init)(jax.random.key(1), x)

    def loss_of(model):
        def loss(params, x):
            logits = model.apply(params, x).astype(F32)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))
        return loss

    g32 = jax.jit(jax.grad(loss_of(HalfMLP(F32))))(params, x)
    g_ref = jax.jit(jax.grad(float32_reference(loss_of(HalfMLP(BF)))))(params, x)
    g_plain = jax.jit(jax.grad(loss_of(HalfMLP(BF))))(params, x)
    assert jax.tree.structure(g_ref) == jax.tree.structure(g32) == jax.tree.structure(g_plain)
    for a, b, c in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g32), jax.tree.leaves(g_plain)):
        assert a.dtype == F32
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        assert rel_err(c, b) > 1e-3  # the plain bf16 model's gradient differs: the test can fail
    jaxpr = jax.make_jaxpr(jax.grad(float32_reference(loss_of(HalfMLP(BF)))))(params, x)
    assert all(v.aval.dtype not in (BF, F16) for e in all_eqns(jaxpr) for v in [*e.invars, *e.outvars]
               if hasattr(v.aval, "dtype"))
    dots = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(e.params["precision"] == (lax.Precision.HIGHEST,) * 2 for e in dots[:2])


def test_float32_reference_outputs_and_carries():
    x = normal(0, (3, 4))

    def f(x):
        h = x.astype(F16)
        c = lax.scan(lambda c, _: (c * jnp.float16(1.5), None), h, None, length=2)[0]
        return c, jnp.arange(3, dtype=BF), h @ h.T

    c, iota, mm = float32_reference(f)(x)
    assert (c.dtype, iota.dtype, mm.dtype) == (F32, F32, F32)
    np.testing.assert_allclose(c, x * 2.25, rtol=1e-6)
    np.testing.assert_allclose(mm, np.asarray(x, np.float64) @ np.asarray(x, np.float64).T, rtol=1e-5)


# ------------------------------------------------------------------------------------------- source information


def test_source_info_survives_a_later_trace():
    w, x = normal(0, (8, 8)), normal(1, (3, 8))

    def f(w, x):
        with jax.named_scope("block_a"):
            h = x @ w  # MATMUL LINE
        return jnp.sum(jax.jit(jnp.tanh)(h))

    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "# MATMUL LINE" in text)
    jaxpr = jax.make_jaxpr(jax.grad(autocast(f, BF)))(w, x)
    dots = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 2  # forward, and the gradient for w
    for eqn in dots:
        frame = source_info_util.summarize(eqn.source_info)
        assert frame.startswith(f"{__file__}:{line}:"), frame
        assert "block_a" in str(eqn.source_info.name_stack)
    casts = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]
    assert casts and all(f"{__file__}:{line}:" in source_info_util.summarize(e.source_info) for e in casts[:2])


# ---------------------------------------------------------------------------------------------- sharded arrays

SHARDED_CHILD = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxamp import autocast
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    BF, F32 = jnp.bfloat16, jnp.float32
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    x = jax.device_put(jax.random.normal(jax.random.key(0), (8, 16)), NamedSharding(mesh, P("data", None)))
    w = jax.device_put(jax.random.normal(jax.random.key(1), (16, 8)), NamedSharding(mesh, P(None, "model")))

    def f(x, w):
        h = jax.lax.with_sharding_constraint(jnp.tanh(x @ w), NamedSharding(mesh, P("data", "model")))
        return jnp.sum(h @ w.T)

    def hand(x, w):
        h = jnp.tanh(x.astype(BF) @ w.astype(BF))
        h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", "model")))
        return jnp.sum((h @ w.T.astype(BF)).astype(F32))

    v, g = jax.jit(jax.value_and_grad(autocast(f, BF), 1))(x, w)
    v2, g2 = jax.jit(jax.value_and_grad(hand, 1))(x, w)
    assert v.dtype == F32 and float(v) == float(v2), (v, v2)
    np.testing.assert_array_equal(g, g2)
    assert g.sharding.is_equivalent_to(g2.sharding, 2), (g.sharding, g2.sharding)

    def sm(x, w):
        body = lambda a, b: jax.lax.psum(jnp.tanh(a @ b), "model")
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data", "model"), P("model", None)),
                             out_specs=P("data", None))(x, w)

    def sm_hand(x, w):  # b is made varying over "data" before its cast, as shard_map's trace of sm does
        body = lambda a, b: jax.lax.psum(
            jnp.tanh(a.astype(BF) @ jax.lax.pcast(b, "data", to="varying").astype(BF)), "model")
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data", "model"), P("model", None)),
                             out_specs=P("data", None))(x, w)

    out = jax.jit(autocast(sm, BF))(x, w)
    assert out.dtype == BF and out.sharding.spec == P("data", None), out.sharding
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(jax.jit(sm_hand)(x, w), np.float32))
    gs = jax.jit(jax.grad(lambda w: jnp.sum(autocast(sm, BF)(x, w).astype(F32))))(w)
    gs2 = jax.jit(jax.grad(lambda w: jnp.sum(sm_hand(x, w).astype(F32))))(w)
    np.testing.assert_array_equal(gs, gs2)
    print("SHARDED OK")
""")


@pytest.mark.slow
def test_sharded_arrays_and_shard_map_on_8_cpu_devices():
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", SHARDED_CHILD], check=False, capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0 and "SHARDED OK" in proc.stdout, proc.stderr[-3000:]


# --- jaxamp.attention under autocast: torch.amp's scaled_dot_product_attention rule ---

def _attention_model(mask=None):
    from jaxamp.attention import dot_product_attention

    def f(x, w):  # x f32[2, 16, 32], w f32[32, 96]: q, k, v projections, then causal attention
        q, k, v = jnp.split((x @ w).reshape(2, 16, 2, 48), 3, axis=-1)  # [batch, seq, heads, head_dim] each
        return dot_product_attention(q, k, v, is_causal=mask is None, mask=mask).sum()
    return f


def _attention_inputs():
    return normal(60, (2, 16, 32)), normal(61, (32, 96), 0.2)


@pytest.mark.parametrize("dtype", HALF)
def test_attention_runs_as_the_fused_kernel_in_the_compute_dtype(dtype, monkeypatch):
    """Under autocast a `jaxamp.attention.dot_product_attention` call of float32 code takes query, key and value in
    the compute dtype to cuDNN's kernel (here a stand-in that records its inputs: the CPU has no cuDNN), causal as
    called; its output comes back in the compute dtype, and the gradient flows through it."""
    from jaxamp import autocasting
    calls = []

    def fake_cudnn(q, k, v, *, mask=None, is_causal=False):
        calls.append((q.dtype, k.dtype, v.dtype, mask, is_causal))
        return (q.astype(jnp.float32) * 2.0).astype(q.dtype)  # a kernel's output: the inputs' dtype
    monkeypatch.setattr(autocasting, "cudnn_attention", fake_cudnn)
    x, w = _attention_inputs()
    jaxpr = jax.make_jaxpr(jax.grad(autocast(_attention_model(), dtype), argnums=1))(x, w)
    assert calls == [(dtype, dtype, dtype, None, True)], calls
    assert not any(e.params.get("name") == "jaxamp_causal_attention" for e in jaxpr.eqns)
    q = (x.astype(dtype) @ w.astype(dtype)).reshape(2, 16, 2, 48)[..., :16]
    got = autocast(_attention_model(), dtype)(x, w)
    want = (q.astype(jnp.float32) * 2.0).astype(dtype).astype(jnp.float32).sum()
    np.testing.assert_allclose(float(got), float(want), rtol=1e-2)


def test_attention_without_a_kernel_is_inlined_and_reference_and_masks_never_call_it(monkeypatch):
    """Where cuDNN gives None (a CPU), the call is interpreted as any jit: bitwise what autocast of the inlined body
    gives; float32_reference and a masked call never ask for the kernel."""
    from jaxamp import autocasting
    calls = []
    monkeypatch.setattr(autocasting, "cudnn_attention", lambda *a, **k: calls.append(k) or None)
    x, w = _attention_inputs()
    got = jax.jit(autocast(_attention_model(), BF))(x, w)
    assert len(calls) == 1
    monkeypatch.setattr(autocasting, "ATTENTION_JIT_NAMES", {})  # autocast no longer recognises the call
    np.testing.assert_array_equal(got, jax.jit(autocast(_attention_model(), BF))(x, w))
    monkeypatch.undo()
    monkeypatch.setattr(autocasting, "cudnn_attention", lambda *a, **k: calls.append(k) or None)
    calls.clear()
    float32_reference(_attention_model())(x, w)
    autocast(_attention_model(mask=jnp.tril(jnp.ones((16, 16), bool))), BF)(x, w)
    assert calls == []


def test_a_one_hot_made_outside_a_nested_jit_is_a_selection_inside_it():
    """A one-hot array made by the caller and passed into a jitted (or rematerialized) function is still one there:
    the selection runs in the table's dtype (float32 rows, exact), as it does written inline. The audit leaves the
    float32 selection rows out of `fallbacks`. A float mask passed in the same way stays a bfloat16 matmul."""
    import optax

    from jaxamp import NoOpLossScale, TrainState, precision_audit

    table = jax.random.normal(jax.random.key(0), (32, 8))
    ids = jnp.array([3, 0, 31, 3])
    pick = jax.jit(lambda oh, t: oh @ t)
    rows = jax.jit(autocast(lambda t, i: pick(jax.nn.one_hot(i, 32), t), jnp.bfloat16))(table, ids)
    assert rows.dtype == jnp.float32 and np.array_equal(rows, table[ids])
    twice = jax.jit(lambda oh, t: jax.checkpoint(lambda a, b: a @ b)(oh, t))
    rows = autocast(lambda t, i: twice(jax.nn.one_hot(i, 32), t), jnp.bfloat16)(table, ids)
    assert rows.dtype == jnp.float32 and np.array_equal(rows, table[ids])
    mask = autocast(lambda t, x: pick((x > 0).astype(jnp.float32), t), jnp.bfloat16)(table, jnp.ones((2, 32)))
    assert mask.dtype == jnp.bfloat16

    def loss_fn(params, batch, rng):
        return jnp.mean(pick(jax.nn.one_hot(batch, 32), params["table"]) ** 2)

    state = TrainState.create(params={"table": table}, tx=optax.sgd(0.1), policy="bf16;autocast",
                              loss_scale=NoOpLossScale(), rng=jax.random.key(5))
    report = precision_audit(state, ids, loss_fn)
    assert report.rows and all(r["selection"] for r in report.rows), report.rows
    assert report.fallbacks == ()


def test_a_one_hot_scanned_over_or_passed_to_a_cond_or_custom_jvp_is_a_selection_there():
    """A character RNN scans `one_hot(tokens).swapaxes(0, 1)` over time: each step's slice is a one-hot, and its
    matmul with the input weights a selection (float32 table rows, exact; its backward a float32 sum too), where it
    was a bfloat16 matmul. So is a one-hot passed to a cond's branches, a while body or a custom_jvp function. The
    audit sees the selections inside the scan (100% of the counted matmuls in half precision, no fall-backs)."""
    import optax

    from jaxamp import NoOpLossScale, TrainState, precision_audit

    table = jax.random.normal(jax.random.key(0), (32, 8))
    tokens = jax.random.randint(jax.random.key(1), (4, 6), 0, 32)  # i32[batch, time]

    def rnn(params, tokens):
        xs = jnp.swapaxes(jax.nn.one_hot(tokens, 32), 0, 1)  # f32[time, batch, vocab]

        def cell(h, x):
            h = jnp.tanh(x @ params["wxh"] + h @ params["whh"])
            return h, x @ params["wxh"]

        return jax.lax.scan(cell, jnp.zeros((4, 8)), xs)

    params = {"wxh": table, "whh": jax.random.normal(jax.random.key(2), (8, 8)) * 0.1}
    h, picked = autocast(rnn, BF)(params, tokens)
    assert picked.dtype == jnp.float32 and np.array_equal(picked, table[tokens.T]) and h.dtype == jnp.float32
    ids = tokens[0]
    in_cond = autocast(lambda t, i, p: lax.cond(p, lambda oh: oh @ t, lambda oh: 2 * (oh @ t), jax.nn.one_hot(i, 32)),
                       BF)(table, ids, True)
    assert in_cond.dtype == jnp.float32 and np.array_equal(in_cond, table[ids])

    def loop(t, i):
        oh = jax.nn.one_hot(i, 32)  # f32[6, 32], a const of the loop's body
        return lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, oh @ t), (0, jnp.zeros((6, 8))))[1]

    in_while = autocast(loop, BF)(table, ids)
    assert in_while.dtype == jnp.float32 and np.array_equal(in_while, table[ids])
    pick = jax.custom_jvp(lambda oh, t: oh @ t)
    pick.defjvp(lambda primals, tangents: (pick(*primals), tangents[0] @ primals[1] + primals[0] @ tangents[1]))
    in_jvp = autocast(lambda t, i: pick(jax.nn.one_hot(i, 32), t), BF)(table, ids)
    assert in_jvp.dtype == jnp.float32 and np.array_equal(in_jvp, table[ids])
    # a one-hot's rows moved off the last axis are not a selection (a transpose, or a reshape that transposes first)
    moved = autocast(lambda t, i: jnp.swapaxes(jax.nn.one_hot(i, 8), 0, 1) @ t[:6], BF)(table, ids)
    assert moved.dtype == jnp.bfloat16
    square = jnp.arange(8) % 8
    moved = autocast(lambda t, i: lax.reshape(jax.nn.one_hot(i, 8), (8, 8), dimensions=(1, 0)) @ t[:8], BF)(
        table, square)
    assert moved.dtype == jnp.bfloat16

    def loss_fn(params, batch, rng):
        return jnp.mean(rnn(params, batch)[0] ** 2)

    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16;autocast", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(5))
    report = precision_audit(state, tokens, loss_fn)
    assert {(r["weight"], r["selection"], r["lhs"]) for r in report.rows} == {
        ("wxh", True, "float32"), ("whh", False, "bfloat16")}, report.rows
    assert report.half_fraction == 1.0 and report.fallbacks == ()


def test_a_one_hot_contracted_over_its_class_axis_wherever_it_lies_is_a_selection():
    """`table.T @ one_hot(ids).T` and `table.T @ one_hot(ids, axis=0)` pick table rows as `one_hot(ids) @ table`
    does, their class axis moved (a transpose, `axis=0`): they ran as bf16 matmuls (lookups 0.37% off) and as FP8
    ones under `fp8-current` (6.1% off). Now each is a selection (exact float32 rows) under both, and the audit
    counts them as selections."""
    import optax

    from jaxamp import NoOpLossScale, TrainState, precision_audit

    table = jax.random.normal(jax.random.key(0), (64, 32)) * 1.37  # f32[vocab, width]
    ids = jax.random.randint(jax.random.key(1), (128,), 0, 64)
    forms = {"transposed": lambda t, i: (t.T @ jax.nn.one_hot(i, 64).T).T,
             "axis 0": lambda t, i: (t.T @ jax.nn.one_hot(i, 64, axis=0)).T,
             "einsum": lambda t, i: jnp.einsum("vd,vb->bd", t, jax.nn.one_hot(i, 64, axis=0))}
    for name, form in forms.items():
        for fp8 in (None, "current"):
            got = autocast(form, BF, fp8=fp8)(table, ids)
            assert got.dtype == jnp.float32 and np.array_equal(got, table[ids]), (name, fp8)
        state = TrainState.create(params={"t": table}, tx=optax.sgd(0.1), policy="fp8-current",
                                  loss_scale=NoOpLossScale(), rng=jax.random.key(2))
        report = precision_audit(state, {"ids": ids}, lambda p, b, rng, f=form: jnp.sum(f(p["t"], b["ids"]) ** 2))
        assert [(r["pass"], r["lhs"], r["selection"]) for r in report.rows] == [
            ("forward", "float32", True), ("backward", "float32", True)], (name, report.rows)


def test_a_one_hot_matmul_is_a_selection_in_its_other_operands_dtype():
    """`jax.nn.one_hot(ids) @ table` and optax's `ctc_loss` (its log-probabilities gathered by one-hot einsums) are
    selections written as matmuls: autocast runs them in the other operand's dtype (torch.amp's gather and
    embedding), so a float32 table's rows and the CTC loss stay float32 (the loss was bfloat16, 2.6e-3 off); a
    one-hot matmul of a bfloat16 activation stays bfloat16; a plain matmul, a one-hot summed over its rows (a segment
    sum) and a boolean mask or adjacency matrix still run in bfloat16. The audit leaves the selections out of
    `half_fraction` and `fallbacks`."""
    import optax

    from jaxamp import NoOpLossScale, TrainState, precision_audit

    table = jax.random.normal(jax.random.key(0), (32, 8))
    ids = jnp.array([3, 0, 31, 3])
    rows = autocast(lambda t, i: jax.nn.one_hot(i, 32) @ t, jnp.bfloat16)(table, ids)
    assert rows.dtype == jnp.float32 and np.array_equal(rows, table[ids])
    act = autocast(lambda t, i: jax.nn.one_hot(i, 32, dtype=jnp.bfloat16) @ t.astype(jnp.bfloat16), jnp.bfloat16)(
        table, ids)
    assert act.dtype == jnp.bfloat16
    assert autocast(lambda t, x: x @ t, jnp.bfloat16)(table, jnp.ones((2, 32))).dtype == jnp.bfloat16
    # sums, not selections: a one-hot contracted over its rows (a segment sum), a mask, an adjacency matrix
    segment = autocast(lambda t, i: jax.nn.one_hot(i, 32).T @ t[:4], jnp.bfloat16)(table, ids)
    mask = autocast(lambda t, x: (x > 0).astype(jnp.float32) @ t, jnp.bfloat16)(table, jnp.ones((2, 32)))
    assert segment.dtype == mask.dtype == jnp.bfloat16

    B, T, K, U = 4, 40, 16, 6
    logits = jax.random.normal(jax.random.key(1), (B, T, K)) * 3
    labels = jax.random.randint(jax.random.key(2), (B, U), 1, K)
    ctc = lambda lg: optax.ctc_loss(lg, jnp.zeros((B, T)), labels, jnp.zeros((B, U)))
    mixed = jax.jit(autocast(ctc, jnp.bfloat16))(logits)
    assert mixed.dtype == jnp.float32
    np.testing.assert_allclose(mixed, jax.jit(ctc)(logits), rtol=1e-6)

    head = nn.Dense(K, name="lm_head")
    x = jax.random.normal(jax.random.key(3), (B, T, 8))

    def loss_fn(params, batch, rng):
        return optax.ctc_loss(head.apply({"params": params}, batch[0]), jnp.zeros((B, T)), batch[1],
                              jnp.zeros((B, U))).mean()

    state = TrainState.create(params=head.init(jax.random.key(4), x)["params"], tx=optax.sgd(0.1),
                              policy="bf16;autocast", loss_scale=NoOpLossScale(), rng=jax.random.key(5))
    report = precision_audit(state, (x, labels), loss_fn)
    selections = [r for r in report.rows if r["selection"]]
    assert {r["pass"] for r in selections} == {"forward", "backward"} and all(
        r["lhs"] == r["rhs"] == "float32" for r in selections), selections
    assert report.half_fraction == 1.0 and report.fallbacks == ()
