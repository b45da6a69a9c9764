import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from asserts import assert_trees_close, assert_trees_equal

from jaxamp import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    TrainState,
    all_finite,
    eval_step,
    finite_leaves,
    get_policy,
    train_step,
)

step = jax.jit(train_step, static_argnames="loss_fn")


def mlp_params(key=0):
    k1, k2 = jax.random.split(jax.random.key(key))
    return {"l1": {"w": jax.random.normal(k1, (8, 16)) * 0.3, "b": jnp.zeros((16,))},
            "l2": {"w": jax.random.normal(k2, (16, 1)) * 0.3, "b": jnp.zeros((1,))}}


def mlp_loss(params, batch, rng):
    """Regression MLP; computes in the params' (compute) dtype, loss in float32."""
    del rng
    x = batch["x"].astype(params["l1"]["w"].dtype)
    h = jnp.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
    y = (h @ params["l2"]["w"] + params["l2"]["b"]) * batch["poison"].astype(h.dtype)
    return jnp.mean((y.astype(jnp.float32) - batch["y"]) ** 2)


def make_batch(i=0, poison=1.0):
    kx, ky = jax.random.split(jax.random.key(100 + i))
    return {"x": jax.random.normal(kx, (32, 8)), "y": jax.random.normal(ky, (32, 1)),
            "poison": jnp.asarray(poison, jnp.float32)}


def make_tx(steps=20):
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, steps, 1e-3)
    return optax.chain(optax.clip_by_global_norm(0.5),
                       optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.1))


def make_state(policy="fp32", loss_scale=None, tx=None):
    return TrainState.create(params=mlp_params(), tx=tx or make_tx(), policy=get_policy(policy),
                             loss_scale=loss_scale or NoOpLossScale(), rng=jax.random.key(0))


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_fp32_noop_equals_plain_optax():
    tx = make_tx()
    state = make_state(tx=tx)
    with jax.numpy_dtype_promotion("standard"):  # optax itself is not strict-promotion clean
        params, opt_state = mlp_params(), tx.init(mlp_params())

    @jax.jit
    def plain(params, opt_state, batch):
        grads = jax.grad(mlp_loss)(params, batch, None)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with jax.numpy_dtype_promotion("standard"):  # optax itself is not strict-promotion clean
        for i in range(5):
            state, metrics = step(state, make_batch(i), mlp_loss)
            params, opt_state = plain(params, opt_state, make_batch(i))
    assert bool(metrics["grads_finite"]) and int(state.step) == 5
    assert_trees_close((state.params, state.opt_state), (params, opt_state), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("policy", ["fp16", "bf16"])
def test_master_weights_and_optimizer_state_stay_float32(policy):
    state = make_state(policy, DynamicLossScale(2.0**8, growth_interval=2))
    structure = jax.tree.structure(state)
    for i in range(4):
        state, metrics = step(state, make_batch(i), mlp_loss)
        assert jax.tree.structure(state) == structure
        assert all(x.dtype in (jnp.float32, jnp.int32) for x in jax.tree.leaves((state.params, state.opt_state)))
        assert state.loss_scale.loss_scale.dtype == jnp.float32 and state.step.dtype == jnp.int32
        assert all(metrics[k].dtype == jnp.float32 for k in ("loss", "grad_norm", "loss_scale"))
        assert metrics["grads_finite"].dtype == jnp.bool_


@pytest.mark.slow
@pytest.mark.parametrize("policy, dtype", [("float16", jnp.float16), ("p=bf16,c=bf16,o=f32", jnp.bfloat16)])
def test_half_precision_master_weights_keep_their_dtype_under_adamw(policy, dtype):
    """Master weights as a jmp string gives them: the float32 gradients and hyperparameters never promote the state."""
    # Hyperparameters in float32: inferred from bfloat16 params, b2=0.999 would round to 1 (optax's behaviour).
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.inject_hyperparams(
        optax.adamw, hyperparam_dtype=jnp.float32)(learning_rate=1e-2, weight_decay=0.1))
    state = make_state(policy, DynamicLossScale(2.0**8), tx=tx)
    dtypes = jax.tree.map(lambda x: x.dtype, (state.params, state.opt_state))
    assert state.params["l1"]["w"].dtype == dtype and state.opt_state[1].inner_state[0].mu["l1"]["w"].dtype == dtype
    before = state
    for i in range(3):
        state, metrics = step(state, make_batch(i), mlp_loss)
        assert bool(metrics["grads_finite"])
        assert jax.tree.map(lambda x: x.dtype, (state.params, state.opt_state)) == dtypes
    assert bits(state.params) != bits(before.params)


