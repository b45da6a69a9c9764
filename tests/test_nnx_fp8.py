"""FP8 in NNX: `jaxamp.nnx.Fp8DotGeneral` layers through `jaxamp.nnx.train_step`, with the linen path's semantics."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxamp import DynamicLossScale, NoOpLossScale, StaticLossScale, TrainState
from jaxamp import train_step as functional_train_step
from jaxamp.nnx import Fp8DotGeneral, Fp8Meta, Optimizer, train_step
from jaxamp.state import FP8_COLLECTION

HISTORY = 4
TX = optax.adam(1e-2)  # one object: equal models, optimizers and loss_fn share a compile


class Fp8MLP(nnx.Module):
    """Linear(8 -> 32, FP8) -> tanh -> Linear(32 -> 1, FP8, no bias)."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 32, dot_general=Fp8DotGeneral(HISTORY), rngs=rngs)
        self.l2 = nnx.Linear(32, 1, use_bias=False, dot_general=Fp8DotGeneral(HISTORY), rngs=rngs)

    def __call__(self, x):  # [batch, 8] in the compute dtype -> [batch, 1]
        return self.l2(jnp.tanh(self.l1(x)))


def make_batch(i: int, scale: float = 1.0, n: int = 32) -> dict:
    """A learnable regression batch: f32[n, 8] inputs (times `scale`), f32[n, 1] targets."""
    x = jax.random.normal(jax.random.key(100 + i), (n, 8))
    return {"x": x * jnp.float32(scale), "y": jnp.sin(x[:, :1]) + 0.5 * x[:, 1:2] * x[:, 2:3]}


def loss_fn(model, batch):
    """Mean squared error in float32; the inputs cast to the compute dtype (the kernel's)."""
    y = model(batch["x"].astype(model.l1.kernel.dtype))
    return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"]))


def fresh(policy="fp8", loss_scale=None, seed=0):
    model = Fp8MLP(nnx.Rngs(seed))
    return model, Optimizer(model, TX, policy=policy, loss_scale=loss_scale or NoOpLossScale())


def fp8_of(model, layer="l1") -> dict:
    """One layer's FP8 state as host arrays: `{"input_scale": f32[1], "input_amax_history": f32[HISTORY], ...}`."""
    return {k: np.asarray(v) for k, v in nnx.to_pure_dict(nnx.state(getattr(model, layer).dot_general)).items()}


def bits(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(nnx.as_pure(tree))]


def test_an_nnx_fp8_mlp_trains_with_float32_state_and_no_optimizer_state_for_fp8():
    model, opt = fresh()
    traces = []

    def counted(model, batch):
        traces.append(1)
        return loss_fn(model, batch)

    losses = [float(train_step(model, opt, make_batch(i % 4), counted)["loss"]) for i in range(30)]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    assert len(traces) == 1
    assert {x.dtype for x in jax.tree.leaves(nnx.as_pure(nnx.state(model)))} == {jnp.dtype(jnp.float32)}
    f = fp8_of(model)
    assert f["input_scale"][0] != 1.0 and f["output_grad_scale"][0] != 1.0  # delayed scaling ran
    # The scale of step 30 is the max of the history before it over e4m3's 448; the history holds its amax now.
    assert (f["input_amax_history"] > 0).all()
    assert "dot_general" not in str(jax.tree.structure(nnx.as_pure(opt.opt_state)))  # no optax state for FP8
    state = opt.train_state(model)
    assert set(state.params) == {"l1", "l2", FP8_COLLECTION}
    # A wrt filter that also matches the FP8 variables changes nothing: they never join the optax update.
    wide = Optimizer(Fp8MLP(nnx.Rngs(0)), TX, policy="fp8", loss_scale=NoOpLossScale(),
                     wrt=nnx.Any(nnx.Param, Fp8Meta))
    assert jax.tree.structure(nnx.as_pure(wide.opt_state)) == jax.tree.structure(nnx.as_pure(
        Optimizer(Fp8MLP(nnx.Rngs(0)), TX, policy="fp8", loss_scale=NoOpLossScale()).opt_state))


