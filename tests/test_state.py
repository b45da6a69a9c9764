import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

from jaxamp import DynamicLossScale, NoOpLossScale, TrainState, get_policy


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
    with pytest.raises(ValueError, match="rng must be a PRNG key"):
        TrainState.create(params=_params(), tx=optax.sgd(0.1), policy=get_policy("fp16"),
                          loss_scale=NoOpLossScale(), rng=jnp.zeros((3,), jnp.float32))
