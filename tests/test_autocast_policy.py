"""Autocast policies (`get_policy(..., autocast=True)`, `"bf16;autocast"`) through the step, the diagnostics,
checkpoints and NNX: the same as the cast policies everywhere, with `loss_fn` run under `jaxamp.autocast`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
import jaxamp.nnx as jnnx
from jaxamp import (
    Checkpointer,
    DynamicLossScale,
    NoOpLossScale,
    TrainState,
    autocast,
    eval_step,
    get_policy,
    train_step,
)
from jaxamp.autocasting import FLOAT32_RESULTS
from jaxamp.fidelity import grad_fidelity
from jaxamp.precision import policy_name, uses_autocast


class MLP(nn.Module):
    """Ordinary float32 code: no dtype anywhere."""

    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.gelu(nn.Dense(64)(x)))
        return nn.Dense(4)(x)


MODEL = MLP()
PARAMS = MODEL.init(jax.random.key(0), jnp.ones((1, 16)))["params"]


def loss_fn(params, batch, rng):
    del rng
    x, y = batch
    logits = MODEL.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batch_of(i, rows=32):
    x = jax.random.normal(jax.random.key(10 + i), (rows, 16))
    return x, jnp.arange(rows) % 4


def state_of(policy, loss_scale=None, **kw):
    return TrainState.create(params=jax.tree.map(jnp.copy, PARAMS), tx=optax.adam(1e-2), policy=policy,
                             loss_scale=loss_scale or NoOpLossScale(), rng=jax.random.key(1), **kw)


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


STEP = jax.jit(train_step, static_argnames=("loss_fn", "accum_steps", "on_overflow"))


def test_the_policy_is_named_parsed_and_refuses_what_it_cannot_do():
    policy = get_policy("bf16", autocast=True)
    assert uses_autocast(policy) and policy_name(policy) == "bf16;autocast"
    assert get_policy("bf16;autocast") == policy and get_policy("fp16;autocast").compute_dtype == jnp.float16
    assert policy_name(policy, rules=False) == "bf16;autocast"
    params = {"w": jnp.ones((2, 2), jnp.float32)}
    assert policy.cast_to_compute(params)["w"].dtype == jnp.float32  # the master weights, uncast
    with pytest.raises(ValueError, match="autocast computes matmuls in a half-precision dtype"):
        get_policy("fp32;autocast")
    with pytest.raises(ValueError, match="keep_float32 .* has nothing to keep"):
        get_policy("bf16;autocast", keep_float32=("*/embedding",))
    with pytest.raises(ValueError, match="unknown policy rule 'autocst'"):
        get_policy("bf16;autocst")


def test_float32_results_is_a_rule_of_the_name_and_reaches_the_step():
    """`;float32_results=` replaces the default (the output head); empty leaves torch.amp's rule; names round-trip;
    the step runs `autocast(loss_fn, ..., float32_results=...)` (bitwise) and the audit sees the float32 result."""
    assert get_policy("bf16;autocast").float32_results == FLOAT32_RESULTS
    for name in ("bf16;autocast;float32_results=", "bf16;autocast;float32_results=^Dense_1$,head{1,2}$",
                 "fp8-current;float32_results="):
        assert policy_name(get_policy(name)) == name and get_policy(policy_name(get_policy(name))) == get_policy(name)
    assert get_policy("bf16;autocast;float32_results=a,b{1,2}").float32_results == ("a", "b{1,2}")
    added = get_policy("bf16;autocast;float32_results+=^output_layer$")  # the defaults and one more
    assert added.float32_results == (*FLOAT32_RESULTS, "^output_layer$")
    assert policy_name(added) == "bf16;autocast;float32_results+=^output_layer$"
    with pytest.raises(ValueError, match="given twice"):
        get_policy("bf16;autocast;float32_results=a;float32_results+=b")
    with pytest.raises(ValueError, match="add ';autocast'"):
        get_policy("bf16;float32_results=head$")
    spec = "bf16;autocast;float32_results=^Dense_1$"  # the model's last Dense, by its linen name
    by_policy, by_hand = state_of(spec), state_of("fp32")
    hand_loss = autocast(loss_fn, jnp.bfloat16, float32_results=["^Dense_1$"])
    by_policy, m1 = STEP(by_policy, batch_of(0), loss_fn)
    by_hand, m2 = STEP(by_hand, batch_of(0), hand_loss)
    assert float(m1["loss"]) == float(m2["loss"]) and bits(by_policy.params) == bits(by_hand.params)
    outs = {r["out"] for r in jaxamp.precision_audit(by_policy, batch_of(0), loss_fn).rows if r["pass"] == "forward"}
    assert "float32" in outs and "bfloat16" in outs


@pytest.mark.slow
def test_train_step_under_an_autocast_policy_is_the_step_of_the_autocast_loss():
    """Bitwise: the policy's step equals a float32-policy step whose loss is `autocast(loss_fn, bf16)` by hand."""
    by_policy, by_hand = state_of("bf16;autocast"), state_of("fp32")
    hand_loss = autocast(loss_fn, jnp.bfloat16)
    for i in range(3):
        by_policy, m1 = STEP(by_policy, batch_of(i), loss_fn)
        by_hand, m2 = STEP(by_hand, batch_of(i), hand_loss)
        assert bool(m1["grads_finite"]) and float(m1["loss"]) == float(m2["loss"])
    assert jax.tree.structure(by_policy.params) == jax.tree.structure(by_hand.params)
    assert bits(by_policy.params) == bits(by_hand.params) and bits(by_policy.opt_state) == bits(by_hand.opt_state)
    assert {x.dtype for x in jax.tree.leaves(by_policy.params)} == {jnp.dtype(jnp.float32)}
    report = jaxamp.precision_audit(by_policy, batch_of(0), loss_fn)
    assert report.half_fraction == 1.0 and not report.half_accumulations
    assert float(eval_step(by_policy, batch_of(0), loss_fn)["loss"]) == float(
        eval_step(by_hand, batch_of(0), hand_loss)["loss"])


