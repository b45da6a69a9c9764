"""jaxamp.nnx inside the loops of Flax's own examples: eval_step, nnx.Rngs passed to the forward, shardings kept on a
mesh (one compile), and BatchNorm evaluated with running variances above float16's range."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxamp import DynamicLossScale, StaticLossScale
from jaxamp.nnx import Optimizer, eval_step, train_step

REPO = Path(__file__).resolve().parents[1]


class BnNet(nnx.Module):
    """Linear -> BatchNorm -> Dropout -> Linear, ordinary float32 NNX code (no dtype= anywhere)."""

    def __init__(self, rngs: nnx.Rngs, cast_after_bn: bool = False):
        self.l1 = nnx.Linear(4, 16, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.l2 = nnx.Linear(16, 2, rngs=rngs)
        self.cast_after_bn = cast_after_bn

    def __call__(self, x):
        h = self.l1(x)
        normed = self.bn(h)
        if self.cast_after_bn:  # the cast-policy recipe: BatchNorm float32, its output cast to the compute dtype
            normed = normed.astype(h.dtype)
        return self.l2(self.drop(nnx.relu(normed)))


def bn_loss(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x).astype(jnp.float32), y).mean()


def bn_batch(i: int, scale: float = 1.0):
    kx, ky = jax.random.split(jax.random.key(100 + i))
    return jax.random.normal(kx, (32, 4)) * scale, jax.random.randint(ky, (32,), 0, 2)


def host_state(model) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                                                else x)
            for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]}


def float32_eval(model, x) -> np.ndarray:
    """The model's eval-mode output in float32: a float32 copy of its state, no casts, no autocast."""
    ref = BnNet(nnx.Rngs(0))
    nnx.update(ref, nnx.state(model))
    ref.eval()
    with jax.numpy_dtype_promotion("standard"):
        return np.asarray(ref(x))


@pytest.mark.parametrize("policy", ["fp16;autocast", "fp16"])
def test_batchnorm_evaluates_correctly_with_running_variance_above_float16_range(policy):
    """Inputs of scale 600: BatchNorm's running variance reaches ~2.4e5 (float16's largest finite is 65504). Evaluated
    in eval mode, the output matches float32 evaluation to float16 rounding, under autocast (the model unchanged) and
    under a cast policy with BatchNorm float32 and a cast after it."""
    autocast = policy.endswith("autocast")
    model = BnNet(nnx.Rngs(0), cast_after_bn=not autocast)
    opt = Optimizer(model, optax.sgd(1e-3), policy=policy, loss_scale=StaticLossScale(1.0))
    loss = bn_loss if autocast else (lambda m, b: bn_loss(m, (b[0].astype(jnp.float16), b[1])))
    with jax.numpy_dtype_promotion("standard"):  # Flax's BatchNorm mixes its float32 statistics in itself
        for i in range(40):
            metrics = train_step(model, opt, bn_batch(i, scale=600.0), loss)
            assert bool(metrics["grads_finite"])
    running_var = np.asarray(model.bn.var.get_value())
    assert running_var.dtype == np.float32 and running_var.max() > 1.5e5, running_var.max()
    model.eval()
    x, y = bn_batch(99, scale=600.0)
    want = float32_eval(model, x)
    with jax.numpy_dtype_promotion("standard"):
        if autocast:
            import jaxamp
            got = np.asarray(jaxamp.autocast(lambda m, x: m(x), jnp.float16)(model, x)).astype(np.float32)
        else:
            cast = BnNet(nnx.Rngs(0), cast_after_bn=True)
            nnx.update(cast, nnx.state(model))
            cast.eval()
            cast.l1.kernel.set_value(cast.l1.kernel.get_value().astype(jnp.float16))
            cast.l2.kernel.set_value(cast.l2.kernel.get_value().astype(jnp.float16))
            cast.l2.bias.set_value(cast.l2.bias.get_value().astype(jnp.float16))
            got = np.asarray(cast(x.astype(jnp.float16))).astype(np.float32)
        evaluated = float(eval_step(model, opt, (x, y) if autocast else (x, y), loss)["loss"])
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert np.isfinite(got).all() and rel < 5e-3, rel  # Flax's BatchNorm(dtype=float16) gives ~0.5 here
    want_loss = float(optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(want), y).mean())
    assert abs(evaluated - want_loss) < 1e-2 * max(1.0, abs(want_loss)), (evaluated, want_loss)


def test_eval_step_is_train_steps_loss_in_eval_mode_and_changes_nothing():
    model = BnNet(nnx.Rngs(0, dropout=1))
    opt = Optimizer(model, optax.adam(1e-2), policy="bf16;autocast", loss_scale=DynamicLossScale(2.0**10))
    with jax.numpy_dtype_promotion("standard"):
        for i in range(3):
            train_step(model, opt, bn_batch(i), bn_loss)
        model.eval()
        before, opt_before = host_state(model), host_state(opt)
        first = eval_step(model, opt, bn_batch(7), bn_loss)
        again = eval_step(model, opt, bn_batch(7), bn_loss)
    assert set(first) == {"loss"} and first["loss"].dtype == jnp.float32
    assert float(first["loss"]) == float(again["loss"])  # no dropout, running statistics: deterministic
    after, opt_after = host_state(model), host_state(opt)
    assert before.keys() == after.keys() and opt_before.keys() == opt_after.keys()
    assert all(np.array_equal(before[k], after[k]) for k in before)  # statistics and RNG counts untouched
    assert all(np.array_equal(opt_before[k], opt_after[k]) for k in opt_before)
    x, y = bn_batch(7)
    want = float(optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(float32_eval(model, x)), y).mean())
    assert abs(float(first["loss"]) - want) < 2e-2 * max(1.0, want), (float(first["loss"]), want)  # bf16 matmuls


