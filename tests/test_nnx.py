"""jaxamp.nnx: Flax NNX models through the functional step (BatchNorm, Dropout, loss scaling, checkpoints)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from asserts import assert_trees_close
from flax import nnx

from jaxamp import DynamicLossScale, NoOpLossScale, TrainState
from jaxamp import train_step as functional_train_step
from jaxamp.checkpoint import Checkpointer
from jaxamp.nnx import Optimizer, train_step

F16 = jnp.float16


class MLP(nnx.Module):
    """Linear -> BatchNorm -> relu -> Dropout -> Linear; computes in the dtype its inputs and params arrive in."""

    def __init__(self, rngs: nnx.Rngs, *, dropout: float = 0.1, bn_dtype=None, width: int = 32):
        self.l1 = nnx.Linear(4, width, use_bias=False, rngs=rngs)  # BatchNorm follows: a bias would cancel
        self.bn = nnx.BatchNorm(width, dtype=bn_dtype, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.l2 = nnx.Linear(width, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def make_model(seed=0, **kwargs):
    return MLP(nnx.Rngs(seed, dropout=seed + 1), **kwargs)


def make_batch(i=0, n=64, poison=1.0):
    x = jax.random.normal(jax.random.key(100 + i), (n, 4))
    y = jnp.stack([x[:, 0] * x[:, 1], jnp.sin(x[:, 2])], axis=1)
    return {"x": x * jnp.float32(poison), "y": y}


def loss_fn(model, batch):
    """Squared error in float32 of the model run on inputs cast to its first kernel's (the compute) dtype."""
    x = batch["x"].astype(model.l1.kernel.dtype)
    with jax.numpy_dtype_promotion("standard"):  # Flax's BatchNorm promotes its float32 statistics itself
        out = model(x)
    return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)


def bits(tree):
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x).tobytes()
            for x in jax.tree.leaves(tree)]


def pure(tree):
    return nnx.as_pure(tree)


def adam():
    return optax.adam(1e-2)


TX = optax.adamw(1e-2, weight_decay=0.1)  # one object: steps of equal models, optimizers and loss_fn share a compile


def fresh(seed=0, scale=2.0**10):
    """A float16-BatchNorm MLP and its fp16 Optimizer (TX, a DynamicLossScale with growth every 2 steps)."""
    model = make_model(seed, bn_dtype=F16)
    return model, Optimizer(model, TX, policy="fp16", loss_scale=DynamicLossScale(scale, growth_interval=2))


def counted(fn, counter):
    def wrapped(model, batch):
        counter[0] += 1
        return fn(model, batch)

    return wrapped


@pytest.mark.slow
def test_fp16_training_with_batchnorm_and_dropout_under_nnx_jit():
    model = make_model(bn_dtype=F16)
    opt = Optimizer(model, adam(), policy="fp16", loss_scale=DynamicLossScale(2.0**10, growth_interval=4))
    traces = [0]
    counted_loss = counted(loss_fn, traces)

    @nnx.jit(donate_argnames=("model", "opt"))
    def step(model, opt, batch):
        return train_step(model, opt, batch, counted_loss)

    seen_dtypes, losses, scales = set(), [], []
    bn_mean0 = np.asarray(model.bn.mean[...]).copy()
    for i in range(30):
        metrics = step(model, opt, make_batch(i % 6))
        losses.append(float(metrics["loss"]))
        scales.append(float(metrics["loss_scale"]))
        seen_dtypes |= {x.dtype for x in jax.tree.leaves(pure(nnx.state(model, nnx.Param)))}
    assert traces[0] == 1, f"loss_fn traced {traces[0]} times"  # the scale changed, the trace did not
    for i in range(8):  # the same step called directly (its own jitted fast path), the scale still changing
        scales.append(float(train_step(model, opt, make_batch(i % 6), counted_loss)["loss_scale"]))
    assert traces[0] == 1 and len(set(scales[-8:])) >= 2, (traces, scales[-8:])
    assert len(set(scales)) >= 4 and max(scales) >= 2.0**15, scales
    assert seen_dtypes == {jnp.dtype(jnp.float32)}  # master weights after every step
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses
    assert int(opt.step[...]) == 38
    # Dropout drew from the model's own stream once per step, and is active: two train-mode passes differ.
    assert int(model.drop.rngs.count[...]) == 38
    forward = nnx.jit(lambda model, x: model(x))
    x = make_batch(0)["x"][:8]
    with jax.numpy_dtype_promotion("standard"):
        a, b = forward(model, x), forward(model, x)
        model.eval()
        c, d = forward(model, x), forward(model, x)
    assert not np.array_equal(np.asarray(a), np.asarray(b)) and np.array_equal(np.asarray(c), np.asarray(d))
    # BatchNorm's running statistics moved and stayed float32.
    assert model.bn.mean[...].dtype == jnp.float32
    assert np.abs(np.asarray(model.bn.mean[...]) - bn_mean0).max() > 1e-2