def test_autocast_follows_float32_closely_and_traces_once():
    traces = []

    def counted(params, batch, rng):
        traces.append(1)
        return loss_fn(params, batch, rng)

    mixed, exact = state_of("bf16;autocast"), state_of("fp32")
    for i in range(20):
        mixed, m = STEP(mixed, batch_of(i), counted)
        exact, e = STEP(exact, batch_of(i), loss_fn)
        if i == 0:
            first = len(traces)  # the compilation (the precision audit reads the very program that runs)
    assert first == 1 and len(traces) == first  # one trace, none more over 20 steps
    np.testing.assert_allclose(float(m["loss"]), float(e["loss"]), rtol=0.02)


@pytest.mark.slow
def test_accumulation_retry_frozen_leaves_and_with_policy_work_as_with_cast_policies():
    # accumulation: two micro-batches of 16 give the gradient of the batch of 32 (SGD: the update is the gradient;
    # the micro-batches' bf16 matmuls round differently from the whole batch's, so to bf16 rounding)
    sgd = lambda: TrainState.create(params=jax.tree.map(jnp.copy, PARAMS), tx=optax.sgd(1.0), rng=jax.random.key(1),
                                    policy="bf16;autocast", loss_scale=NoOpLossScale())
    whole, _ = STEP(sgd(), batch_of(0), loss_fn)
    split, metrics = STEP(sgd(), batch_of(0), loss_fn, accum_steps=2)
    assert bool(metrics["grads_finite"])
    assert jax.tree.structure(whole.params) == jax.tree.structure(split.params) == jax.tree.structure(PARAMS)
    for a, b, p in zip(jax.tree.leaves(whole.params), jax.tree.leaves(split.params), jax.tree.leaves(PARAMS)):
        assert float(jnp.linalg.norm((a - p) - (b - p)) / jnp.linalg.norm(a - p)) < 0.01  # bf16 weight gradients
    # retry: an overflow in float16 at a huge scale is retried at a lower one inside the call
    state = state_of("fp16;autocast", DynamicLossScale(2.0**24, max_loss_scale=2.0**30, backoff_factor=2.0**-6))
    big = (batch_of(1)[0] * 30.0, batch_of(1)[1])
    new, metrics = STEP(state, big, loss_fn, on_overflow="retry")
    assert int(metrics["retries"]) > 0 and bool(metrics["grads_finite"]), metrics
    assert float(new.loss_scale.loss_scale) < 2.0**24
    # frozen leaves: untouched bitwise, the rest trains
    frozen = state_of("bf16;autocast", trainable={"Dense_0": False, "Dense_1": True, "LayerNorm_0": True})
    after, _ = STEP(frozen, batch_of(2), loss_fn)
    assert bits(after.params["Dense_0"]) == bits(frozen.params["Dense_0"])
    assert bits(after.params["Dense_1"]) != bits(frozen.params["Dense_1"])
    # with_policy: a cast-policy run switched to autocast keeps its master weights and optimizer state
    with jax.numpy_dtype_promotion("standard"):  # the cast policy meets float32 inputs in this float32 code
        cast_run, _ = STEP(state_of("bf16"), batch_of(3), loss_fn)
    switched = cast_run.with_policy("bf16;autocast", NoOpLossScale())
    assert bits(switched.params) == bits(cast_run.params) and policy_name(switched.policy) == "bf16;autocast"
    assert bool(STEP(switched, batch_of(4), loss_fn)[1]["grads_finite"])