def gradient_poisoned_loss(params, batch, rng):
    """mlp_loss whose loss stays finite while the gradient of l2/w is multiplied by `batch["gpoison"]` (its largest
    entry, so one poisoned row poisons its micro-batch)."""
    poison = jnp.max(batch["gpoison"]).astype(params["l2"]["w"].dtype)
    params = {**params, "l2": {**params["l2"], "w": poison_gradient(params["l2"]["w"], poison)}}
    return mlp_loss(params, batch, rng)


@pytest.mark.parametrize("poison,loss_too", [(float("inf"), True), (float("nan"), True), (float("inf"), False),
                                             (float("nan"), False)])
@pytest.mark.slow
def test_non_finite_step_is_skipped_bitwise(poison, loss_too):
    """A non-finite gradient skips the step bitwise and backs the scale off; a non-finite loss (the inputs or the
    forward pass, which no scale fixes) skips it too and leaves the scale as it is."""
    state = make_state("fp16", DynamicLossScale(2.0**10))
    state, _ = step(state, make_batch(0), mlp_loss)  # one applied step so opt_state is non-trivial
    before = state
    if loss_too:
        after, metrics = step(state, make_batch(1, poison), mlp_loss)
    else:
        batch = {**make_batch(1), "gpoison": jnp.asarray(poison, jnp.float32)}
        after, metrics = step(state, batch, gradient_poisoned_loss)
    assert not bool(metrics["grads_finite"]) and bool(metrics["loss_finite"]) != loss_too
    assert bits(after.params) == bits(before.params)
    assert bits(after.opt_state) == bits(before.opt_state)  # optax count and LR schedule did not advance
    scale_after = 2.0**10 if loss_too else 2.0**9
    assert float(metrics["loss_scale"]) == 2.0**10 and float(after.loss_scale.loss_scale) == scale_after
    assert int(metrics["consecutive_skips"]) == 1 and int(after.consecutive_skips) == 1
    assert int(after.step) == int(before.step) + 1
    lr_count = lambda s: int(s.opt_state[1].count)
    assert lr_count(after) == lr_count(before) == 1
    clean, metrics = step(after, make_batch(2), mlp_loss)  # the next clean step applies normally
    assert bool(metrics["grads_finite"]) and lr_count(clean) == 2
    assert bits(clean.params) != bits(after.params)


def test_overflow_from_scaled_float16_backward_is_skipped():
    """A scale too large for float16 overflows in the backward pass; the step is skipped and the scale backs off."""
    state = make_state("fp16", DynamicLossScale(2.0**24, max_loss_scale=2.0**24))
    scales = []
    for i in range(30):
        state, metrics = step(state, make_batch(i), mlp_loss)
        scales.append(float(metrics["loss_scale"]))
        if bool(metrics["grads_finite"]):
            break
    assert scales[0] == 2.0**24 and len(scales) > 1 and scales == sorted(scales, reverse=True)


@pytest.mark.slow
def test_clipping_and_update_do_not_depend_on_loss_scale():
    results = []
    for exponent in (0, 4, 12, 24):
        state = make_state("fp32", StaticLossScale(2.0**exponent))
        state, metrics = step(state, make_batch(0), mlp_loss)
        assert float(metrics["grad_norm"]) > 0.5  # clipping is active (max norm 0.5)
        results.append((float(metrics["grad_norm"]), bits(state.params)))
    assert all(r == results[0] for r in results)


@pytest.mark.slow
def test_grad_norm_metric_is_the_global_norm_of_the_unscaled_gradients():
    state = make_state("fp16", StaticLossScale(2.0**10))
    _, metrics = step(state, make_batch(0), mlp_loss)
    grads = jax.grad(lambda p: mlp_loss(get_policy("fp16").cast_to_compute(p), make_batch(0), None))(state.params)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(grads)), rtol=2e-3)


