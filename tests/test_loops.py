"""jaxamp inside the training loops people already have: `axis_name` under pmap and shard_map, model state
(BatchNorm's batch_stats) in the step, a hand-written step around Flax's own TrainState, token-weighted
accumulation, and a non-finite loss that leaves the scale alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp import DynamicLossScale, NoOpLossScale, TrainState, WeightedLoss, fidelity, train_step

REPO = Path(__file__).resolve().parents[1]
STEP = jax.jit(train_step, static_argnames=("loss_fn", "accum_steps", "on_overflow"))


def assert_trees_bitwise(a, b):
    """The same structure (no leaf lost), then every leaf's dtype, shape and bytes."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert (x.dtype, x.shape) == (y.dtype, y.shape) and x.tobytes() == y.tobytes()


class BNNet(nn.Module):
    """Dense -> BatchNorm (train mode: batch statistics, updates batch_stats) -> Dense."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(1)(nn.relu(x))


BN = BNNet()
BN_VARS = BN.init(jax.random.key(0), jnp.ones((2, 8)), train=False)


def bn_loss(params, batch, rng, model_state):
    """Flax's BatchNorm recipe as a jaxamp stateful loss: `(loss, new_model_state)`."""
    train = rng is not None  # train_step passes an rng, eval_step None: the running statistics
    with jax.numpy_dtype_promotion("standard"):  # Flax's BatchNorm mixes dtypes inside
        y, updates = BN.apply({"params": params, "batch_stats": model_state["batch_stats"]}, batch["x"],
                              train=train, mutable=["batch_stats"])
    return jnp.mean((y.astype(jnp.float32) - batch["y"]) ** 2), {"batch_stats": updates["batch_stats"]}


def bn_batch(i, n=16):
    kx, ky = jax.random.split(jax.random.key(50 + i))
    return {"x": jax.random.normal(kx, (n, 8)) * 3.0 + 1.0, "y": jax.random.normal(ky, (n, 1))}


def bn_state(policy="fp32", tx=None):
    return TrainState.create(params=jax.tree.map(jnp.copy, BN_VARS["params"]), tx=tx or optax.sgd(0.1),
                             policy=policy, loss_scale=NoOpLossScale(), rng=jax.random.key(1),
                             model_state={"batch_stats": jax.tree.map(jnp.copy, BN_VARS["batch_stats"])})


