import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from asserts import assert_same_structure, assert_trees_equal

from jaxamp import DynamicLossScale, NoOpLossScale, StaticLossScale, TrainState, get_policy


def _params(dtype=jnp.float32):
    return {"w": jnp.full((3, 2), 0.5, dtype), "b": jnp.zeros((2,), dtype)}


def test_create_casts_params_and_inits_optimizer():
    state = TrainState.create(params=_params(jnp.bfloat16), tx=optax.adam(1e-3), policy=get_policy("fp16"),
                              loss_scale=DynamicLossScale(), rng=jax.random.key(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    assert all(x.dtype in (jnp.float32, jnp.int32) for x in jax.tree.leaves(state.opt_state))
    assert state.step.dtype == jnp.int32 and int(state.step) == 0
    assert state.rng.dtype == jnp.uint32 and state.rng.shape == (2,)
    np.testing.assert_array_equal(state.rng, jax.random.key_data(jax.random.key(0)))


def test_raw_key_accepted():
    state = TrainState.create(params=_params(), tx=optax.sgd(0.1), policy=get_policy("fp32"),
                              loss_scale=NoOpLossScale(), rng=jax.random.PRNGKey(3))
    np.testing.assert_array_equal(state.rng, jax.random.PRNGKey(3))


def test_static_fields_survive_jit_and_tree_map():
    tx = optax.adam(1e-3)
    state = TrainState.create(params=_params(), tx=tx, policy=get_policy("bf16"),
                              loss_scale=DynamicLossScale(8.0, min_loss_scale=2.0**-6), rng=jax.random.key(1))
    out = jax.jit(lambda s: s)(state)
    assert out.tx is tx and out.policy == get_policy("bf16")
    assert out.loss_scale.min_loss_scale == 2.0**-6
    shapes = jax.eval_shape(lambda s: s, state)
    assert shapes.loss_scale.loss_scale.dtype == jnp.float32
    assert jax.tree.structure(jax.tree.map(lambda x: x, state)) == jax.tree.structure(state)


def test_rejects_jmp_loss_scale_and_bad_rng():
    with pytest.raises(ValueError, match="loss_scale must be a jaxamp"):
        TrainState.create(params=_params(), tx=optax.sgd(0.1), policy=get_policy("fp16"),
                          loss_scale=jmp.DynamicLossScale(jnp.float32(2.0**15)), rng=jax.random.key(0))
    with pytest.raises(ValueError, match="rng must be a"):
        TrainState.create(params=_params(), tx=optax.sgd(0.1), policy=get_policy("fp16"),
                          loss_scale=NoOpLossScale(), rng=jnp.zeros((3,), jnp.float32))


def test_policy_spec_string_and_bad_policy_params_and_key():
    state = TrainState.create(params=_params(), tx=optax.sgd(0.1), policy="fp16", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(0))
    assert state.policy == get_policy("fp16")
    make = lambda **kw: TrainState.create(**{**dict(params=_params(), tx=optax.sgd(0.1), policy="fp32",
                                                    loss_scale=NoOpLossScale(), rng=jax.random.key(0)), **kw})
    with pytest.raises(ValueError, match="policy must be a jmp.Policy"):
        make(policy=None)
    with pytest.raises(ValueError, match="fp7"):
        make(policy="fp7")
    with pytest.raises(ValueError, match=r"params\['n'\] is int32: master weights must be float"):
        make(params={**_params(), "n": jnp.arange(3)})
    with pytest.raises(ValueError, match="threefry2x32 PRNG key .* got a rbg key"):
        make(rng=jax.random.key(0, impl="rbg"))
    with pytest.raises(ValueError, match=r"params\['name'\] is str: master weights must be float"):
        make(params={**_params(), "name": "dense"})
    with pytest.raises(ValueError, match="tx must be an optax GradientTransformation.*got NoneType"):
        make(tx=None)


def test_python_float_leaves_become_float32_arrays():
    """A Python float leaf would stay weakly typed: the state's types would change after step 1 (a second trace)."""
    from jaxamp import train_step

    traces = []

    def loss_fn(p, batch, rng):
        traces.append(1)
        return jnp.mean((batch.astype(jnp.float16) @ p["w"] * p["t"]).astype(jnp.float32) ** 2)

    state = TrainState.create(params={"w": jnp.ones((4, 2)), "t": 1.0}, tx=optax.adam(1e-2), policy="fp16",
                              loss_scale=DynamicLossScale(2.0**10), rng=jax.random.key(0))
    assert state.params["t"].dtype == jnp.float32 and not state.params["t"].weak_type
    step = jax.jit(train_step, static_argnames="loss_fn")
    for _ in range(3):
        state, metrics = step(state, jnp.ones((3, 4)), loss_fn)
    assert len(traces) == 1 and bool(metrics["grads_finite"])
    assert not state.opt_state[0].mu["t"].weak_type


def test_shared_buffers_are_copied_so_the_state_can_be_donated():
    """Tied initial weights (one array in two leaves) and LookaheadParams.init_synced alias buffers."""
    from jaxamp import train_step

    w = jnp.ones((4, 2))

    def loss_fn(p, batch, rng):
        return jnp.mean((batch.astype(jnp.float16) @ p["enc"] @ p["dec"].T).astype(jnp.float32) ** 2)

    make = lambda params: TrainState.create(params=params, tx=optax.adam(1e-2), policy="fp16",
                                            loss_scale=DynamicLossScale(2.0**10), rng=jax.random.key(0))
    tied = make({"enc": w, "dec": w})
    assert (tied.params["enc"] is w) != (tied.params["dec"] is w)  # the second use is a copy
    ids = [id(x) for x in jax.tree.leaves((tied.params, tied.opt_state))]
    assert len(ids) == len(set(ids))
    donated = jax.jit(train_step, static_argnames="loss_fn", donate_argnums=0)
    reference = jax.jit(train_step, static_argnames="loss_fn")
    ref_state = make({"enc": jnp.ones((4, 2)), "dec": jnp.ones((4, 2))})
    for _ in range(2):
        tied, _ = donated(tied, jnp.ones((3, 4)), loss_fn)
        ref_state, _ = reference(ref_state, jnp.ones((3, 4)), loss_fn)
    assert_trees_equal(tied.params, ref_state.params, bitwise=False)
    # Two distinct Array objects over one buffer (device_put of a tied tree) are caught too.
    w2 = jnp.ones((4, 2))  # (w itself was donated above)
    placed = jax.device_put({"enc": w2, "dec": w2}, jax.devices()[0])
    assert placed["enc"] is not placed["dec"]
    state = make(placed)
    state, metrics = donated(state, jnp.ones((3, 4)), loss_fn)
    assert bool(metrics["grads_finite"])


def test_train_state_round_trips_through_flax_serialization():
    import flax.serialization

    tx = optax.adam(1e-3)
    for scale in (NoOpLossScale(), StaticLossScale(8.0), DynamicLossScale(2.0**10, growth_interval=3, hysteresis=2)):
        state = TrainState.create(params=_params(), tx=tx, policy="fp16", loss_scale=scale, rng=jax.random.key(0))
        state = state.replace(loss_scale=state.loss_scale.adjust(jnp.array(True)).adjust(jnp.array(False)))
        target = TrainState.create(params={"w": jnp.ones((3, 2)), "b": jnp.ones(2)}, tx=tx, policy="fp16",
                                   loss_scale=scale, rng=jax.random.key(1))
        restored = flax.serialization.from_bytes(target, flax.serialization.to_bytes(state))
        assert jax.tree.structure(restored) == jax.tree.structure(state)
        assert_trees_equal(restored, state)
        abstract = jax.eval_shape(lambda t=target: t)  # an abstract target works too
        restored = flax.serialization.from_bytes(abstract, flax.serialization.to_bytes(state))
        assert_trees_equal(restored, state)
    as_dict = flax.serialization.to_state_dict(state)["loss_scale"]
    assert sorted(as_dict) == ["growth_counter", "loss_scale", "overflow_counter"]
    assert int(as_dict["overflow_counter"]) == 1
    with pytest.raises(ValueError, match="must have the fields"):
        flax.serialization.from_state_dict(DynamicLossScale(), {"loss_scale": 8.0})


def test_with_policy_carries_the_run_over_and_refuses_another_master_dtype():
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros((2,))}
    state = TrainState.create(params=params, tx=optax.adam(1e-3), policy="fp16", loss_scale=DynamicLossScale(8.0),
                              rng=jax.random.key(0))
    switched = state.with_policy("bf16", NoOpLossScale())
    assert switched.policy == get_policy("bf16") and isinstance(switched.loss_scale, NoOpLossScale)
    assert_same_structure((state.params, state.opt_state, state.step, state.rng),
                          (switched.params, switched.opt_state, switched.step, switched.rng))
    for a, b in zip(jax.tree.leaves((state.params, state.opt_state, state.step, state.rng)),
                    jax.tree.leaves((switched.params, switched.opt_state, switched.step, switched.rng))):
        assert a is b
    with pytest.raises(ValueError, match="master weights are float32 but the new policy keeps them in float16"):
        state.with_policy("float16", NoOpLossScale())
    with pytest.raises(ValueError, match="loss_scale"):
        state.with_policy("bf16", 1.0)