def snapshot(model, opt):
    """Host copies: (Params, optax state, BatchNorm statistics, RNG state)."""
    return (bits(nnx.state(model, nnx.Param)), bits(opt.opt_state), bits(nnx.state(model, nnx.BatchStat)),
            bits(nnx.state(model, nnx.RngState)))


@pytest.mark.slow
def test_an_inf_batch_is_skipped_bitwise_and_leaves_the_scale_alone():
    """A non-finite loss (an inf batch): skipped bitwise; no scale fixes the inputs, so the scale is left alone."""
    model, opt = fresh(scale=2.0**12)
    train_step(model, opt, make_batch(0), loss_fn)  # a normal step first: the optax state is not all zeros
    params, opt_state, stats, rng_state = snapshot(model, opt)
    metrics = train_step(model, opt, make_batch(1, poison=jnp.inf), loss_fn)
    assert not bool(metrics["grads_finite"]) and not bool(metrics["loss_finite"])
    after = snapshot(model, opt)
    assert after[0] == params and after[1] == opt_state  # Params and optax state: bitwise unchanged
    assert after[2] == stats  # BatchNorm saw inf: its non-finite new statistics are not kept
    assert after[3] != rng_state and int(model.drop.rngs.count[...]) == 2  # the step consumed its randomness
    assert float(opt.train_state(model).loss_scale.loss_scale) == 2.0**12 and int(opt.step[...]) == 2
    assert int(metrics["consecutive_skips"]) == 1 and int(opt.consecutive_skips[...]) == 1
    metrics = train_step(model, opt, make_batch(2), loss_fn)  # and training goes on
    assert bool(metrics["grads_finite"]) and float(metrics["loss_scale"]) == 2.0**12
    assert int(opt.consecutive_skips[...]) == 0


@pytest.mark.slow
def test_a_gradient_overflow_skips_the_update_but_keeps_batchnorm_statistics_as_torch_amp():
    model, opt = fresh(scale=2.0**24)  # float16 gradients overflow, the forward pass does not
    params, opt_state, stats, _ = snapshot(model, opt)
    metrics = train_step(model, opt, make_batch(0), loss_fn)
    assert bool(metrics["loss_finite"]) and not bool(metrics["grads_finite"])
    after = snapshot(model, opt)
    assert after[0] == params and after[1] == opt_state
    assert after[2] != stats  # the forward pass ran: its statistics are kept (torch.amp keeps them too)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model, nnx.BatchStat)))