@pytest.mark.slow
@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_one_pass_check_agrees_with_all_finite_finite_leaves_and_optax_norm(bad):
    from jaxamp.finite import check as _check_grads

    tree = {"m": jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4), "s": jnp.asarray(-2.5, jnp.float32),
            "h": jnp.ones((5,), jnp.float16), "e": jnp.zeros((0, 3), jnp.float32), "i": jnp.arange(3, dtype=jnp.int32)}
    check = jax.jit(_check_grads)(tree)
    assert bool(check.finite) and bool(all_finite(tree))
    assert jax.tree.leaves(check.finite_leaves) == [True] * 5
    with jax.numpy_dtype_promotion("standard"):
        expected = float(optax.tree.norm({k: v for k, v in tree.items() if k != "i"}))
    np.testing.assert_allclose(float(check.norm), expected, rtol=1e-6)
    assert check.norm.dtype == jnp.float32 and check.finite.dtype == jnp.bool_
    poisoned = {**tree, "m": tree["m"].at[2, 1].set(bad)}
    check = jax.jit(_check_grads)(poisoned)
    assert not bool(check.finite) and not bool(all_finite(poisoned))
    assert check.finite_leaves == {k: k != "m" for k in tree}
    assert finite_leaves(poisoned) == check.finite_leaves
    assert not np.isfinite(float(check.norm))
    empty = _check_grads({})
    assert bool(empty.finite) and float(empty.norm) == 0.0


def test_params_made_of_tuples_skip_a_non_finite_step():
    """`[(W, b)]` params (tuples inside the tree): an inf gradient of W skips the step; the norm is exact."""
    params = [(jnp.ones((2, 2), jnp.float32), jnp.zeros((2,), jnp.float32))]

    def loss(p, batch, rng):
        w, b = p[0]
        return jnp.sum(jnp.sqrt(w - batch)) + jnp.sum(b)  # sqrt'(0) = inf: W's gradient is inf

    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="fp32", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(0))
    new, metrics = step(state, jnp.float32(1.0), loss)
    assert not bool(metrics["grads_finite"])
    assert jax.tree.leaves(metrics["grads_finite_leaves"]) == [False, True]
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), new.params, state.params))
    _, metrics = step(state, jnp.float32(0.0), loss)  # W - 0 = 1: finite; |dW| = 0.5, |db| = 1
    assert bool(metrics["grads_finite"])
    assert float(metrics["grad_norm"]) == pytest.approx((4 * 0.25 + 2 * 1.0) ** 0.5, rel=1e-6)


def test_underflow_needs_loss_scaling():
    """Unscaled float16 gradients of ~1e-8 flush to zero; scaled by 2^15 they match float32 within 1%."""
    a = jax.random.uniform(jax.random.key(1), (1000,), minval=0.5e-4, maxval=2e-4)

    def loss_fn(params, batch, rng):
        w = params["w"]
        return (jnp.sum(w * batch.astype(w.dtype)) * jnp.asarray(1e-4, w.dtype)).astype(jnp.float32)

    def gradient(policy, loss_scale):
        state = TrainState.create(params={"w": jnp.zeros((1000,))}, tx=optax.sgd(1.0), policy=get_policy(policy),
                                  loss_scale=loss_scale, rng=jax.random.key(0))
        state, _ = step(state, a, loss_fn)
        return -np.asarray(state.params["w"])  # sgd(1.0) from zero: params = -grad

    reference = gradient("fp32", NoOpLossScale())
    unscaled = gradient("fp16", NoOpLossScale())
    scaled = gradient("fp16", StaticLossScale(2.0**15))
    assert np.mean(unscaled == 0) > 0.9
    np.testing.assert_allclose(scaled, reference, rtol=1e-2)


def test_ten_steps_with_changing_scale_trace_once():
    traces = []

    def counting_loss(params, batch, rng):
        traces.append(1)
        return mlp_loss(params, batch, rng)

    jitted = jax.jit(train_step, static_argnames="loss_fn", donate_argnums=0)
    state = make_state("fp16", DynamicLossScale(2.0**4, growth_interval=1))
    scales = set()
    for i in range(10):
        state, metrics = jitted(state, make_batch(i, float("inf") if i == 5 else 1.0), counting_loss)
        scales.add(float(metrics["loss_scale"]))
    assert len(scales) >= 5 and len(traces) == 1