def test_a_checkpoint_of_an_autocast_run_restores_bitwise_and_names_its_policy(tmp_path):
    state, _ = STEP(state_of("bf16;autocast"), batch_of(0), loss_fn)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(state, {"run": 1})
        ckpt.wait()
        assert ckpt.read_settings()[1]["policy"] == "bf16;autocast"
        restored, config = ckpt.restore(jax.eval_shape(lambda: state_of("bf16;autocast")))
    assert config == {"run": 1} and bits(restored.params) == bits(state.params)
    assert int(restored.step) == 1 and policy_name(restored.policy) == "bf16;autocast"
    with Checkpointer(tmp_path / "ckpt") as ckpt, pytest.raises(jaxamp.CheckpointMismatchError, match="policy"):
        ckpt.restore(jax.eval_shape(lambda: state_of("bf16")))


@pytest.mark.slow
def test_grad_fidelity_of_a_model_that_fixes_its_own_bf16_dtype_is_not_all_zeros():
    """Flax's mixed-precision idiom, `dtype=jnp.bfloat16` in the model: its "float32" recomputation used to run in
    bf16 too, so every error read 0.0. The reference now runs at trace level in float32."""

    class Fixed(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.gelu(nn.Dense(64, dtype=jnp.bfloat16)(x))
            return nn.Dense(4, dtype=jnp.bfloat16)(x)

    model = Fixed()
    params = model.init(jax.random.key(0), jnp.ones((1, 16)))["params"]

    def fixed_loss(params, batch, rng):
        del rng
        x, y = batch
        logits = model.apply({"params": params}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    for policy in ("fp32", "bf16"):
        state = TrainState.create(params=params, tx=optax.sgd(0.1), policy=policy, loss_scale=NoOpLossScale(),
                                  rng=jax.random.key(1))
        with jax.numpy_dtype_promotion("standard"):
            errors = jax.jit(grad_fidelity, static_argnames="loss_fn")(state, batch_of(0), fixed_loss)
        values = [float(v) for v in errors.values()]
        assert min(values) > 1e-4 and max(values) < 0.1, (policy, errors)  # bf16 rounding, seen from float32


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(16, 64, rngs=rngs), nnx.Linear(64, 4, rngs=rngs)
        self.norm = nnx.LayerNorm(64, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(self.norm(nnx.gelu(self.l1(x)))))


def nnx_loss(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@pytest.mark.slow
def test_nnx_models_train_under_autocast_with_float32_master_weights():
    model = NnxMLP(nnx.Rngs(0, dropout=1))
    opt = jnnx.Optimizer(model, optax.adam(1e-2), policy="fp16;autocast", loss_scale=DynamicLossScale(2.0**15))
    losses = []
    for i in range(5):
        metrics = jnnx.train_step(model, opt, batch_of(i % 2), nnx_loss)
        assert bool(metrics["grads_finite"])
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] and model.l1.kernel.dtype == jnp.float32
    report = jnnx.precision_audit(model, opt, batch_of(0), nnx_loss)
    assert report.half_fraction == 1.0 and report.compute_dtype == "float16"
    errors = jnnx.grad_fidelity(model, opt, batch_of(0), nnx_loss)
    assert 0 < max(float(v) for v in errors.values()) < 0.02