@pytest.mark.slow
def test_a_retried_batch_draws_the_same_dropout_masks():
    """The retry's final attempt equals a plain step at the scale it ended at, from the same model state."""
    retried, opt_r = fresh(scale=2.0**24)
    metrics = train_step(retried, opt_r, make_batch(0), loss_fn, on_overflow="retry", max_retries=8)
    assert bool(metrics["grads_finite"]) and int(metrics["retries"]) >= 1
    final_scale = float(metrics["loss_scale"])
    direct, opt_d = fresh(scale=final_scale)
    reference = train_step(direct, opt_d, make_batch(0), loss_fn)
    assert bool(reference["grads_finite"])
    # The loss depends on the dropout masks; the RNG count advanced once, not once per attempt.
    assert np.asarray(metrics["loss"]).tobytes() == np.asarray(reference["loss"]).tobytes()
    assert int(retried.drop.rngs.count[...]) == int(direct.drop.rngs.count[...]) == 1
    assert bits(nnx.state(retried, nnx.BatchStat)) == bits(nnx.state(direct, nnx.BatchStat))
    assert_trees_close(pure(nnx.state(retried, nnx.Param)), pure(nnx.state(direct, nnx.Param)), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_accumulation_runs_the_micro_batches_in_order():
    """accum_steps=2: one update, one scale adjustment, and the model state threaded through both micro-batches."""
    (model, opt), ref = fresh(), make_model(bn_dtype=F16)
    metrics = train_step(model, opt, make_batch(0, n=64), loss_fn, accum_steps=2)
    assert bool(metrics["grads_finite"]) and int(opt.step[...]) == 1
    assert int(model.drop.rngs.count[...]) == 2  # each micro-batch drew its own masks
    # BatchNorm statistics: exactly two forward passes of the reference model over the strided micro-batches.
    batch = make_batch(0, n=64)
    with jax.numpy_dtype_promotion("standard"):
        params16 = jax.tree.map(lambda p: p.astype(F16), pure(nnx.state(ref, nnx.Param)))
        nnx.update(ref, params16)
        for i in range(2):
            ref(batch["x"][i::2].astype(F16))
    np.testing.assert_allclose(np.asarray(model.bn.mean[...]), np.asarray(ref.bn.mean[...]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(model.bn.var[...]), np.asarray(ref.bn.var[...]), rtol=1e-6)


@pytest.mark.slow
def test_fp32_noop_equals_nnx_optimizer_and_value_and_grad():
    ours, plain = make_model(), make_model()
    opt = Optimizer(ours, adam(), policy="fp32", loss_scale=NoOpLossScale())
    with jax.numpy_dtype_promotion("standard"):  # optax itself is not strict-promotion clean
        plain_opt = nnx.Optimizer(plain, adam(), wrt=nnx.Param)

    @nnx.jit
    def plain_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        with jax.numpy_dtype_promotion("standard"):
            optimizer.update(model, grads)
        return loss

    @nnx.jit
    def our_step(model, opt, batch):
        return train_step(model, opt, batch, loss_fn)

    for i in range(3):
        loss = plain_step(plain, plain_opt, make_batch(i))
        metrics = our_step(ours, opt, make_batch(i))
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
    assert_trees_close(pure(nnx.state(ours)), pure(nnx.state(plain)), rtol=2e-5, atol=1e-6)  # PRNG keys: their data
    # Our optimizer state holds the moments as dicts, nnx.Optimizer's as nnx.State: the same paths.
    assert_trees_close(pure(opt.opt_state), pure(plain_opt.opt_state), rtol=2e-5, atol=1e-7, check_node_types=False)


def run_steps(model, opt, start, n):
    for i in range(start, start + n):
        train_step(model, opt, make_batch(i % 6), loss_fn)


@pytest.mark.slow
def test_orbax_and_jaxamp_checkpointer_round_trips_continue_bitwise(tmp_path):
    model, opt = fresh(0)
    run_steps(model, opt, 0, 3)
    saver = ocp.StandardCheckpointer()
    saver.save(tmp_path / "model", nnx.state(model))
    saver.save(tmp_path / "opt", nnx.state(opt))
    saver.wait_until_finished()
    with Checkpointer(tmp_path / "jaxamp") as ckpt:
        assert ckpt.save(opt.train_state(model, whole_model=True), {"run": "nnx"})
    run_steps(model, opt, 3, 3)
    expected = bits((nnx.state(model), nnx.state(opt)))

    model_b, opt_b = fresh(7)  # other weights, other RNG seeds: everything must come from the checkpoint
    nnx.update(model_b, saver.restore(tmp_path / "model", nnx.state(model_b)))
    nnx.update(opt_b, saver.restore(tmp_path / "opt", nnx.state(opt_b)))
    run_steps(model_b, opt_b, 3, 3)
    assert bits((nnx.state(model_b), nnx.state(opt_b))) == expected

    model_c, opt_c = fresh(8)
    state, config = Checkpointer(tmp_path / "jaxamp").restore(opt_c.train_state(model_c, whole_model=True))
    assert config == {"run": "nnx"} and int(state.step) == 3
    opt_c.load_train_state(model_c, state)
    run_steps(model_c, opt_c, 3, 3)
    assert bits((nnx.state(model_c), nnx.state(opt_c))) == expected


@pytest.mark.slow
@pytest.mark.parametrize("how", ["wrt", "trainable"])
def test_a_frozen_sub_module_stays_bitwise_unchanged(how):
    model = make_model(bn_dtype=F16)
    if how == "wrt":  # l1 outside the optimizer: not cast, not differentiated, no optimizer state
        opt = Optimizer(model, adam(), policy="fp16", loss_scale=DynamicLossScale(2.0**10),
                        wrt=nnx.All(nnx.Param, nnx.Not(nnx.PathContains("l1"))))
    else:  # l1 in the compute dtype, not differentiated, no optimizer state (TrainState.create's rule)
        opt = Optimizer(model, adam(), policy="fp16", loss_scale=DynamicLossScale(2.0**10),
                        trainable={"bn": True, "l1": False, "l2": True})
    seen = []

    def spy_loss(model, batch):
        seen.append(model.l1.kernel.dtype)
        return loss_fn(model, batch)

    frozen, trained = bits(nnx.state(model.l1)), bits(nnx.state(model.l2))
    for i in range(3):
        metrics = train_step(model, opt, make_batch(i), spy_loss)
        assert bool(metrics["grads_finite"])
    assert bits(nnx.state(model.l1)) == frozen and bits(nnx.state(model.l2)) != trained
    assert seen == [jnp.dtype(jnp.float32 if how == "wrt" else F16)]  # one trace
    state = opt.train_state(model)
    assert ("l1" in state.params) == (how == "trainable")
    mu = state.opt_state[0].mu
    assert mu.get("l1") is None or jax.tree.leaves(mu["l1"]) == []  # no optimizer state for the frozen part
    assert jax.tree.leaves(metrics["grads_finite_leaves"].get("l1", {})) == []


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm(name="norm")(nn.relu(nn.Dense(32, name="l1")(x)))
        return nn.Dense(2, name="l2")(x)


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.norm, self.l2 = nnx.Linear(4, 32, rngs=rngs), nnx.LayerNorm(32, rngs=rngs), nnx.Linear(32, 2,
                                                                                                           rngs=rngs)

    def __call__(self, x):
        return self.l2(self.norm(nnx.relu(self.l1(x))))


def linen_loss(params, batch, rng):
    del rng
    with jax.numpy_dtype_promotion("standard"):  # Flax's LayerNorm promotes to float32 for its statistics
        out = LinenMLP().apply({"params": params}, batch["x"].astype(params["l1"]["kernel"].dtype))
    return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)


def nnx_loss(model, batch):
    with jax.numpy_dtype_promotion("standard"):
        out = model(batch["x"].astype(model.l1.kernel.dtype))
    return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)