def test_metrics_outlive_donated_states():
    """Metrics of many steps are fetched at once (one fetch per logging interval) while states are donated."""
    jitted = jax.jit(train_step, static_argnames="loss_fn", donate_argnums=0)
    state, kept = make_state("fp16", DynamicLossScale(2.0**4, growth_interval=1)), []
    for i in range(4):
        state, metrics = jitted(state, make_batch(i), mlp_loss)
        kept.append(metrics)
    host = jax.device_get(kept)
    assert [float(m["loss_scale"]) for m in host] == [16.0, 32.0, 64.0, 128.0]


def test_rng_per_step_and_aux():
    seen = []

    def loss_with_aux(params, batch, rng):
        loss = mlp_loss(params, batch, rng)
        return loss, {"rng": rng, "double": 2 * loss}

    state = make_state()
    for i in range(3):
        state, metrics = step(state, make_batch(i), loss_with_aux)
        seen.append(np.asarray(metrics["aux"]["rng"]))
        np.testing.assert_allclose(metrics["aux"]["double"], 2 * metrics["loss"])
    np.testing.assert_array_equal(seen[1], jax.random.fold_in(state.rng, 1))
    assert len({s.tobytes() for s in seen}) == 3


def test_eval_step_and_bad_loss_shape():
    state = make_state("bf16")
    assert eval_step(state, make_batch(0), mlp_loss)["loss"].dtype == jnp.float32
    with pytest.raises(ValueError, match="scalar loss"):
        train_step(state, make_batch(0), lambda p, b, r: jnp.ones((2,), jnp.float32))


# ---- accumulation, retry, localisation, underflow statistics ----------------------------------------------------

def rows_loss(params, batch, rng):
    """mlp_loss with a per-row poison (inf/NaN in chosen rows only)."""
    del rng
    x = batch["x"].astype(params["l1"]["w"].dtype)
    h = jnp.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
    y = (h @ params["l2"]["w"] + params["l2"]["b"]) * batch["poison"][:, None].astype(h.dtype)
    return jnp.mean((y.astype(jnp.float32) - batch["y"]) ** 2)


def rows_batch(i=0, n=32, poison_rows=()):
    poison = np.ones((n,), np.float32)
    poison[list(poison_rows)] = np.inf
    kx, ky = jax.random.split(jax.random.key(200 + i))
    return {"x": jax.random.normal(kx, (n, 8)), "y": jax.random.normal(ky, (n, 1)), "poison": jnp.asarray(poison)}


def sgd_gradient(policy, batch, accum_steps, loss_scale=None):
    """The gradient a step applied: sgd(1.0) from the initial params, so grad = params_before - params_after."""
    state = make_state(policy, loss_scale, tx=optax.sgd(1.0))
    new, metrics = jax.jit(train_step, static_argnames=("loss_fn", "accum_steps"))(
        state, batch, rows_loss, accum_steps=accum_steps)
    grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), state.params, new.params)
    return grads, new, metrics


@pytest.mark.parametrize("policy,rtol", [("fp32", 1e-5), ("fp16", 1e-3)])
def test_accumulation_equals_one_big_batch(policy, rtol):
    batch = rows_batch(0, n=32)
    scale = DynamicLossScale(2.0**8) if policy == "fp16" else None
    big, _, m1 = sgd_gradient(policy, batch, 1, scale)
    acc, _, m4 = sgd_gradient(policy, batch, 4, scale)
    assert_trees_close(acc, big, rtol=rtol, atol=1e-6 if policy == "fp32" else 1e-4)
    np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=rtol)


def gradient_poisoned_rows(params, batch, rng):
    return gradient_poisoned_loss(params, {**batch, "poison": jnp.ones((), jnp.float32)}, rng)