@pytest.mark.slow
def test_model_state_runs_through_the_micro_batches_in_order():
    """accum_steps=2: the statistics after the step equal two forward passes, micro-batch 0 then 1."""
    state = bn_state()
    batch = bn_batch(0)
    new, metrics = STEP(state, batch, bn_loss, accum_steps=2)
    assert bool(metrics["grads_finite"])
    stats = state.model_state
    for i in range(2):  # micro-batch i holds rows i, i + 2, ... (train_step's strided split)
        micro = jax.tree.map(lambda x, i=i: x[i::2], batch)
        _, stats = bn_loss(state.params, micro, jax.random.key(0), stats)  # train mode
    assert jax.tree.structure(new.model_state) == jax.tree.structure(stats)
    for a, b in zip(jax.tree.leaves(new.model_state), jax.tree.leaves(stats)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert not np.allclose(jax.tree.leaves(new.model_state)[0], jax.tree.leaves(state.model_state)[0])


def test_model_state_is_checkpointed_and_resumes_bitwise(tmp_path):
    run = bn_state(tx=optax.adam(1e-2))
    for i in range(2):
        run, _ = STEP(run, bn_batch(i), bn_loss)
    with jaxamp.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(run, {"run": "bn"})
        ckpt.wait()
        restored, _ = ckpt.restore(jax.eval_shape(lambda: bn_state(tx=optax.adam(1e-2))))
    assert_trees_bitwise(restored.model_state, run.model_state)
    a, b = run, restored
    for i in range(2, 4):
        a, _ = STEP(a, bn_batch(i), bn_loss)
        b, _ = STEP(b, bn_batch(i), bn_loss)
    assert_trees_bitwise((a.params, a.opt_state, a.model_state), (b.params, b.opt_state, b.model_state))


def test_a_skipped_step_keeps_finite_statistics_and_never_a_non_finite_one():
    state = bn_state()
    bad = bn_batch(0)
    bad["x"] = bad["x"].at[0, 0].set(jnp.inf)  # BatchNorm's new statistics: inf
    new, metrics = STEP(state, bad, bn_loss)
    assert not bool(metrics["grads_finite"])
    assert_trees_bitwise(new.model_state, state.model_state)  # the non-finite statistics were not kept
    assert_trees_bitwise(new.params, state.params)


def test_eval_step_with_model_state_uses_it_and_changes_nothing():
    state = bn_state()
    out = jaxamp.eval_step(state, bn_batch(0), bn_loss)
    expected, _ = bn_loss(state.params, bn_batch(0), None, state.model_state)
    assert float(out["loss"]) == float(expected)
    trained, _ = bn_loss(state.params, bn_batch(0), jax.random.key(0), state.model_state)
    assert float(out["loss"]) != float(trained)  # the running statistics, not the batch's


def test_a_stateful_loss_that_returns_only_the_loss_is_refused_naming_the_fix():
    def loss_only(params, batch, rng, model_state):
        return bn_loss(params, batch, rng, model_state)[0]

    for call in (lambda: jaxamp.eval_step(bn_state(), bn_batch(0), loss_only),
                 lambda: train_step(bn_state(), bn_batch(0), loss_only)):
        with pytest.raises(TypeError, match=r"must return \(loss, new_model_state\) .* it returned an array of "
                                            r"shape \(\)\. Return the state too"):
            call()



@pytest.mark.slow  # 6 s: three traces of two gradients
def test_the_audit_and_the_fidelity_check_take_the_model_state_as_train_step_does():
    """`precision_audit`, `grad_fidelity` and `fidelity_report` call a stateful loss with the state's model_state,
    as `train_step` does (they failed with a bare TypeError when called as the docs show)."""
    state = bn_state(jaxamp.get_policy("bf16", autocast=True))
    batch = bn_batch(0)
    report = jaxamp.precision_audit(state, batch, bn_loss)
    # two Dense: forward and weight gradient each, and the second one's input gradient
    assert report.half_fraction == 1.0 and not report.fallbacks and len(report.rows) == 5
    explicit = jaxamp.precision_audit(state, batch, bn_loss, carry=state.model_state)
    assert [r["source"] for r in report.rows] == [r["source"] for r in explicit.rows]
    errs = fidelity.grad_fidelity(state, batch, bn_loss)
    given = fidelity.grad_fidelity(state, batch, bn_loss, carry=state.model_state)
    assert sorted(errs) == sorted(given) == ["BatchNorm_0/bias", "BatchNorm_0/scale", "Dense_0/bias",
                                             "Dense_0/kernel", "Dense_1/bias", "Dense_1/kernel"]
    assert all(float(errs[k]) == float(given[k]) for k in errs)
    fid = fidelity.fidelity_report(state, batch, bn_loss, noise_floor=True)
    assert {k: float(v) for k, v in fid["rel_err"].items()} == {k: float(v) for k, v in errs.items()}
    # the bias before BatchNorm has a float32 gradient of about 0 (BatchNorm removes a per-feature shift)
    assert [k for k, v in fid["near_zero"].items() if bool(v)] == ["Dense_0/bias"]
    assert all(0.0 < float(errs[k]) < 0.02 and 0.0 < float(fid["noise_floor"][k]) < 0.01
               for k in errs if k != "Dense_0/bias")
    for check in (fidelity.grad_fidelity, jaxamp.precision_audit):  # a stateless loss with model_state: one line
        with pytest.raises(TypeError, match=r"calls loss_fn\(params, batch, rng, model_state\), but <lambda>"):
            check(state, batch, lambda params, batch, rng: 0.0)

# ---- a hand-written step around Flax's own TrainState ---------------------------------------------------------------

class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(jnp.tanh(nn.Dense(32)(x)))


MLP_PARAMS = MLP().init(jax.random.key(3), jnp.ones((1, 8)))["params"]


def mlp_loss(params, batch, rng=None):
    del rng
    y = MLP().apply({"params": params}, batch["x"].astype(jax.tree.leaves(params)[0].dtype))
    return jnp.mean((y.astype(jnp.float32) - batch["y"]) ** 2)


def mlp_batch(i, overflow=False):
    kx, ky = jax.random.split(jax.random.key(70 + i))
    x = jax.random.normal(kx, (32, 8)) * (3e3 if overflow else 1.0)  # x 3e3: float16 gradients overflow
    return {"x": x, "y": jax.random.normal(ky, (32, 1))}


def test_a_hand_written_step_around_flax_trainstate_is_bitwise_train_steps_update():
    from flax.training import train_state

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    grad_fn = jaxamp.value_and_grad(mlp_loss, policy="fp16")

    @jax.jit
    def hand_step(state, loss_scale, batch):  # the docs' recipe, as written there
        loss_scale, finite, loss, grads = grad_fn(loss_scale, state.params, batch)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts
            new_state = state.apply_gradients(grads=grads)
        return jaxamp.select_tree(finite, new_state, state), loss_scale, loss, finite

    flax_state = train_state.TrainState.create(apply_fn=None, params=jax.tree.map(jnp.copy, MLP_PARAMS), tx=tx)
    loss_scale = DynamicLossScale(2.0**15, growth_interval=2)
    ours = TrainState.create(params=jax.tree.map(jnp.copy, MLP_PARAMS), tx=tx, policy="fp16",
                             loss_scale=DynamicLossScale(2.0**15, growth_interval=2), rng=jax.random.key(0))
    skipped = 0
    for i in range(5):
        batch = mlp_batch(i, overflow=(i == 2))
        flax_state, loss_scale, loss, finite = hand_step(flax_state, loss_scale, batch)
        ours, metrics = STEP(ours, batch, mlp_loss)
        assert bool(finite) == bool(metrics["grads_finite"]) and float(loss) == float(metrics["loss"])
        skipped += not bool(finite)
        assert float(loss_scale.loss_scale) == float(ours.loss_scale.loss_scale)
    assert skipped == 1
    assert_trees_bitwise(flax_state.params, ours.params)
    assert_trees_bitwise(flax_state.opt_state, ours.opt_state)


# ---- token-weighted accumulation ------------------------------------------------------------------------------------

def masked_loss(params, batch, rng=None):
    """Per-token squared error over the batch's unmasked tokens: a sum and a count."""
    del rng
    w = params["w"]
    pred = jnp.einsum("btd,d->bt", batch["x"], w)  # f32[batch, seq]
    err = (pred - batch["y"]) ** 2 * batch["mask"]
    return WeightedLoss(jnp.sum(err), jnp.sum(batch["mask"]))


def masked_batch():
    """4 rows of 16 tokens; micro-batch 0 (rows 0 and 2, the strided split) holds 23 tokens, micro-batch 1 (rows 1
    and 3) 6."""
    rng = np.random.default_rng(0)
    mask = np.zeros((4, 16), np.float32)
    mask[0, :16], mask[2, :7], mask[1, :3], mask[3, :3] = 1, 1, 1, 1
    return {"x": jnp.asarray(rng.normal(size=(4, 16, 3)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(4, 16)), jnp.float32), "mask": jnp.asarray(mask)}


@pytest.mark.slow
def test_token_weighted_accumulation_is_the_full_batch_gradient():
    batch = masked_batch()
    counts = [float(batch["mask"][i::2].sum()) for i in range(2)]
    assert counts == [23.0, 6.0]
    params = {"w": jnp.asarray([0.5, -1.0, 2.0], jnp.float32)}
    state = TrainState.create(params=params, tx=optax.sgd(1.0), policy="fp32", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(0))
    full = jax.grad(lambda p: (lambda r: r.total / r.count)(masked_loss(p, batch)))(params)["w"]
    new, metrics = STEP(state, batch, masked_loss, accum_steps=2)
    grad = params["w"] - new.params["w"]
    np.testing.assert_allclose(grad, full, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(metrics["loss"]),
                               float(masked_loss(params, batch).total / masked_loss(params, batch).count), rtol=1e-6)
    assert float(metrics["loss_weight"]) == sum(counts)
    # the mean of the micro-batches' means is what this replaces: far off when their counts differ
    means = [jax.grad(lambda p, i=i: (lambda r: r.total / r.count)(
        masked_loss(p, jax.tree.map(lambda x: x[i::2], batch))))(params)["w"] for i in range(2)]
    naive = (means[0] + means[1]) / 2
    assert float(jnp.linalg.norm(naive - full) / jnp.linalg.norm(full)) > 0.05, counts


# ---- a non-finite loss ----------------------------------------------------------------------------------------------

def test_a_nan_loss_every_step_leaves_the_scale_alone_and_counts_consecutive_skips():
    state = TrainState.create(params=jax.tree.map(jnp.copy, MLP_PARAMS), tx=optax.adam(1e-3), policy="fp16",
                              loss_scale=DynamicLossScale(2.0**15), rng=jax.random.key(0))
    bad = mlp_batch(0)
    bad["x"] = bad["x"].at[0, 0].set(jnp.nan)
    for i in range(6):
        state, metrics = STEP(state, bad, mlp_loss)
        assert not bool(metrics["loss_finite"]) and int(metrics["consecutive_skips"]) == i + 1
    assert float(state.loss_scale.loss_scale) == 2.0**15  # not 32768 -> 1024 in 6 steps
    state, metrics = STEP(state, mlp_batch(1), mlp_loss)
    assert bool(metrics["grads_finite"]) and int(metrics["consecutive_skips"]) == 0


# ---- pmap and shard_map over 8 fake devices -------------------------------------------------------------------------

CHILD = textwrap.dedent('''
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, sys.argv[1])
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxamp
    from jaxamp import DynamicLossScale, TrainState, train_step, WeightedLoss
    from test_loops import MLP_PARAMS, mlp_loss, mlp_batch

    def state():
        return TrainState.create(params=jax.tree.map(jnp.copy, MLP_PARAMS), tx=optax.adam(1e-2), policy="fp32",
                                 loss_scale=DynamicLossScale(2.0**10), rng=jax.random.key(0))

    batches = [mlp_batch(i) for i in range(3)]
    batches.append(mlp_batch(3))
    # on device 3 only: tanh keeps the loss finite, the weight gradient is inf * 0 = NaN
    poisoned = dict(batches[3]); poisoned["x"] = poisoned["x"].at[13, 0].set(jnp.inf)
    batches[3] = poisoned
    # 1. plain jit (XLA inserts the collectives): the reference
    jitted = jax.jit(train_step, static_argnames="loss_fn")
    ref, ref_m = state(), []
    for b in batches:
        ref, m = jitted(ref, b, mlp_loss); ref_m.append(m)
    # 2. pmap over 8 devices, axis_name="batch"
    stack = lambda t: jax.tree.map(lambda x: jnp.stack([x] * 8), t)
    split = lambda b: jax.tree.map(lambda x: x.reshape(8, x.shape[0] // 8, *x.shape[1:]), b)
    pstep = jax.pmap(lambda s, b: train_step(s, b, mlp_loss, axis_name="batch"), axis_name="batch")
    ps = stack(state())
    pm = []
    for b in batches:
        ps, m = pstep(ps, split(b)); pm.append(m)
    # 3. shard_map over a mesh of 8
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    smap = jax.jit(jax.shard_map(lambda s, b: train_step(s, b, mlp_loss, axis_name="batch"), mesh=mesh,
                                 in_specs=(P(), P("batch")), out_specs=(P(), P()), check_vma=False))
    ss = state()
    for b in batches:
        ss, sm = smap(ss, b)
    def same_everywhere(tree):
        return all(bool((np.asarray(x) == np.asarray(x)[0]).all()) for x in jax.tree.leaves(tree))
    def close(a, b):
        return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
                   zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    one = lambda t: jax.tree.map(lambda x: x[0], t)
    print("pmap_same", same_everywhere((ps.params, ps.opt_state, ps.loss_scale)))
    print("pmap_vs_jit", close(one(ps.params), ref.params))
    print("shard_vs_jit", close(ss.params, ref.params))
    print("skipped", [bool(m["grads_finite"]) for m in ref_m], [bool(np.asarray(m["grads_finite"]).all()) for m in pm],
          bool(np.asarray(pm[3]["grads_finite"]).any()))
    print("scales", float(ref.loss_scale.loss_scale), sorted(set(np.asarray(ps.loss_scale.loss_scale).tolist())),
          float(ss.loss_scale.loss_scale))
    # 4. grad_fidelity under pmap with axis_name: the errors of the whole batch on every device
    from jaxamp import NoOpLossScale
    from jaxamp.fidelity import errors, grad_fidelity, gradient_pair
    bf = TrainState.create(params=jax.tree.map(jnp.copy, MLP_PARAMS), tx=optax.adam(1e-2), policy="bf16",
                           loss_scale=NoOpLossScale(), rng=jax.random.key(0))
    shards = split(batches[0])
    pairs = [gradient_pair(bf, jax.tree.map(lambda x: x[i], shards), mlp_loss) for i in range(8)]
    mean = lambda trees: jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)
    full = errors(mean([p[0] for p in pairs]), mean([p[1] for p in pairs]))  # the shards' mean gradients
    per_device = jax.pmap(lambda s, b: grad_fidelity(s, b, mlp_loss, axis_name="batch"), axis_name="batch")(
        stack(bf), shards)
    print("fidelity", sorted(full) == sorted(per_device), same_everywhere(per_device),
          max(abs(float(per_device[k][0]) / float(full[k]) - 1) for k in full))
    # 5. BatchNorm's own cross-device mean (axis_name="batch") with model_state under pmap = one device, full batch
    import flax.linen as nn
    class BNAxis(nn.Module):
        axis_name: object = None
        @nn.compact
        def __call__(self, x):
            x = nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=self.axis_name)(nn.Dense(16)(x))
            return nn.Dense(1)(nn.relu(x))
    def bn_loss_for(net):
        def loss(params, batch, rng, model_state):
            y, updates = net.apply({"params": params, **model_state}, batch["x"], mutable=["batch_stats"])
            return jnp.mean((y - batch["y"]) ** 2), updates
        return loss
    variables = BNAxis().init(jax.random.key(5), jnp.ones((2, 8)))
    def bn_state():
        return TrainState.create(params=variables["params"], tx=optax.sgd(0.1), policy="fp32",
                                 loss_scale=NoOpLossScale(), rng=jax.random.key(6),
                                 model_state={"batch_stats": variables["batch_stats"]})
    one, many = bn_state(), stack(bn_state())
    one_step = jax.jit(lambda s, b: train_step(s, b, bn_loss_for(BNAxis()))[0])
    many_step = jax.pmap(lambda s, b: train_step(s, b, bn_loss_for(BNAxis("batch")), axis_name="batch")[0],
                         axis_name="batch")
    for b in batches[:3]:
        one, many = one_step(one, b), many_step(many, split(b))
    print("batchnorm", same_everywhere((many.params, many.model_state)),
          close(jax.tree.map(lambda x: x[0], many.params), one.params),
          close(jax.tree.map(lambda x: x[0], many.model_state), one.model_state))
''')


@pytest.mark.slow
def test_pmap_and_shard_map_agree_with_the_jit_path_and_skip_together():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUMPY_DTYPE_PROMOTION": "strict"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(REPO / "tests")], env=env, capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert out["pmap_same"] == "True"  # params, optimizer state and loss scale equal on every device
    assert float(out["pmap_vs_jit"]) < 1e-5 and float(out["shard_vs_jit"]) < 1e-5, out
    assert out["skipped"] == "[True, True, True, False] [True, True, True, False] False", out  # device 3: all skip
    jit_scale, *pmap_scales, shard_scale = out["scales"].replace("[", "").replace("]", "").replace(",", "").split()
    assert jit_scale == shard_scale == "512.0" and pmap_scales == ["512.0"], out  # backed off once, everywhere
    same_keys, same_devices, gap = out["fidelity"].split()
    assert same_keys == same_devices == "True" and float(gap) < 1e-3, out  # the mean gradients' errors, everywhere
    same, params_gap, stats_gap = out["batchnorm"].split()
    assert same == "True" and float(params_gap) < 1e-5 and float(stats_gap) < 1e-5, out  # BatchNorm's pmean