@pytest.mark.slow
def test_the_same_weights_as_linen_and_nnx_give_the_same_fp16_losses():
    params = LinenMLP().init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    model = NnxMLP(nnx.Rngs(1))
    nnx.update(model, params)  # the same weights: linen's names are the NNX attribute names here
    assert bits(nnx.state(model, nnx.Param)) == bits(params)
    state = TrainState.create(params=params, tx=TX, policy="fp16", loss_scale=DynamicLossScale(2.0**14),
                              rng=jax.random.key(0))
    opt = Optimizer(model, TX, policy="fp16", loss_scale=DynamicLossScale(2.0**14))
    step = jax.jit(functional_train_step, static_argnames="loss_fn")
    for i in range(5):
        state, linen_metrics = step(state, make_batch(i), linen_loss)
        nnx_metrics = train_step(model, opt, make_batch(i), nnx_loss)
        assert float(nnx_metrics["loss"]) == float(linen_metrics["loss"]), i
        assert float(nnx_metrics["loss_scale"]) == float(linen_metrics["loss_scale"])
    assert_trees_close(pure(nnx.state(model, nnx.Param)), state.params, rtol=1e-6, atol=1e-7,
                       check_node_types=False)  # an nnx.State against linen's dict: the same paths


@pytest.mark.slow
def test_metrics_have_the_functional_steps_keys_and_shapes():
    options = dict(on_overflow="retry", underflow_stats=True)
    params = LinenMLP().init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    state = TrainState.create(params=params, tx=TX, policy="fp16", loss_scale=DynamicLossScale(2.0**14),
                              rng=jax.random.key(0))
    model = NnxMLP(nnx.Rngs(1))
    opt = Optimizer(model, TX, policy="fp16", loss_scale=DynamicLossScale(2.0**14))

    def with_aux(loss):
        return lambda *args: (loss(*args), {"n": jnp.ones((3,))})

    _, expected = jax.jit(functional_train_step, static_argnames=("loss_fn", *options))(
        state, make_batch(0), with_aux(linen_loss), **options)
    metrics = train_step(model, opt, make_batch(0), with_aux(nnx_loss), **options)
    assert sorted(metrics) == sorted(expected)
    assert jax.tree.structure(metrics) == jax.tree.structure(expected)  # per-leaf trees keyed by path
    assert [x.shape for x in jax.tree.leaves(metrics)] == [x.shape for x in jax.tree.leaves(expected)]