@pytest.mark.slow
def test_accumulation_updates_the_scale_once_per_window():
    state = make_state("fp16", DynamicLossScale(2.0**4, growth_interval=1))
    step4 = jax.jit(train_step, static_argnames=("loss_fn", "accum_steps"))
    state, metrics = step4(state, rows_batch(0), rows_loss, accum_steps=4)
    assert bool(metrics["grads_finite"]) and float(state.loss_scale.loss_scale) == 2.0**5  # grew once, not 4 times
    before = state
    gpoison = np.ones((32,), np.float32)
    gpoison[17] = np.inf  # one micro-batch's gradient overflows; every loss stays finite
    state, metrics = step4(state, {**rows_batch(1), "gpoison": jnp.asarray(gpoison)}, gradient_poisoned_rows,
                           accum_steps=4)
    assert not bool(metrics["grads_finite"]) and bool(metrics["loss_finite"])
    assert float(state.loss_scale.loss_scale) == 2.0**4  # backed off once
    assert bits(state.params) == bits(before.params) and bits(state.opt_state) == bits(before.opt_state)
    with pytest.raises(ValueError, match="accum_steps=5 must divide"):
        train_step(state, rows_batch(0), rows_loss, accum_steps=5)


@pytest.mark.slow
def test_retry_recovers_the_batch_at_the_lower_scale():
    retry = jax.jit(train_step, static_argnames=("loss_fn", "on_overflow", "max_retries"))
    state = make_state("fp16", DynamicLossScale(2.0**24, max_loss_scale=2.0**24))
    new, metrics = retry(state, rows_batch(0), rows_loss, on_overflow="retry", max_retries=30)
    retries = int(metrics["retries"])
    assert bool(metrics["grads_finite"]) and retries >= 1
    assert float(metrics["loss_scale"]) == 2.0 ** (24 - retries)
    assert int(new.opt_state[1].count) == 1  # the batch was applied, not dropped
    reference = make_state("fp16", DynamicLossScale(2.0 ** (24 - retries), max_loss_scale=2.0**24))
    ref_new, ref_metrics = step(reference, rows_batch(0), rows_loss)
    assert bool(ref_metrics["grads_finite"])
    assert_trees_equal(new.params, ref_new.params, bitwise=False)
    # with too few retries allowed it falls back to a skip
    _, capped = retry(state, rows_batch(0), rows_loss, on_overflow="retry", max_retries=0)
    assert not bool(capped["grads_finite"]) and int(capped["retries"]) == 0


@jax.custom_vjp
def poison_gradient(x, poison):
    return x


poison_gradient.defvjp(lambda x, p: (x, p), lambda p, g: (g * p.astype(g.dtype), jnp.zeros_like(p)))


def test_overflow_localisation_names_exactly_the_poisoned_leaf():
    from jaxamp.grad_stats import nonfinite_paths

    def loss_fn(params, batch, rng):
        params = {**params, "l2": {**params["l2"], "w": poison_gradient(params["l2"]["w"], batch["gpoison"])}}
        return mlp_loss(params, batch, rng)

    state = make_state("fp16", DynamicLossScale(2.0**8))
    _, metrics = step(state, {**make_batch(0), "gpoison": jnp.asarray(jnp.inf, jnp.float16)}, loss_fn)
    assert not bool(metrics["grads_finite"]) and bool(metrics["loss_finite"])
    assert nonfinite_paths(jax.device_get(metrics["grads_finite_leaves"])) == ["l2/w"]


@pytest.mark.slow
def test_loss_finite_separates_bad_inputs_from_gradient_overflow():
    state = make_state("fp16", DynamicLossScale(2.0**8))
    bad = make_batch(0)
    bad["x"] = bad["x"].at[3, 2].set(jnp.nan)
    _, metrics = step(state, bad, mlp_loss)
    assert not bool(metrics["loss_finite"]) and not bool(metrics["grads_finite"])
    overflow = make_state("fp16", DynamicLossScale(2.0**24, max_loss_scale=2.0**24))
    _, metrics = step(overflow, make_batch(0), mlp_loss)
    assert bool(metrics["loss_finite"]) and not bool(metrics["grads_finite"])


