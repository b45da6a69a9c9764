"""`jaxamp.remat.recompute_elementwise`: a scanned block under autocast saves its half-precision matmul outputs, not
their float32 widenings, and recomputes no matmul (the LM's `--remat elementwise`)."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from jaxamp.lm.model import TransformerConfig, TransformerLM
from jaxamp.lm.setup import lm_variables, make_policy
from jaxamp.remat import ELEMENTWISE, FP8_OUTPUT_NAME, recompute_elementwise

WIDTH, LAYERS, BATCH, SEQ = 16, 3, 2, 8
HIDDEN = 4 * WIDTH  # the MLP's width: a float32 [.., HIDDEN] residual is GELU's widened input
CFG = TransformerConfig(vocab_size=32, seq_len=SEQ, num_layers=LAYERS, num_heads=2, width=WIDTH, dropout=0.0,
                        scan_layers=True)


def _grad_jaxpr(precision: str, remat: str):
    """The jaxpr of the gradient of the scanned tiny LM's loss under `precision` (its autocast when it has one)."""
    policy = make_policy(precision)
    model = TransformerLM(dataclasses.replace(CFG, remat=remat))
    ids = jnp.arange(BATCH * SEQ, dtype=jnp.int32).reshape(BATCH, SEQ) % CFG.vocab_size  # i32[batch, seq]
    params = model.init(jax.random.key(0), ids)["params"]

    def loss(p):
        return model.apply(lm_variables(p), ids, ids, deterministic=True)  # f32[]

    fp8 = {"fp8": policy.fp8_recipe} if policy.fp8_recipe else {}
    fn = jaxamp.autocast(loss, policy.compute_dtype, **fp8) if policy.autocast else (
        lambda p: loss(policy.cast_to_compute(p)))
    return jax.make_jaxpr(jax.grad(fn))(params).jaxpr


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                yield from _eqns(inner)


def _stacked_residuals(jaxpr) -> collections.Counter:
    """dtype and per-layer shape of the forward scan's outputs stacked over the layers (what the backward reads)."""
    scans = [e for e in _eqns(jaxpr) if e.primitive.name == "scan"]
    forward = scans[0]
    return collections.Counter((str(v.aval.dtype), v.aval.shape[1:]) for v in forward.outvars
                               if v.aval.shape[:1] == (LAYERS,) and v.aval.ndim >= 3)


def _dots(jaxpr) -> list[str]:
    return sorted(",".join(str(v.aval.dtype) for v in e.invars) for e in _eqns(jaxpr)
                  if e.primitive.name == "dot_general")


@pytest.mark.slow  # 4-7 s each on 2 cores
@pytest.mark.parametrize("precision", ["bf16;autocast", "fp8-current"])
def test_scanned_block_saves_no_float32_hidden_activation_and_recomputes_no_matmul(precision):
    plain, elementwise, full = (_grad_jaxpr(precision, r) for r in ("none", "elementwise", "full"))
    hidden_f32 = [k for k in _stacked_residuals(plain) if k[0] == "float32" and k[1][-1] == HIDDEN]
    assert hidden_f32, "without a policy GELU's float32 input and terms are saved per layer"
    saved = _stacked_residuals(elementwise)
    assert not [k for k in saved if k[0] == "float32" and k[1][-1] == HIDDEN], saved
    assert ("bfloat16", (BATCH * SEQ, HIDDEN) if precision == "fp8-current" else (BATCH, SEQ, HIDDEN)) in saved
    assert sum(n for (dtype, _), n in saved.items() if dtype == "float32") < sum(
        n for (dtype, _), n in _stacked_residuals(plain).items() if dtype == "float32")
    # No matmul runs twice (the whole-block policy does recompute them: the count can differ).
    assert _dots(elementwise) == _dots(plain)
    assert len(_dots(full)) > len(_dots(plain))


def test_fp8_dot_output_is_saved_narrow_and_its_float32_dot_is_not():
    f8 = jax.ShapeDtypeStruct((4, 4), jnp.float8_e4m3fn)
    f32 = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    dims = (((1,), (1,)), ((), ()))
    assert not recompute_elementwise(jax.lax.dot_general_p, f8, f8, dimension_numbers=dims,
                                     preferred_element_type=jnp.float32)
    assert recompute_elementwise(jax.lax.dot_general_p, f32, f32, dimension_numbers=dims,
                                 preferred_element_type=jnp.float32)
    named = jax.make_jaxpr(lambda x: jax.ad_checkpoint.checkpoint_name(x, FP8_OUTPUT_NAME))(jnp.ones(2)).eqns[0]
    assert recompute_elementwise(named.primitive, **named.params)
    other = jax.make_jaxpr(lambda x: jax.ad_checkpoint.checkpoint_name(x, "mine"))(jnp.ones(2)).eqns[0]
    assert not recompute_elementwise(other.primitive, **other.params)
    assert not recompute_elementwise(jax.lax.convert_element_type_p, f32, new_dtype=jnp.bfloat16, weak_type=False,
                                     sharding=None)
    assert recompute_elementwise(jax.lax.reduce_max_p, f32, axes=(0,), out_sharding=None)
    assert "dot_general" not in ELEMENTWISE and "add" in ELEMENTWISE


def test_gradients_under_the_policy_equal_the_unrematerialised_ones_bitwise_in_float32():
    def block(w, x):
        h = jax.nn.gelu(x @ w[0] + 1.0)  # f32[n, hidden]
        return jnp.tanh(h @ w[1]).sum()  # f32[]

    w = jax.random.normal(jax.random.key(1), (2, 8, 8), jnp.float32)
    x = jax.random.normal(jax.random.key(2), (4, 8), jnp.float32)
    ref = jax.jit(jax.grad(block))(w, x)
    got = jax.jit(jax.grad(jax.checkpoint(block, policy=recompute_elementwise)))(w, x)
    assert ref.dtype == got.dtype and ref.shape == got.shape
    assert bool(jnp.all(ref == got))