@pytest.mark.parametrize("policy", ["fp8", "fp16;fp8"])
def test_fp8_state_and_params_are_bitwise_identical_under_static_loss_scales_1_and_2_to_the_10(policy):
    runs = []
    for scale in (1.0, 2.0**10):
        model, opt = fresh(policy, StaticLossScale(scale))
        for i in range(3):
            assert bool(train_step(model, opt, make_batch(i), loss_fn)["grads_finite"])
        runs.append(model)
    assert bits(nnx.state(runs[0], Fp8Meta)) == bits(nnx.state(runs[1], Fp8Meta))
    assert fp8_of(runs[1])["output_grad_scale"][0] < 1e-2  # stored loss-scale free (not 2^10 larger)
    # The kernels' gradients come out of the FP8 op: bitwise the same too. l1's bias gradient is a float16 sum of
    # the output gradient outside it, which at scale 1 loses subnormals (measured: 2 of 32 elements, 1.2e-6 off).
    kernels = [bits((m.l1.kernel, m.l2.kernel)) for m in runs]
    assert kernels[0] == kernels[1]
    if policy == "fp8":
        assert bits(nnx.state(runs[0], nnx.Param)) == bits(nnx.state(runs[1], nnx.Param))


def snapshot(model, opt):
    return bits(nnx.state(model, nnx.Param)), bits(opt.opt_state), bits(nnx.state(model, Fp8Meta))


@pytest.mark.parametrize("poison", ["loss", "input"])
def test_a_skipped_step_keeps_params_optax_and_fp8_state_bitwise(poison):
    """An inf loss, and an inf input element: FP8 clips the latter to e4m3's range, so the loss and the gradients
    stay finite and only the new amax (inf) shows the overflow; both skip the step."""
    model, opt = fresh("fp16;fp8", DynamicLossScale(2.0**10))
    train_step(model, opt, make_batch(0), loss_fn)  # a normal step first: non-trivial optax and FP8 state
    before = snapshot(model, opt)
    batch = make_batch(1)
    if poison == "loss":
        batch["y"] = batch["y"].at[0, 0].set(jnp.inf)
    else:
        batch["x"] = batch["x"].at[0, 0].set(jnp.inf)
    metrics = train_step(model, opt, batch, loss_fn)
    assert not bool(metrics["grads_finite"])
    if poison == "input":
        assert bool(metrics["loss_finite"]) and np.isfinite(float(metrics["grad_norm"]))
    assert snapshot(model, opt) == before
    assert float(opt.train_state(model).loss_scale.loss_scale) == 2.0**9 and int(opt.step[...]) == 2
    assert bool(train_step(model, opt, make_batch(2), loss_fn)["grads_finite"])  # and training goes on


def test_accumulation_keeps_the_newest_history_with_the_max_amax():
    model, opt = fresh()
    train_step(model, opt, make_batch(0), loss_fn)  # a non-empty history
    before, kernel = fp8_of(model), np.asarray(model.l1.kernel[...])
    a, b = make_batch(1, scale=1.0), make_batch(2, scale=3.0)
    # Strided micro-batches: rows 0, 2, ... are micro-batch 0 (a); rows 1, 3, ... micro-batch 1 (b).
    both = jax.tree.map(lambda u, v: jnp.stack([u, v], 1).reshape(64, -1), a, b)
    metrics = train_step(model, opt, both, loss_fn, accum_steps=2)
    assert bool(metrics["grads_finite"])
    after = fp8_of(model)
    amax = max(float(jnp.max(jnp.abs(m["x"].astype(jnp.bfloat16))).astype(jnp.float32)) for m in (a, b))
    assert after["input_amax_history"][0] == np.float32(amax)  # the larger micro-batch's amax
    np.testing.assert_array_equal(after["input_amax_history"][1:], np.roll(before["input_amax_history"], -1)[1:])
    # Rolled once per optimizer step, not per micro-batch: the kernel (the same in both) is recorded once more.
    kernel_amax = np.float32(jnp.max(jnp.abs(jnp.asarray(kernel).astype(jnp.bfloat16))).astype(jnp.float32))
    assert after["kernel_amax_history"][0] == kernel_amax
    np.testing.assert_array_equal(after["kernel_amax_history"][1:], np.roll(before["kernel_amax_history"], -1)[1:])


