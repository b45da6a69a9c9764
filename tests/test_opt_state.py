"""Optimizer state in bfloat16 (`";opt_state=bf16"`, `jaxamp.opt_state.low_precision_state`): float32 master
weights, bfloat16 Adam moments, the update computed in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from asserts import assert_trees_equal

from jaxamp import NoOpLossScale, TrainState, get_policy, train_step
from jaxamp.checkpoint import Checkpointer
from jaxamp.opt_state import low_precision_state, optimizer_bytes_per_param
from jaxamp.precision import opt_state_dtype, policy_name

STEP = jax.jit(train_step, static_argnames="loss_fn")
W_TRUE = jax.random.normal(jax.random.key(0), (16, 4))


def loss_fn(params, batch, rng):
    h = jnp.tanh(batch["x"].astype(params["w1"].dtype) @ params["w1"])
    return jnp.mean(((h @ params["w2"]).astype(jnp.float32) - batch["y"]) ** 2)


def make_batch(i: int):
    x = jax.random.normal(jax.random.key(100 + i), (32, 16))
    return {"x": x, "y": jnp.tanh(x @ W_TRUE)}


def make_state(policy: str, tx=None) -> TrainState:
    k1, k2 = jax.random.split(jax.random.key(1))
    params = {"w1": jax.random.normal(k1, (16, 32)) * 0.25, "w2": jax.random.normal(k2, (32, 4)) * 0.25}
    return TrainState.create(params=params, tx=tx or optax.adamw(3e-3), policy=policy, loss_scale=NoOpLossScale(),
                             rng=jax.random.key(2))


def dtypes(tree) -> set:
    return {str(x.dtype) for x in jax.tree.leaves(tree)}


def test_the_rule_round_trips_and_bad_values_are_refused():
    policy = get_policy("bf16;opt_state=bf16")
    assert opt_state_dtype(policy) == "bfloat16" and policy_name(policy) == "bf16;opt_state=bf16"
    assert get_policy(policy_name(policy)) == policy
    assert policy_name(get_policy("fp8-current;opt_state=bf16")) == "fp8-current;opt_state=bf16"
    with pytest.raises(ValueError, match="bf16 or fp16"):
        get_policy("bf16;opt_state=float32")
    with pytest.raises(ValueError, match="16-bit float"):
        low_precision_state(optax.adam(1e-3), jnp.float32)


def test_moments_stay_bfloat16_over_100_steps_and_weights_float32():
    state = make_state("bf16;opt_state=bf16")
    adam = state.opt_state[0]
    assert dtypes(adam.mu) == dtypes(adam.nu) == {"bfloat16"} and adam.count.dtype == jnp.int32
    for i in range(100):
        state, metrics = STEP(state, make_batch(i % 8), loss_fn)
    adam = state.opt_state[0]
    assert dtypes(adam.mu) == dtypes(adam.nu) == {"bfloat16"} and adam.count.dtype == jnp.int32
    assert dtypes(state.params) == {"float32"} and int(adam.count) == 100


def test_bytes_per_parameter_fall_from_12_to_8():
    full = make_state("bf16")
    assert optimizer_bytes_per_param(full.params, full.opt_state) == pytest.approx(12.0, abs=0.01)  # + the count
    low = make_state("bf16;opt_state=bf16")
    assert optimizer_bytes_per_param(low.params, low.opt_state) == pytest.approx(8.0, abs=0.01)  # + the count


def test_bf16_moments_train_as_float32_moments():
    losses = {}
    for policy in ("bf16", "bf16;opt_state=bf16"):
        state = make_state(policy)
        for i in range(60):
            state, metrics = STEP(state, make_batch(i % 8), loss_fn)
        losses[policy] = float(metrics["loss"])
    assert losses["bf16"] < 0.5 * float(STEP(make_state("bf16"), make_batch(0), loss_fn)[1]["loss"])  # it learns
    assert abs(losses["bf16;opt_state=bf16"] - losses["bf16"]) < 0.05 * losses["bf16"], losses


def test_a_resume_with_bf16_moments_is_bitwise(tmp_path):
    state = make_state("bf16;opt_state=bf16")
    for i in range(3):
        state, _ = STEP(state, make_batch(i), loss_fn)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(state, {"policy": "bf16;opt_state=bf16"})
        restored, _ = ckpt.restore(make_state("bf16;opt_state=bf16"))
    assert_trees_equal(restored.opt_state, state.opt_state)
    for i in range(3, 6):
        state, _ = STEP(state, make_batch(i), loss_fn)
        restored, _ = STEP(restored, make_batch(i), loss_fn)
    assert_trees_equal(restored.params, state.params)
    assert_trees_equal(restored.opt_state, state.opt_state)
    assert dtypes(restored.opt_state[0].mu) == {"bfloat16"}
    assert np.asarray(restored.step) == 6


@pytest.mark.slow
def test_the_lm_trains_under_fp8_current_with_bf16_moments_and_says_its_bytes_per_parameter(tmp_path, capsys):
    from jaxamp.lm.config import TrainConfig
    from jaxamp.lm.train import train

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(chr(97 + (i * 7) % 26) for i in range(20000)))
    summary = train(TrainConfig(data=str(corpus), steps=6, workdir=str(tmp_path / "run"), layers=1, heads=2,
                                width=32, seq_len=16, batch_size=4, eval_every=3, eval_batches=1, log_every=1,
                                sample_tokens=0, checkpoint_every=3, warmup_steps=1, progress=False,
                                precision="fp8-current;opt_state=bf16"))
    out = capsys.readouterr().out
    assert summary["steps"] == 6 and np.isfinite(summary["val_loss"]), summary
    assert "8.0 bytes per parameter with the optimizer state" in out
    assert "precision audit (fp8-current;opt_state=bf16)" in out and "% in FP8)" in out
