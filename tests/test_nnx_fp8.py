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
from jaxamp.fp8_collection import FP8_COLLECTION
from jaxamp.nnx import Fp8DotGeneral, Fp8Einsum, Fp8Meta, Optimizer, train_step

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


@pytest.mark.slow
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
    # The kernels' gradients come out of the FP8 op: bitwise the same too under bf16 compute. Under float16, l1's
    # output gradient reaches the FP8 op through float16 ops (tanh's derivative) that at scale 1 lose subnormals,
    # and its bias gradient is a float16 sum of it: how many depends on the CPU's float16 arithmetic (XLA:CPU on
    # AVX512-FP16 rounds float16 ops natively: 9 of l1's 256 kernel entries 8.4e-6 off after 3 steps, measured on
    # a Xeon; bitwise on an EPYC without AVX-512). l2's kernel (its gradient is the loss's own) stays bitwise.
    if policy == "fp8":
        assert bits(nnx.state(runs[0], nnx.Param)) == bits(nnx.state(runs[1], nnx.Param))
    else:
        assert bits(runs[0].l2.kernel) == bits(runs[1].l2.kernel)
        np.testing.assert_allclose(np.asarray(runs[0].l1.kernel[...]), np.asarray(runs[1].l1.kernel[...]),
                                   rtol=0, atol=5e-5)


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
    # An inf loss leaves the scale alone (no scale fixes it); an overflow that shows only in the amax backs it off.
    scale_after = 2.0**10 if poison == "loss" else 2.0**9
    assert float(opt.train_state(model).loss_scale.loss_scale) == scale_after and int(opt.step[...]) == 2
    assert bool(train_step(model, opt, make_batch(2), loss_fn)["grads_finite"])  # and training goes on


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# ---------------------------------------------------------------------------------------------------------------------
# Diagnostics: fp8_ranges and grad_fidelity for NNX, against the linen model of the same variables.


def linen_twin(model, opt):
    """The linen `TrainState` holding `model`'s variables and `opt`'s state (the same names and values)."""
    variables = {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                 FP8_COLLECTION: nnx.to_pure_dict(nnx.state(model, Fp8Meta))}
    state = opt.train_state(model)
    return TrainState.create(params=variables, tx=TX, policy=opt.policy, loss_scale=state.loss_scale,
                             rng=jax.random.key(0))