class TutorialMLP(nnx.Module):
    """The NNX MNIST tutorial's form: the forward takes `rngs`."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(4, 2, rngs=rngs)
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs: nnx.Rngs):
        return self.l1(self.drop(x, rngs=rngs))


def test_an_rngs_from_outside_is_refused_in_one_line_and_a_key_in_the_batch_works():
    model = TutorialMLP(nnx.Rngs(0))
    opt = Optimizer(model, optax.sgd(0.1), policy="bf16;autocast", loss_scale=StaticLossScale(1.0))
    outside = nnx.Rngs(dropout=1)

    def outside_loss(model, batch):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(model(x, rngs=outside), y).mean()

    with pytest.raises(ValueError) as err:
        train_step(model, opt, bn_batch(0), outside_loss)
    message = str(err.value)
    assert "\n" not in message and message.startswith("loss_fn uses an nnx.Rngs that the model does not hold")
    assert "self.rngs = rngs" in message and "a key in the batch" in message  # the patterns that work

    def keyed_loss(model, batch):
        x, y, key = batch
        return optax.softmax_cross_entropy_with_integer_labels(model(x, rngs=nnx.Rngs(dropout=key)), y).mean()

    x, y = bn_batch(0)
    losses = {}
    for seed in (0, 0, 1):
        probe = TutorialMLP(nnx.Rngs(0))
        probe_opt = Optimizer(probe, optax.sgd(0.1), policy="bf16;autocast", loss_scale=StaticLossScale(1.0))
        metrics = train_step(probe, probe_opt, (x, y, jax.random.key(seed)), keyed_loss)
        assert bool(metrics["grads_finite"])
        losses.setdefault(seed, []).append(float(metrics["loss"]))
    assert losses[0][0] == losses[0][1] and losses[0][0] != losses[1][0]  # the batch's key draws the mask


# ---- shardings on a mesh of 8 fake devices ---------------------------------------------------------------------------

CHILD = textwrap.dedent('''
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxamp import DynamicLossScale
    from jaxamp.nnx import Optimizer, train_step

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 4, rngs=rngs)
        def __call__(self, x):
            return self.l2(nnx.relu(self.l1(x)))
    model = Net(nnx.Rngs(0))
    specs = {"l1/kernel": P(None, "fsdp"), "l2/kernel": P("fsdp", None), "l1/bias": P(), "l2/bias": P()}
    for name, spec in specs.items():
        layer, leaf = name.split("/")
        var = getattr(getattr(model, layer), leaf)
        var.set_value(jax.device_put(var.get_value(), NamedSharding(mesh, spec)))
    opt = Optimizer(model, optax.adam(1e-2), policy="bf16;autocast", loss_scale=DynamicLossScale(2.0**10))
    traces = []
    def loss_fn(model, batch):
        traces.append(1)
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
    def shardings(node):
        return {jax.tree_util.keystr(p): (x.sharding, x.ndim)
                for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(node))[0]}
    def same(now, then):  # the same placement (P('fsdp', None) and P('fsdp') are one)
        return now.keys() == then.keys() and all(now[k][0].is_equivalent_to(*then[k]) for k in then)
    spec = lambda sh: str(sh.spec) if isinstance(sh, NamedSharding) else type(sh).__name__
    before = (shardings(model), shardings(opt))
    rows = NamedSharding(mesh, P("fsdp"))
    for i in range(3):
        kx, ky = jax.random.split(jax.random.key(i))
        batch = (jax.device_put(jax.random.normal(kx, (64, 16)), rows),
                 jax.device_put(jax.random.randint(ky, (64,), 0, 4), rows))
        m = train_step(model, opt, batch, loss_fn)
        assert bool(m["grads_finite"])
        print("after", i, same(shardings(model), before[0]) and same(shardings(opt), before[1]))
    specs = [sorted({spec(sh) for sh, _ in part.values()}) for part in before]
    print("specs", *specs)
    print("traces", len(traces))
''')


@pytest.mark.slow
def test_every_variable_and_optimizer_array_keeps_its_sharding_and_the_loop_compiles_once():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout.splitlines()
    assert out[:3] == ["after 0 True", "after 1 True", "after 2 True"], proc.stdout
    # replicated and sharded variables; the optimizer's scalars replicated on the params' mesh too
    assert out[3] == ("specs [\"P('fsdp', None)\", 'P()', \"P(None, 'fsdp')\"] [\"P('fsdp', None)\", 'P()', "
                      "\"P(None, 'fsdp')\"]"), out
    assert out[4] == "traces 1", out  # one compile for three steps