@pytest.mark.slow
def test_underflow_stats_in_metrics():
    stats_step = jax.jit(train_step, static_argnames=("loss_fn", "underflow_stats", "accum_steps"))
    a = jax.random.uniform(jax.random.key(1), (32, 8), minval=0.5e-4, maxval=2e-4)

    def tiny_loss(params, batch, rng):
        return mlp_loss(params, {**batch, "x": batch["x"] * a}, rng) * jnp.float32(1e-4)

    zero = {}
    for name, ls in (("none", NoOpLossScale()), ("scaled", StaticLossScale(2.0**15))):
        _, metrics = stats_step(make_state("fp16", ls), make_batch(0), tiny_loss, underflow_stats=True)
        zero[name] = float(metrics["underflow"]["zero_fraction"])
        assert set(metrics["underflow"]["leaf_zero_fraction"]) == {"l1", "l2"}
    assert zero["none"] > zero["scaled"] + 0.2
    _, metrics = stats_step(make_state("fp16", StaticLossScale(2.0**10)), rows_batch(0), rows_loss,
                            underflow_stats=True, accum_steps=4)
    assert 0 <= float(metrics["underflow"]["zero_fraction"]) <= 1
    assert np.isfinite(float(metrics["underflow"]["headroom_log2"]))


def test_underflow_headroom_under_autocast_is_the_compute_dtypes():
    """Under autocast the param gradients are float32 but the backward GEMMs ran in float16: the headroom is
    measured against 65504, as under the cast policy (it read ~115 doublings, float32's range, and the step then
    overflowed a few doublings later)."""
    headroom = {}
    for policy in ("fp16", "fp16;autocast"):
        state = make_state(policy, StaticLossScale(2.0**15))
        _, metrics = train_step(state, make_batch(0), mlp_loss, underflow_stats=True)
        headroom[policy] = float(metrics["underflow"]["headroom_log2"])
        assert jax.tree.leaves(state.params)[0].dtype == jnp.float32 or policy == "fp16"
    assert 0 < headroom["fp16;autocast"] < 20, headroom
    np.testing.assert_allclose(headroom["fp16;autocast"], headroom["fp16"], atol=0.05)
    k = int(headroom["fp16"]) + 2  # past the headroom: both overflow
    for policy in ("fp16", "fp16;autocast"):
        _, metrics = train_step(make_state(policy, StaticLossScale(2.0 ** (15 + k))), make_batch(0), mlp_loss,
                                underflow_stats=True)
        assert not bool(metrics["grads_finite"]) and float(metrics["underflow"]["headroom_log2"]) < 0, policy


@pytest.mark.slow
def test_differentiable_through_the_step():
    """Hypergradients: d(updated params)/d(batch) through train_step (the finite check and norm are not
    differentiated)."""
    batch = make_batch(0)
    grads = {}
    for policy, scale in (("fp32", NoOpLossScale()), ("fp16", DynamicLossScale(2.0**10))):
        state = make_state(policy, scale, tx=optax.sgd(0.1))

        def updated_bias(x, state=state):
            new, _ = train_step(state, {**batch, "x": x}, mlp_loss)
            return jnp.sum(new.params["l2"]["b"])

        grads[policy] = jax.grad(updated_bias)(batch["x"])
        if policy == "fp32":  # central difference on one input
            eps = 1e-2
            up, down = updated_bias(batch["x"].at[0, 0].add(eps)), updated_bias(batch["x"].at[0, 0].add(-eps))
            diff = (up - down) / (2 * eps)
            np.testing.assert_allclose(float(diff), float(grads["fp32"][0, 0]), rtol=0.02)
    assert float(jnp.abs(grads["fp32"]).sum()) > 0
    # float16 compute: the same hypergradient to float16 rounding
    err = float(jnp.linalg.norm(grads["fp16"] - grads["fp32"]) / jnp.linalg.norm(grads["fp32"]))
    assert err < 0.02, err


