"""jaxamp.nnx: Flax NNX models through the functional step (BatchNorm, Dropout, loss scaling, checkpoints)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxamp import DynamicLossScale, NoOpLossScale, StaticLossScale, TrainState, get_policy
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


def counted(fn, counter):
    def wrapped(model, batch):
        counter[0] += 1
        return fn(model, batch)

    return wrapped


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
    assert len(set(scales)) >= 4 and max(scales) >= 2.0**15, scales
    assert seen_dtypes == {jnp.dtype(jnp.float32)}  # master weights after every step
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses
    assert int(opt.step[...]) == 30
    # Dropout drew from the model's own stream once per step, and is active: two train-mode passes differ.
    assert int(model.drop.rngs.count[...]) == 30
    x = make_batch(0)["x"][:8].astype(F16)
    with jax.numpy_dtype_promotion("standard"):
        params16 = jax.tree.map(lambda p: p.astype(F16), pure(nnx.state(model, nnx.Param)))
        probe = nnx.merge(nnx.graphdef(model), params16, pure(nnx.state(model, nnx.Not(nnx.Param))))
        a, b = probe(x), probe(x)
        probe.eval()
        c, d = probe(x), probe(x)
    assert not np.array_equal(np.asarray(a), np.asarray(b)) and np.array_equal(np.asarray(c), np.asarray(d))
    # BatchNorm's running statistics moved and stayed float32.
    assert model.bn.mean[...].dtype == jnp.float32
    assert np.abs(np.asarray(model.bn.mean[...]) - bn_mean0).max() > 1e-2


def snapshot(model, opt):
    """Host copies: (Params, optax state, BatchNorm statistics, RNG state)."""
    return (bits(nnx.state(model, nnx.Param)), bits(opt.opt_state), bits(nnx.state(model, nnx.BatchStat)),
            bits(nnx.state(model, nnx.RngState)))


def test_an_inf_batch_is_skipped_bitwise_and_backs_the_scale_off():
    model = make_model(bn_dtype=F16)
    opt = Optimizer(model, adam(), policy="fp16", loss_scale=DynamicLossScale(2.0**12))
    train_step(model, opt, make_batch(0), loss_fn)  # a normal step first: the optax state is not all zeros
    params, opt_state, stats, rng_state = snapshot(model, opt)
    metrics = train_step(model, opt, make_batch(1, poison=jnp.inf), loss_fn)
    assert not bool(metrics["grads_finite"]) and not bool(metrics["loss_finite"])
    after = snapshot(model, opt)
    assert after[0] == params and after[1] == opt_state  # Params and optax state: bitwise unchanged
    assert after[2] == stats  # BatchNorm saw inf: its non-finite new statistics are not kept
    assert after[3] != rng_state and int(model.drop.rngs.count[...]) == 2  # the step consumed its randomness
    assert float(opt.train_state(model).loss_scale.loss_scale) == 2.0**11 and int(opt.step[...]) == 2
    metrics = train_step(model, opt, make_batch(2), loss_fn)  # and training goes on
    assert bool(metrics["grads_finite"]) and float(metrics["loss_scale"]) == 2.0**11


def test_a_gradient_overflow_skips_the_update_but_keeps_batchnorm_statistics_as_torch_amp():
    model = make_model(bn_dtype=F16)
    opt = Optimizer(model, adam(), policy="fp16", loss_scale=StaticLossScale(2.0**24))  # float16 grads overflow
    params, opt_state, stats, _ = snapshot(model, opt)
    metrics = train_step(model, opt, make_batch(0), loss_fn)
    assert bool(metrics["loss_finite"]) and not bool(metrics["grads_finite"])
    after = snapshot(model, opt)
    assert after[0] == params and after[1] == opt_state
    assert after[2] != stats  # the forward pass ran: its statistics are kept (torch.amp keeps them too)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model, nnx.BatchStat)))


def test_a_retried_batch_draws_the_same_dropout_masks():
    """The retry's final attempt equals a plain step at the scale it ended at, from the same model state."""
    retried, direct = make_model(bn_dtype=F16, dropout=0.5), make_model(bn_dtype=F16, dropout=0.5)
    opt_r = Optimizer(retried, adam(), policy="fp16", loss_scale=DynamicLossScale(2.0**24))
    metrics = train_step(retried, opt_r, make_batch(0), loss_fn, on_overflow="retry", max_retries=8)
    assert bool(metrics["grads_finite"]) and int(metrics["retries"]) >= 1
    final_scale = float(metrics["loss_scale"])
    opt_d = Optimizer(direct, adam(), policy="fp16", loss_scale=DynamicLossScale(final_scale))
    reference = train_step(direct, opt_d, make_batch(0), loss_fn)
    assert bool(reference["grads_finite"])
    # The loss depends on the dropout masks; the RNG count advanced once, not once per attempt.
    assert np.asarray(metrics["loss"]).tobytes() == np.asarray(reference["loss"]).tobytes()
    assert int(retried.drop.rngs.count[...]) == int(direct.drop.rngs.count[...]) == 1
    assert bits(nnx.state(retried, nnx.BatchStat)) == bits(nnx.state(direct, nnx.BatchStat))
    for a, b in zip(jax.tree.leaves(pure(nnx.state(retried, nnx.Param))),
                    jax.tree.leaves(pure(nnx.state(direct, nnx.Param)))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_accumulation_runs_the_micro_batches_in_order():
    """accum_steps=2: one update, one scale adjustment, and the model state threaded through both micro-batches."""
    model, ref = make_model(bn_dtype=F16), make_model(bn_dtype=F16)
    opt = Optimizer(model, adam(), policy="fp16", loss_scale=DynamicLossScale(2.0**10))
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
    for a, b in zip(jax.tree.leaves(pure(nnx.state(ours))), jax.tree.leaves(pure(nnx.state(plain)))):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(pure(opt.opt_state)), jax.tree.leaves(pure(plain_opt.opt_state))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)