@pytest.mark.slow
def test_bad_inputs_get_one_line_errors_that_name_the_fix():
    model = make_model()
    kw = dict(policy="fp16", loss_scale=DynamicLossScale())
    with pytest.raises(ValueError, match="flax.nnx Module.*linen model use jaxamp.TrainState"):
        Optimizer(pure(nnx.state(model, nnx.Param)), adam(), **kw)
    with pytest.raises(ValueError, match="selects no variable.*nnx.Param"):
        Optimizer(model, adam(), wrt=nnx.PathContains("decoder"), **kw)
    with pytest.raises(ValueError, match=r"selects \['drop'\]\['rngs'\]\['count'\] of dtype uint32.*narrow wrt"):
        Optimizer(model, adam(), wrt=nnx.Variable, **kw)
    with pytest.raises(ValueError, match="trainable freezes every params leaf"):
        Optimizer(model, adam(), trainable=False, **kw)
    opt = Optimizer(model, adam(), **kw)
    with pytest.raises(ValueError, match="jaxamp.nnx.Optimizer"):
        with jax.numpy_dtype_promotion("standard"):
            train_step(model, nnx.Optimizer(model, adam(), wrt=nnx.Param), make_batch(0), loss_fn)
    with pytest.raises(ValueError, match="do not match this Optimizer"):
        train_step(NnxMLP(nnx.Rngs(0)), opt, make_batch(0), nnx_loss)
    with pytest.raises(TypeError, match=r"jaxamp.nnx calls loss_fn\(model, batch\), but .*cannot take it"):
        train_step(model, opt, make_batch(0), lambda model, batch, rng: nnx_loss(model, batch))
    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])

    stack = Stack(nnx.Rngs(0))
    assert Optimizer(stack, adam(), trainable={"layers": {0: False, 1: True}}, **kw).trainable is not None
    with pytest.raises(ValueError, match=r"trainable has key '0'.*keyed by int: write 0$"):
        Optimizer(stack, adam(), trainable={"layers": {"0": False, "1": True}}, **kw)
    with pytest.raises(ValueError, match=r"trainable has a list where params have a dict keyed \[0, 1\]"):
        Optimizer(stack, adam(), trainable={"layers": [False, True]}, **kw)
    wide = nnx.Linear(4, 8, rngs=nnx.Rngs(0))  # the same tree as a Linear(4, 4), other shapes
    with pytest.raises(ValueError, match="do not match this Optimizer"):
        train_step(wide, Optimizer(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), adam(), **kw), jnp.ones((2, 4)),
                   lambda m, x: jnp.mean(m(x.astype(m.kernel.dtype)).astype(jnp.float32)))

    def growing_loss(model, batch):
        model.l2.seen = nnx.BatchStat(batch["x"])
        return loss_fn(model, batch)

    with pytest.raises(ValueError, match=r"changed the structure of the model's state.*new attribute"):
        train_step(model, opt, make_batch(0), growing_loss)
    before = bits(nnx.state(model))
    with pytest.raises(ValueError, match="on_overflow"):
        train_step(model, opt, make_batch(0), loss_fn, on_overflow="retyr")
    assert bits(nnx.state(model)) == before  # a refused step changes nothing