def test_one_trace_while_the_scale_changes_and_a_train_state_reload_continues_bitwise():
    traces = []

    def counted(model, batch):
        traces.append(1)
        return loss_fn(model, batch)

    model, opt = fresh("fp16;fp8", DynamicLossScale(2.0**4, growth_interval=1))
    scales = set()
    for i in range(6):
        batch = make_batch(i)
        if i == 3:
            batch["y"] = batch["y"] * jnp.float32(jnp.inf)
        scales.add(float(train_step(model, opt, batch, counted)["loss_scale"]))
    assert len(traces) == 1 and len(scales) >= 4, (traces, scales)
    other, other_opt = fresh("fp16;fp8", DynamicLossScale(2.0**4, growth_interval=1), seed=5)
    other_opt.load_train_state(other, opt.train_state(model))  # the wrt form, FP8 state included
    assert bits(nnx.state(other)) == bits(nnx.state(model))  # Params and FP8 state (the model has no other)
    for i in range(6, 8):
        train_step(model, opt, make_batch(i), counted)
        train_step(other, other_opt, make_batch(i), counted)
    assert bits((nnx.state(other, nnx.Param), nnx.state(other, Fp8Meta), nnx.state(other_opt))) == \
        bits((nnx.state(model, nnx.Param), nnx.state(model, Fp8Meta), nnx.state(opt)))
    assert len(traces) == 1


class LinenFp8MLP(nn.Module):
    """`Fp8MLP` in linen: `nn.Dense` with Flax's `Fp8DirectDotGeneralOp`, named as the NNX attributes."""

    @nn.compact
    def __call__(self, x):
        def op():
            return nn.Fp8DirectDotGeneralOp(amax_history_length=HISTORY, name="dot_general")

        h = jnp.tanh(nn.Dense(32, dot_general_cls=op, name="l1")(x))
        return nn.Dense(1, use_bias=False, dot_general_cls=op, name="l2")(h)


def linen_loss(params, batch, rng):
    del rng
    y = LinenFp8MLP().apply(params, batch["x"].astype(params["params"]["l1"]["kernel"].dtype))
    return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"]))


def test_the_same_model_in_linen_and_nnx_gives_bitwise_the_same_losses_params_and_fp8_state():
    """Under bf16 compute (Flax's op as it is) with a dynamic loss scale and accumulation on every other step."""
    model, opt = fresh("fp8", DynamicLossScale(2.0**10, growth_interval=2))
    variables = {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                 FP8_COLLECTION: nnx.to_pure_dict(nnx.state(model, Fp8Meta))}
    assert jax.tree.structure(variables) == jax.tree.structure(  # the same variables, the same names
        LinenFp8MLP().init(jax.random.key(0), jnp.zeros((1, 8))))
    state = TrainState.create(params=variables, tx=TX, policy="fp8",
                              loss_scale=DynamicLossScale(2.0**10, growth_interval=2), rng=jax.random.key(0))
    step = jax.jit(functional_train_step, static_argnames=("loss_fn", "accum_steps"))
    for i in range(5):
        state, linen_metrics = step(state, make_batch(i), linen_loss, accum_steps=1 + i % 2)
        nnx_metrics = train_step(model, opt, make_batch(i), loss_fn, accum_steps=1 + i % 2)
        assert float(nnx_metrics["loss"]) == float(linen_metrics["loss"]), i
        assert float(nnx_metrics["loss_scale"]) == float(linen_metrics["loss_scale"]), i
    assert bits(nnx.state(model, Fp8Meta)) == bits(state.params[FP8_COLLECTION])
    assert bits(nnx.state(model, nnx.Param)) == bits(state.params["params"])
    assert bits(opt.opt_state) == bits(state.opt_state)


def test_a_linen_fp8_layer_through_the_nnx_bridge_trains_its_fp8_state():
    """`nnx.bridge.ToNNX` maps linen's `_overwrite_with_gradient` collection to `Fp8Meta`, so it needs nothing more."""
    model = nnx.bridge.ToNNX(nn.Dense(1, dot_general_cls=nn.Fp8DirectDotGeneralOp), rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(model, jnp.zeros((1, 8)))
    opt = Optimizer(model, TX, policy="fp8", loss_scale=NoOpLossScale())

    def bridge_loss(model, batch):
        y = model(batch["x"].astype(jnp.bfloat16))
        return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"]))

    for i in range(3):
        assert bool(train_step(model, opt, make_batch(i), bridge_loss)["grads_finite"])
    fp8 = nnx.to_pure_dict(nnx.state(model, Fp8Meta))["Fp8DirectDotGeneralOp_0"]
    assert fp8["input_scale"][0] != 1.0 and int((fp8["input_amax_history"] > 0).sum()) == 3  # one amax per step