@pytest.mark.slow
def test_nnx_fp8_ranges_equal_the_linen_report_of_the_same_model_and_change_nothing():
    from jaxamp.fp8_report import fp8_ranges as linen_fp8_ranges
    from jaxamp.nnx import fp8_ranges

    model, opt = fresh()
    for i in range(3):
        train_step(model, opt, make_batch(i), loss_fn)
    before = bits((nnx.state(model), nnx.state(opt)))
    for scale in (1.0, 200.0):
        batch = make_batch(5, scale=scale)
        rows = fp8_ranges(model, opt, batch, loss_fn)
        assert rows == linen_fp8_ranges(linen_twin(model, opt), batch, linen_loss)
        by = {(r["layer"], r["tensor"]): r for r in rows}
        assert set(by) == {(f"{layer}/dot_general", t) for layer in ("l1", "l2")
                           for t in ("input", "kernel", "output_grad")}
        x_amax = float(jnp.max(jnp.abs(batch["x"].astype(jnp.bfloat16))).astype(jnp.float32))
        assert by[("l1/dot_general", "input")]["amax"] == x_amax
        assert by[("l1/dot_general", "input")]["capacity"] == pytest.approx(
            float(fp8_of(model)["input_amax_history"].max()), rel=1e-6)
        saturated = by[("l1/dot_general", "input")]["saturated"]
        assert (saturated < 0.01) if scale == 1.0 else (saturated > 0.9)  # batch 5's amax is 3.5 > 2.95 in history
    assert bits((nnx.state(model), nnx.state(opt))) == before
    plain = nnx.Linear(8, 1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no FP8 variables"):
        fp8_ranges(plain, Optimizer(plain, TX, policy="bf16", loss_scale=NoOpLossScale()), make_batch(0),
                   lambda m, b: jnp.mean(m(b["x"].astype(jnp.bfloat16)).astype(jnp.float32)))


class LinenPlainMLP(nn.Module):
    """`LinenFp8MLP` without its FP8 ops (the reference the fidelity check compares with)."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1, use_bias=False, name="l2")(jnp.tanh(nn.Dense(32, name="l1")(x)))


@pytest.mark.slow
def test_grad_fidelity_bypasses_fp8_ops_in_its_reference_and_the_nnx_form_equals_the_linen_one():
    from jaxamp.fidelity import grad_fidelity as linen_grad_fidelity
    from jaxamp.nnx import grad_fidelity

    model, opt = fresh()
    for i in range(3):
        train_step(model, opt, make_batch(i), loss_fn)
    batch, twin = make_batch(5), linen_twin(model, opt)

    def plain_loss(params, batch, rng):
        del rng
        y = LinenPlainMLP().apply(params, batch["x"].astype(params["params"]["l1"]["kernel"].dtype))
        return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"]))

    fidelity = jax.jit(linen_grad_fidelity, static_argnames=("loss_fn", "reference_loss_fn"))
    bypassed = fidelity(twin, batch, linen_loss)  # no reference given: FP8 ops bypassed
    explicit = fidelity(twin, batch, linen_loss, reference_loss_fn=plain_loss)
    errors = grad_fidelity(model, opt, batch, loss_fn)
    assert set(errors) == {"l1/bias", "l1/kernel", "l2/kernel"}
    for k in errors:
        assert float(bypassed[f"params/{k}"]) == float(explicit[f"params/{k}"]) == float(errors[k]), k
        assert 1e-3 < float(errors[k]) < 0.25, (k, float(errors[k]))  # e4m3: 3 mantissa bits
    # The reference is float32 without FP8: under an fp32 policy the FP8 path alone makes the error.
    no_fp8 = {k: float(v) for k, v in grad_fidelity(model, Optimizer(model, TX, policy="fp32",
                                                                    loss_scale=NoOpLossScale()), batch,
                                                    loss_fn).items()}
    assert all(v > 1e-3 for v in no_fp8.values()), no_fp8
    dense = nnx.Linear(8, 1, rngs=nnx.Rngs(0))
    exact = grad_fidelity(dense, Optimizer(dense, TX, policy="fp32", loss_scale=NoOpLossScale()), batch,
                          lambda m, b: jnp.mean(jnp.square(m(b["x"]) - b["y"])))
    assert {k: float(v) for k, v in exact.items()} == {"bias": 0.0, "kernel": 0.0}


class EinsumMLP(nnx.Module):
    """`Fp8MLP` with `nnx.Einsum` layers and `Fp8Einsum` ops; `eqn` of the first layer (`"bi,io->bo"` or the
    transposed output `"bi,io->ob"`, which `jnp.einsum` contracts kernel first)."""

    def __init__(self, rngs: nnx.Rngs, eqn: str = "bi,io->bo"):
        self.eqn = eqn
        self.l1 = nnx.Einsum(eqn, (8, 32), (32,) if eqn.endswith("bo") else None, einsum_op=Fp8Einsum(HISTORY),
                             rngs=rngs)
        self.l2 = nnx.Einsum("bi,io->bo", (32, 1), einsum_op=Fp8Einsum(HISTORY), rngs=rngs)

    def __call__(self, x):  # [batch, 8] -> [batch, 1]
        h = self.l1(x)  # [batch, 32], or [32, batch] for "->ob"
        return self.l2(jnp.tanh(h if self.eqn.endswith("bo") else h.T))


class LinenEinsumMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        def layer(name, shape, bias):
            w = self.param(f"{name}_kernel", nn.initializers.zeros, shape, jnp.float32).astype(x.dtype)
            b = self.param(f"{name}_bias", nn.initializers.zeros, shape[-1:], jnp.float32) if bias else None
            return w, b, nn.Fp8Einsum(amax_history_length=HISTORY, name=f"{name}_op")

        w1, b1, op1 = layer("l1", (8, 32), True)
        w2, _, op2 = layer("l2", (32, 1), False)
        return op2("bi,io->bo", jnp.tanh(op1("bi,io->bo", x, w1) + b1.astype(x.dtype)), w2)


def einsum_loss(model, batch):
    y = model(batch["x"].astype(model.l1.kernel.dtype))
    return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"]))


@pytest.mark.slow
def test_nnx_fp8_einsum_trains_bitwise_as_flax_linen_fp8_einsum():
    model = EinsumMLP(nnx.Rngs(0))
    opt = Optimizer(model, TX, policy="fp8", loss_scale=NoOpLossScale())
    nnx_vars = nnx.to_pure_dict(nnx.state(model))
    params = {"l1_kernel": nnx_vars["l1"]["kernel"], "l1_bias": nnx_vars["l1"]["bias"],
              "l2_kernel": nnx_vars["l2"]["kernel"]}
    fp8 = {"l1_op": nnx_vars["l1"]["einsum_op"], "l2_op": nnx_vars["l2"]["einsum_op"]}
    state = TrainState.create(params={"params": params, FP8_COLLECTION: fp8}, tx=TX, policy="fp8",
                              loss_scale=NoOpLossScale(), rng=jax.random.key(0))

    def linen_loss(params, batch, rng):
        del rng
        y = LinenEinsumMLP().apply(params, batch["x"].astype(jnp.bfloat16))
        return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"]))

    step = jax.jit(functional_train_step, static_argnames="loss_fn")
    losses = []
    for i in range(20):
        state, linen_metrics = step(state, make_batch(i % 4), linen_loss)
        losses.append(float(train_step(model, opt, make_batch(i % 4), einsum_loss)["loss"]))
        assert losses[-1] == float(linen_metrics["loss"]), i
    assert np.mean(losses[-3:]) < 0.5 * np.mean(losses[:3]), losses
    now = nnx.to_pure_dict(nnx.state(model))
    assert bits(now["l1"]["einsum_op"]) == bits(state.params[FP8_COLLECTION]["l1_op"])
    assert bits(now["l2"]["kernel"]) == bits(state.params["params"]["l2_kernel"])


@pytest.mark.slow
def test_each_tensor_keeps_its_own_scale_where_jnp_einsum_contracts_the_kernel_first():
    """`"bi,io->ob"`: jnp.einsum calls dot_general(kernel, inputs); Flax's linen op then files the kernel's amax
    under input_amax_history. jaxamp's NNX op keeps the names right, and fp8_ranges reads the right variables for
    both."""
    from jaxamp.fp8_report import einsum_swaps
    from jaxamp.fp8_report import fp8_ranges as linen_fp8_ranges
    from jaxamp.nnx import fp8_ranges

    assert einsum_swaps("bi,io->ob", (4, 8), (8, 32)) and not einsum_swaps("bi,io->bo", (4, 8), (8, 32))
    model = EinsumMLP(nnx.Rngs(0), eqn="bi,io->ob")
    opt = Optimizer(model, TX, policy="fp8", loss_scale=NoOpLossScale())
    batch = make_batch(0, scale=4.0)
    w_amax = float(jnp.max(jnp.abs(model.l1.kernel[...].astype(jnp.bfloat16))).astype(jnp.float32))
    train_step(model, opt, batch, einsum_loss)
    f = nnx.to_pure_dict(nnx.state(model.l1.einsum_op))
    x_amax = float(jnp.max(jnp.abs(batch["x"].astype(jnp.bfloat16))).astype(jnp.float32))
    assert (f["input_amax_history"][0], f["kernel_amax_history"][0]) == (x_amax, w_amax)
    assert x_amax > 5 * w_amax  # told apart
    rows = {r["tensor"]: r for r in fp8_ranges(model, opt, batch, einsum_loss) if r["layer"] == "l1/einsum_op"}
    assert rows["input"]["amax"] == x_amax and rows["input"]["saturated"] == 0.0
    assert rows["input"]["capacity"] == pytest.approx(x_amax, rel=1e-6)
    # Flax's linen op, same equation: the kernel's amax lands in input_amax_history; fp8_ranges pairs each tensor
    # with the variables that scale it.
    net = nn.Fp8Einsum(amax_history_length=HISTORY)
    w = jnp.asarray(model.l1.kernel[...]).astype(jnp.bfloat16)
    variables = net.init(jax.random.key(0), "bi,io->ob", batch["x"].astype(jnp.bfloat16), w)

    def op_loss(params, batch, rng):
        del rng
        return jnp.mean(net.apply(params, "bi,io->ob", batch["x"].astype(jnp.bfloat16), w).astype(jnp.float32) ** 2)

    state = TrainState.create(params=variables, tx=TX, policy="fp8", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(0))
    state, _ = functional_train_step(state, batch, op_loss)
    linen = state.params[FP8_COLLECTION]
    assert float(linen["input_amax_history"][0]) == float(jnp.max(jnp.abs(w)).astype(jnp.float32))
    rows = {r["tensor"]: r for r in linen_fp8_ranges(state, batch, op_loss)}
    assert rows["input"]["amax"] == x_amax and rows["input"]["capacity"] == pytest.approx(x_amax, rel=1e-6)


class SharedOp(nnx.Module):
    """One `nnx.Linear` with an FP8 op applied twice (a weight-shared layer)."""

    def __init__(self, rngs: nnx.Rngs):
        self.l = nnx.Linear(8, 8, dot_general=Fp8DotGeneral(HISTORY), rngs=rngs)

    def __call__(self, x):
        return self.l(nnx.relu(self.l(x)))


def test_an_fp8_op_called_twice_keeps_the_larger_amax_not_the_sum():
    """Before: the two calls' new histories and scales were summed, doubling the history every step; the loss was 0.0
    by step 19 (everything flushed) and NaN by step 73. Now they combine by maximum (Flax's fp32_max_grad dtype)."""
    model = SharedOp(nnx.Rngs(0))
    opt = Optimizer(model, optax.sgd(0.0), policy="fp8", loss_scale=NoOpLossScale())  # weights fixed

    def shared_loss(model, x):
        return jnp.mean(jnp.square(model(x.astype(jnp.bfloat16)).astype(jnp.float32)))

    x = jax.random.normal(jax.random.key(1), (4, 8))
    for _ in range(30):
        metrics = train_step(model, opt, x, shared_loss)
    op = fp8_of(model, "l")
    kernel_amax = float(jnp.max(jnp.abs(model.l.kernel[...].astype(jnp.bfloat16))).astype(jnp.float32))
    assert float(op["kernel_amax_history"].max()) == kernel_amax
    assert op["kernel_scale"][0] == pytest.approx(kernel_amax / 448, rel=1e-6)
    x_amax = float(jnp.max(jnp.abs(x.astype(jnp.bfloat16))).astype(jnp.float32))
    # The larger of the two calls' input amax (the first call's: x), not their sum, which doubled every step.
    assert float(op["input_amax_history"].max()) == x_amax
    assert bool(metrics["grads_finite"]) and float(metrics["loss"]) > 0.1


class DropoutScale(nnx.Module):
    """y = dropout(1) * x * w: w's gradient is the sum of the kept inputs, so it shows each micro-batch's mask."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.ones(4))
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(jnp.ones_like(x)) * x * self.w[...]


@pytest.mark.slow
def test_nnx_grad_fidelity_with_accumulation_sees_the_masks_train_step_would_draw():
    """Before: every micro-batch of the recomputation reused the model's RNG counts, so micro-batch 2 drew micro-batch
    1's mask; train_step draws a new one per micro-batch."""
    from jaxamp import fidelity
    from jaxamp import nnx as jnnx

    model = DropoutScale(nnx.Rngs(0, dropout=1))
    opt = Optimizer(model, optax.sgd(1.0), policy="fp32", loss_scale=NoOpLossScale())

    def dropout_loss(model, x):
        return jnp.sum(model(x))

    x = jnp.arange(1.0, 9.0).reshape(2, 4)
    graphdef, trained, state, fp8, rest = jnnx._split(model, opt)  # pylint: disable=protected-access
    mixed, _ = fidelity.gradient_pair(state, x, jnnx._functional_loss(graphdef, dropout_loss, trained, fp8),
                                      accum_steps=2, carry=rest)
    errors = jnnx.grad_fidelity(model, opt, x, dropout_loss, accum_steps=2)
    w0 = np.asarray(model.w[...])
    train_step(model, opt, x, dropout_loss, accum_steps=2)
    np.testing.assert_array_equal(np.asarray(mixed["w"]), w0 - np.asarray(model.w[...]))  # sgd(1): the gradient
    assert float(errors["w"]) == 0.0  # fp32 against fp32: the same masks in both passes
    for bad, message in ((0, "accum_steps must be >= 1"), (2.0, "accum_steps must be an integer")):
        with pytest.raises(ValueError, match=message):
            jnnx.grad_fidelity(model, opt, x, dropout_loss, accum_steps=bad)
    with pytest.raises(ValueError, match="loss_fn must be a function"):
        jnnx.grad_fidelity(model, opt, x, 3)


class SummedEinsum(nnx.Module):
    """`"bij,jk->bk"`: jnp.einsum sums `i` out of the inputs before the FP8 dot_general quantizes them."""

    def __init__(self, rngs: nnx.Rngs):
        self.e = nnx.Einsum("bij,jk->bk", (8, 5), einsum_op=Fp8Einsum(HISTORY), rngs=rngs)

    def __call__(self, x):
        return self.e(x)


@pytest.mark.slow
def test_fp8_ranges_reads_what_the_fp8_dot_quantizes_and_refuses_what_it_cannot_see():
    from jaxamp.nnx import fp8_ranges, grad_fidelity

    model = SummedEinsum(nnx.Rngs(0))
    opt = Optimizer(model, optax.sgd(0.0), policy="fp8", loss_scale=NoOpLossScale())

    def summed_loss(model, x):
        return jnp.sum(model(x.astype(model.e.kernel.dtype)).astype(jnp.float32))

    x = jnp.full((2, 4, 8), 0.5)
    model.e.einsum_op.input_amax_history[...] = jnp.array([1.0, 0.0, 0.0, 0.0])  # capacity 1
    rows = {r["tensor"]: r for r in fp8_ranges(model, opt, x, summed_loss)}
    # The op quantizes the sum over i (4 x 0.5 = 2.0): all of it saturates at capacity 1 (it read 0.5 and 0% before).
    assert (rows["input"]["amax"], rows["input"]["capacity"], rows["input"]["saturated"]) == (2.0, 1.0, 1.0)
    train_step(model, opt, x, summed_loss)
    assert float(model.e.einsum_op.input_amax_history[0]) == 2.0  # what the op itself recorded

    layer = Fp8MLP(nnx.Rngs(0))
    layer_opt = Optimizer(layer, TX, policy="fp8", loss_scale=NoOpLossScale())

    def remat_loss(model, batch):
        y = nnx.remat(lambda m, x: m(x))(model, batch["x"].astype(jnp.bfloat16))
        return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"]))

    with pytest.raises(ValueError, match="inside a transform of loss_fn"):
        fp8_ranges(layer, layer_opt, make_batch(0), remat_loss)

    @nnx.jit
    def forward(model, x):
        return model(x)

    def jitted_loss(model, batch):
        return jnp.mean(jnp.square(forward(model, batch["x"].astype(model.l1.kernel.dtype)).astype(jnp.float32)
                                   - batch["y"]))

    train_step(layer, layer_opt, make_batch(0), jitted_loss)  # compiles forward with FP8 ops inside
    with pytest.raises(ValueError, match="inside a transform of loss_fn|where fp8_ranges can see it"):
        fp8_ranges(layer, layer_opt, make_batch(1), jitted_loss)  # an inner trace, or a cached one: no op reports
    # grad_fidelity's reference traces forward again (full-precision matmuls are part of jit's cache key), so its
    # FP8 ops are bypassed there: the same errors as with the layers called directly (before: exactly 0).
    direct = grad_fidelity(layer, layer_opt, make_batch(1), loss_fn)
    through_jit = grad_fidelity(layer, layer_opt, make_batch(1), jitted_loss)
    assert {k: float(v) for k, v in through_jit.items()} == pytest.approx(
        {k: float(v) for k, v in direct.items()}, rel=0.05)  # the jit boundary moves roundings a little
    assert min(float(v) for v in direct.values()) > 1e-3

    with pytest.raises(ValueError, match="outside jax.jit"):
        nnx.jit(lambda m: fp8_ranges(m, layer_opt, make_batch(1), loss_fn))(layer)


def test_load_train_state_refuses_a_state_that_does_not_fit_and_changes_nothing():
    """Before: a state of other shapes loaded silently (the next step then blamed the optimizer), and a failing one
    had already overwritten the model's Params and FP8 variables."""
    model, opt = fresh()
    train_step(model, opt, make_batch(0), loss_fn)
    other = nnx.Linear(8, 32, dot_general=Fp8DotGeneral(2 * HISTORY), rngs=nnx.Rngs(1))  # l1 with a longer history
    donor = Fp8MLP(nnx.Rngs(3))
    donor.l1 = other
    donor_opt = Optimizer(donor, TX, policy="fp8", loss_scale=NoOpLossScale())
    before = bits((nnx.state(model), nnx.state(opt)))
    with pytest.raises(ValueError, match=r"input_amax_history'\] is float32\[8\] but this model's is float32\[4\]"):
        opt.load_train_state(model, donor_opt.train_state(donor, whole_model=True))
    sgd_model = Fp8MLP(nnx.Rngs(0))
    sgd_opt = Optimizer(sgd_model, optax.sgd(0.1), policy="fp8", loss_scale=NoOpLossScale())
    with pytest.raises(ValueError, match=r"the state lacks opt_state\[0\]\.count, which this optax"):
        opt.load_train_state(model, sgd_opt.train_state(sgd_model, whole_model=True))
    adamw_model = Fp8MLP(nnx.Rngs(0))  # adamw's state holds adam's arrays in another chain
    adamw_opt = Optimizer(adamw_model, optax.adamw(1e-2), policy="fp8", loss_scale=NoOpLossScale())
    with pytest.raises(ValueError, match="same arrays in another structure"):
        opt.load_train_state(model, adamw_opt.train_state(adamw_model))
    with pytest.raises(ValueError, match=r"step is float32\[\] but this optimizer's is int32\[\]"):
        opt.load_train_state(model, opt.train_state(model).replace(step=jnp.float32(3.5)))
    dynamic_model, _ = fresh()
    dynamic = Optimizer(dynamic_model, TX, policy="fp16;fp8", loss_scale=DynamicLossScale())
    with pytest.raises(ValueError, match="loss scale is a DynamicLossScale"):
        opt.load_train_state(model, dynamic.train_state(dynamic_model, whole_model=True))
    assert bits((nnx.state(model), nnx.state(opt))) == before


def test_fp8_values_inside_loss_fn_aux_come_back_float32_and_arithmetic_on_them_is_one_error():
    model, opt = fresh()

    def aux_loss(model, batch):
        return loss_fn(model, batch), {"scale": model.l1.dot_general.input_scale[...]}

    aux = train_step(model, opt, make_batch(0), aux_loss)["aux"]["scale"]
    assert aux.dtype == jnp.float32 and np.asarray(aux).tolist() == [1.0]  # the scale the step used

    def read_loss(model, batch):
        return loss_fn(model, batch) + 0.0 * jnp.sum(model.l1.dot_general.input_scale[...])

    with pytest.raises(ValueError, match="used an FP8 scale or amax history as a number"):
        train_step(model, opt, make_batch(1), read_loss)
    plain = nnx.Linear(8, 1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="params hold no FP8 collection"):
        Optimizer(plain, TX, policy="fp8", loss_scale=NoOpLossScale())