def test_bad_loss_dtype_and_step_arguments():
    state = make_state()
    with pytest.raises(ValueError, match="real floating-point loss, got int32"):
        step(state, make_batch(0), lambda p, b, r: mlp_loss(p, b, r).astype(jnp.int32))
    with pytest.raises(ValueError, match="real floating-point loss, got complex64"):
        step(state, make_batch(0), lambda p, b, r: mlp_loss(p, b, r).astype(jnp.complex64))
    for bad in (2.0, True):
        with pytest.raises(ValueError, match="accum_steps must be an integer"):
            train_step(state, make_batch(0), mlp_loss, accum_steps=bad)
    with pytest.raises(ValueError, match=r"same leading size; got batch\['poison'\]: \(\)"):
        train_step(state, make_batch(0), mlp_loss, accum_steps=2)  # a scalar leaf next to [32, ...] rows
    with pytest.raises(TypeError, match=r"train_step calls loss_fn\(params, batch, rng\), but <lambda>\(p, b\) "
                                        r"cannot take it .*def loss_fn\(params, batch, rng=None\)"):
        step(state, make_batch(0), lambda p, b: mlp_loss(p, b, None))  # no rng: one line, before tracing
    step(state, make_batch(0), lambda *a: mlp_loss(*a))  # what Python cannot rule out passes
    jitted = jax.jit(train_step, static_argnames="loss_fn")  # options passed but not named static
    for option in ({"accum_steps": 2}, {"underflow_stats": True}, {"max_retries": 2}):
        name = next(iter(option))
        with pytest.raises(ValueError, match=f"{name} must be a static Python value: .*static_argnames"):
            jitted(state, rows_batch(0), rows_loss, **option)


def test_accumulation_refuses_leaves_of_another_leading_size():
    """A per-class weight vector f32[4] in the batch would be cut into pieces, silently; it is refused."""
    batch = {**rows_batch(0, n=8), "class_weights": jnp.ones((4,))}
    with pytest.raises(ValueError, match=r"same leading size; got .*batch\['class_weights'\]: \(4,\)"):
        train_step(make_state(), batch, rows_loss, accum_steps=2)


@pytest.mark.parametrize("out,what", [(lambda x: [x, {"a": 1.0}], "got list"), (lambda x: {"loss": x}, "got dict"),
                                      (lambda x: (x, 1.0, 2.0), "got a 3-tuple"), (lambda x: (x,), "got a 1-tuple"),
                                      (lambda x: None, "got NoneType")])
def test_loss_fn_return_shapes_get_one_clear_error(out, what):
    with pytest.raises(ValueError, match=f"scalar loss or a \\(loss, aux\\) tuple, {what}"):
        step(make_state(), make_batch(0), lambda p, b, r: out(mlp_loss(p, b, r)))


@pytest.mark.slow
def test_retry_skips_a_non_finite_loss_at_once():
    """No scale makes a NaN input finite: one skip, no recompute and no backoff, in both modes (issue: a NaN loss
    every step used to halve the scale every time, 32768 to 1024 in 6 steps)."""
    retry = jax.jit(train_step, static_argnames=("loss_fn", "on_overflow"))
    bad = make_batch(0)
    bad["x"] = bad["x"].at[0, 0].set(jnp.nan)
    for mode in ("skip", "retry"):
        state = make_state("fp16", DynamicLossScale(2.0**15))
        new, metrics = retry(state, bad, mlp_loss, on_overflow=mode)
        assert not bool(metrics["loss_finite"]) and not bool(metrics["grads_finite"])
        assert int(metrics["retries"]) == 0 and float(new.loss_scale.loss_scale) == 2.0**15, mode
        assert int(metrics["consecutive_skips"]) == 1, mode
        assert bits(new.params) == bits(state.params)


@pytest.mark.slow
def test_loss_goes_to_optax_as_value():
    """Transformations that take `value=` (reduce_on_plateau, polyak_sgd) get the unscaled float32 loss."""

    def record_value():
        def update(updates, state, params=None, *, value, **extra):
            del params, extra
            return updates, value.astype(jnp.float32)
        return optax.GradientTransformationExtraArgs(lambda params: jnp.zeros((), jnp.float32), update)

    state = make_state("fp16", DynamicLossScale(2.0**10), tx=optax.chain(optax.sgd(1e-2), record_value()))
    new, metrics = step(state, make_batch(0), mlp_loss)
    assert float(new.opt_state[1]) == float(metrics["loss"]) > 0
    plateau = make_state("fp16", DynamicLossScale(2.0**10),
                         tx=optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=1)))
    for i in range(3):
        plateau, metrics = step(plateau, make_batch(i), mlp_loss)
        assert bool(metrics["grads_finite"])
    polyak = make_state(tx=optax.polyak_sgd())
    polyak, metrics = step(polyak, make_batch(0), mlp_loss)
    assert bool(metrics["grads_finite"]) and bits(polyak.params) != bits(make_state().params)