class TiedMLP(nnx.Module):
    """Two layers that share one kernel (a shared nnx.Variable, as a tied embedding and output head are)."""

    def __init__(self, rngs):
        self.a, self.b = nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)
        self.b.kernel = self.a.kernel

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def tied_loss(model, batch):
    out = model(batch["x"].astype(model.a.kernel.dtype)).astype(jnp.float32)
    return jnp.mean((out[:, :2] - batch["y"]) ** 2)


class ScaledLinear(nnx.Module):
    """A Linear times a plain array attribute (no nnx.Variable around it; NNX treats it as data)."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 2, rngs=rngs)
        self.gain = jnp.array([2.0, 0.5])

    def __call__(self, x):
        return self.lin(x) * self.gain.astype(x.dtype)


def test_a_plain_array_attribute_trains_like_plain_nnx():
    """Input that failed: a model holding `self.gain = jnp.array(...)` (no Variable) made train_step raise
    AttributeError ('ArrayImpl' object has no attribute 'get_raw_value') on the first call."""
    def linear_loss(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    ours, plain = ScaledLinear(nnx.Rngs(0)), ScaledLinear(nnx.Rngs(0))
    opt = Optimizer(ours, optax.sgd(0.1), policy="fp32", loss_scale=NoOpLossScale())
    plain_opt = nnx.Optimizer(plain, optax.sgd(0.1), wrt=nnx.Param)
    for i in range(3):
        metrics = train_step(ours, opt, make_batch(i), linear_loss)
        loss, grads = nnx.value_and_grad(linear_loss)(plain, make_batch(i))
        plain_opt.update(plain, grads)
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ours.lin.kernel[...]), np.asarray(plain.lin.kernel[...]), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(ours.gain), np.array([2.0, 0.5], np.float32))  # written back as it was
    assert int(opt.step[...]) == 3


@pytest.mark.slow
def test_a_shared_variable_trains_once_and_donation_gives_the_same_step():
    ours, plain, donated = TiedMLP(nnx.Rngs(0)), TiedMLP(nnx.Rngs(0)), TiedMLP(nnx.Rngs(0))
    opt = Optimizer(ours, adam(), policy="fp32", loss_scale=NoOpLossScale())
    opt_d = Optimizer(donated, adam(), policy="fp32", loss_scale=NoOpLossScale())
    assert len(jax.tree.leaves(opt.opt_state[0].mu)) == 3  # the shared kernel has one optimizer state
    with jax.numpy_dtype_promotion("standard"):
        plain_opt = nnx.Optimizer(plain, adam(), wrt=nnx.Param)
    for i in range(2):
        train_step(ours, opt, make_batch(i), tied_loss)
        old_kernel = donated.a.kernel.get_value()
        train_step(donated, opt_d, make_batch(i), tied_loss, donate=True)
        assert old_kernel.is_deleted() and not donated.a.kernel.get_value().is_deleted()
        grads = nnx.grad(tied_loss)(plain, make_batch(i))
        with jax.numpy_dtype_promotion("standard"):
            plain_opt.update(plain, grads)
    assert ours.b.kernel is ours.a.kernel  # still one variable
    assert bits(nnx.state(donated)) == bits(nnx.state(ours)) and bits(opt_d.opt_state) == bits(opt.opt_state)
    assert_trees_close(pure(nnx.state(ours)), pure(nnx.state(plain)), rtol=1e-5, atol=1e-7)


def test_the_optimizer_makes_float32_master_weights_and_builds_under_eval_shape():
    layer = nnx.Linear(4, 2, param_dtype=F16, rngs=nnx.Rngs(0))
    Optimizer(layer, adam(), policy="fp16", loss_scale=DynamicLossScale())
    assert layer.kernel.dtype == jnp.float32 and layer.bias.dtype == jnp.float32
    model = make_model()
    before = bits(nnx.state(model))
    abstract = nnx.eval_shape(lambda: Optimizer(model, adam(), policy="fp16", loss_scale=DynamicLossScale()))
    assert bits(nnx.state(model)) == before  # an abstract optimizer (an orbax restore target) leaves the model be
    leaves = jax.tree.leaves(nnx.state(abstract))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


class UnhashableConfig:
    """A config with `__eq__` and no `__hash__`, as transformers' `PretrainedConfig` (kept by SkyRL's NNX Qwen3)."""
    width = 16

    def __eq__(self, other):
        return isinstance(other, UnhashableConfig)


class Configured(nnx.Module):
    def __init__(self, config, rngs):
        self.config = config
        self.l1 = nnx.Linear(config.width, config.width, rngs=rngs)
        self.head = nnx.Linear(config.width, 4, rngs=rngs)
        self.tied = self.l1  # a shared submodule: the step takes the NNX graph path, its GraphDef static

    def __call__(self, x):
        return self.head(jax.nn.relu(self.tied(self.l1(x))))


def test_a_model_holding_an_unhashable_config_steps_evaluates_and_measures_fidelity_with_one_compile_each():
    """An NNX model whose static attributes do not hash made every jitted helper fail ("Non-hashable static
    arguments", its GraphDef a static argument): train_step on the graph path, eval_step, grad_fidelity,
    fidelity_report. Each compiles once over several calls (a new, equal GraphDef each call)."""
    import jaxamp.nnx as jnnx

    model = Configured(UnhashableConfig(), nnx.Rngs(0))
    opt = Optimizer(model, optax.adam(1e-3), policy="bf16;autocast", loss_scale=NoOpLossScale())
    batch = (jnp.ones((8, 16)), jnp.arange(8) % 4)
    traces = []

    def loss_fn(model, batch):
        traces.append(1)
        return optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1]).mean()

    for call, loss_traces in ((lambda: train_step(model, opt, batch, loss_fn), 1),
                              (lambda: jnnx.eval_step(model, opt, batch, loss_fn), 1),
                              (lambda: jnnx.grad_fidelity(model, opt, batch, loss_fn), 2),  # and its reference
                              (lambda: jnnx.fidelity_report(model, opt, batch, loss_fn), 2)):
        traces.clear()
        results = [call() for _ in range(3)]
        assert len(traces) == loss_traces, len(traces)  # one compile
        assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(results[-1]))
    assert int(opt.step) == 3
