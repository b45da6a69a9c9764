"""FP8 with delayed scaling: Flax's FP8 ops through jaxamp's train_step (the overwrite-with-gradient collection)."""

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxamp import DynamicLossScale, NoOpLossScale, StaticLossScale, TrainState, get_policy, train_step
from jaxamp.checkpoint import Checkpointer
from jaxamp.fp8_collection import FP8_COLLECTION
from jaxamp.layers import Dense
from jaxamp.lm.metrics_log import read_metrics
from jaxamp.precision import policy_name, uses_fp8

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
HISTORY = 4
STEP = jax.jit(train_step, static_argnames=("loss_fn", "accum_steps"))


class Net(nn.Module):
    """Two FP8 Dense layers (no bias: the bias add is not an FP8 matmul)."""

    @nn.compact
    def __call__(self, x):
        h = Dense(16, use_bias=False, fp8=True, fp8_amax_history=HISTORY, name="d0")(x)
        return Dense(1, use_bias=False, fp8=True, fp8_amax_history=HISTORY, name="d1")(jnp.tanh(h))


NET = Net()


def net_loss(params, batch, rng):
    del rng
    dtype = params["params"]["d0"]["kernel"].dtype
    y = NET.apply(params, batch["x"].astype(dtype))  # [batch, 1] in the compute dtype
    return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"]) * batch["poison"])


def make_batch(i: int, scale: float = 1.0, poison: float = 1.0) -> dict:
    kx, ky = jax.random.split(jax.random.key(100 + i))
    return {"x": jax.random.normal(kx, (32, 8)) * scale, "y": jax.random.normal(ky, (32, 1)),
            "poison": jnp.asarray(poison, jnp.float32)}


def make_state(policy="fp8", loss_scale=None) -> TrainState:
    variables = NET.init(jax.random.key(0), jnp.zeros((1, 8)))
    assert set(variables) == {"params", FP8_COLLECTION}
    return TrainState.create(params=variables, tx=optax.adam(1e-2), policy=policy,
                             loss_scale=loss_scale or NoOpLossScale(), rng=jax.random.key(1))


def fp8_state(state: TrainState, layer: str = "d0") -> dict:
    return {k: np.asarray(v) for k, v in state.params[FP8_COLLECTION][layer]["fp8"].items()}


def bits(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def test_fp8_policy_names_and_flag():
    policy = get_policy("fp8")
    assert uses_fp8(policy) and not uses_fp8(get_policy("bf16"))
    assert jnp.dtype(policy.compute_dtype) == jnp.bfloat16 and jnp.dtype(policy.param_dtype) == jnp.float32
    assert policy_name(policy) == "fp8" and get_policy("fp16;fp8").compute_dtype == jnp.float16
    assert get_policy(policy_name(get_policy("fp16;fp8"))) == get_policy("fp16;fp8")


@pytest.mark.slow
def test_the_experiments_fp8_policy_keeps_the_lm_tables_float32():
    """Under FP8 `params` is the variables dict ("params/wte/embedding"): the LM's tables still stay float32."""
    from jaxamp.lm.model import TransformerConfig, TransformerLM
    from jaxamp.lm.setup import make_policy

    model = TransformerLM(TransformerConfig(vocab_size=8, seq_len=4, num_layers=1, num_heads=2, width=8, fp8=True))
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    state = TrainState.create(params=variables, tx=optax.sgd(0.1), policy=make_policy("fp8"),
                              loss_scale=NoOpLossScale(), rng=jax.random.key(1))
    compute = state.compute_params()["params"]
    assert compute["wte"]["embedding"].dtype == compute["wpe"]["embedding"].dtype == jnp.float32
    assert compute["h_0"]["mlp"]["c_fc"]["kernel"].dtype == jnp.bfloat16


@pytest.mark.slow
def test_dense_forward_and_backward_round_trip_within_fp8_tolerance():
    """The FP8 Dense against float32: forward within e4m3 rounding (2^-4 relative per operand), the input gradient
    within e5m2 rounding (2^-3), and not equal (it did quantize)."""
    layer = Dense(64, use_bias=False, fp8=True)
    x = jax.random.normal(jax.random.key(0), (128, 64), jnp.float32)
    variables = layer.init(jax.random.key(1), x)
    ref_layer = Dense(64, use_bias=False)
    g = jax.random.normal(jax.random.key(2), (128, 64))  # the output gradient
    # One step of delayed scaling first (the scales start at 1): the "gradient" of the collection is its new value.
    fp8_vars = {**variables, FP8_COLLECTION: jax.grad(lambda f: jnp.sum(layer.apply(
        {"params": variables["params"], FP8_COLLECTION: f}, x) * g))(variables[FP8_COLLECTION])}
    y = layer.apply(fp8_vars, x)
    y_ref = ref_layer.apply({"params": variables["params"]}, x)
    rel = float(jnp.linalg.norm(y - y_ref) / jnp.linalg.norm(y_ref))
    assert 1e-4 < rel < 2 * 2.0**-4, rel
    gx = jax.grad(lambda x: jnp.sum(layer.apply(fp8_vars, x) * g))(x)
    gx_ref = jax.grad(lambda x: jnp.sum(ref_layer.apply({"params": variables["params"]}, x) * g))(x)
    rel_g = float(jnp.linalg.norm(gx - gx_ref) / jnp.linalg.norm(gx_ref))
    assert 1e-4 < rel_g < 2 * 2.0**-3, rel_g


@pytest.mark.slow
def test_amax_history_rolls_and_the_scale_is_amax_over_fp8_max():
    state = make_state()
    amaxes, scales = [], []
    for i in range(HISTORY + 2):
        batch = make_batch(i, scale=1.0 + i)  # growing inputs: each step's amax is larger
        x_c = batch["x"].astype(jnp.bfloat16)
        state, metrics = STEP(state, batch, net_loss)
        assert bool(metrics["grads_finite"])
        f = fp8_state(state)
        amaxes.append(float(jnp.max(jnp.abs(x_c)).astype(jnp.float32)))
        scales.append(float(f["input_scale"][0]))
        # Flax's roll: the newest amax at index 0, the previous ones rolled to the end.
        assert f["input_amax_history"][0] == np.float32(amaxes[-1])
        held = sorted(float(v) for v in f["input_amax_history"] if v > 0)
        assert held == sorted(amaxes[-HISTORY:])  # the last HISTORY amaxes, no more
    # The scale used at step k comes from the history before it: max of the previous HISTORY amaxes / 448.
    for k in range(1, len(amaxes)):
        previous = amaxes[max(0, k - HISTORY):k]
        assert scales[k] == pytest.approx(max(previous) / E4M3_MAX, rel=1e-6), k
    assert scales[0] == 1.0  # an empty history keeps the initial scale


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fp8", "fp16;fp8"])
def test_fp8_state_and_params_are_identical_under_static_loss_scales_1_and_2_to_the_10(policy):
    states = []
    for scale in (1.0, 2.0**10):
        state = make_state(policy, StaticLossScale(scale))
        for i in range(3):
            state, metrics = STEP(state, make_batch(i), net_loss)
            assert bool(metrics["grads_finite"])
        states.append(state)
    assert bits(states[0].params[FP8_COLLECTION]) == bits(states[1].params[FP8_COLLECTION])
    assert bits(states[0].params["params"]) == bits(states[1].params["params"])
    assert fp8_state(states[0])["output_grad_scale"][0] < 1e-2  # stored loss-scale free (not 2^10 larger)


@pytest.mark.slow
def test_accumulation_keeps_the_newest_history_with_the_max_amax():
    state = make_state()
    state, _ = STEP(state, make_batch(0), net_loss)  # a non-empty history
    before, kernel = fp8_state(state), state.params["params"]["d0"]["kernel"]
    a, b = make_batch(1, scale=1.0), make_batch(2, scale=3.0)
    both = {"x": jnp.stack([a["x"], b["x"]], 1).reshape(64, 8), "y": jnp.stack([a["y"], b["y"]], 1).reshape(64, 1),
            "poison": jnp.ones((64,), jnp.float32)}  # strided micro-batches: rows 0, 2, ... are a; 1, 3, ... are b
    accum_loss = lambda p, batch, rng: net_loss(p, {**batch, "poison": batch["poison"][0]}, rng)  # noqa: E731
    state, metrics = STEP(state, both, accum_loss, accum_steps=2)
    assert bool(metrics["grads_finite"])
    after = fp8_state(state)
    amax = max(float(jnp.max(jnp.abs(m["x"].astype(jnp.bfloat16))).astype(jnp.float32)) for m in (a, b))
    assert after["input_amax_history"][0] == np.float32(amax)  # the larger micro-batch's amax
    np.testing.assert_array_equal(after["input_amax_history"][1:], np.roll(before["input_amax_history"], -1)[1:])
    # Rolled once per optimizer step, not once per micro-batch: the kernel (the same in both) appears once more.
    kernel_amax = np.float32(jnp.max(jnp.abs(kernel.astype(jnp.bfloat16))).astype(jnp.float32))
    assert after["kernel_amax_history"][0] == kernel_amax
    np.testing.assert_array_equal(after["kernel_amax_history"][1:], np.roll(before["kernel_amax_history"], -1)[1:])


@pytest.mark.slow
def test_a_skipped_step_leaves_the_fp8_state_and_params_bitwise_unchanged():
    state = make_state("fp16;fp8", DynamicLossScale(2.0**10))
    state, _ = STEP(state, make_batch(0), net_loss)
    # A finite float32 loss whose float16 backward overflows (an inf loss would be skipped with the scale kept).
    after, metrics = STEP(state, make_batch(1, poison=1e30), net_loss)
    assert not bool(metrics["grads_finite"]) and np.isfinite(float(metrics["loss"]))
    assert bits(after.params) == bits(state.params) and bits(after.opt_state) == bits(state.opt_state)
    assert float(after.loss_scale.loss_scale) == 2.0**9


@pytest.mark.slow
def test_fp8_state_round_trips_a_checkpoint_bitwise_and_steps_compile_once(tmp_path):
    traces = []

    def counting_loss(params, batch, rng):
        traces.append(1)
        return net_loss(params, batch, rng)

    state = make_state("fp16;fp8", DynamicLossScale(2.0**4, growth_interval=1))
    scales = set()
    for i in range(6):
        state, metrics = STEP(state, make_batch(i, poison=float("inf") if i == 3 else 1.0), counting_loss)
        scales.add(float(metrics["loss_scale"]))
    assert len(traces) == 1 and len(scales) >= 4
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(state, {"run": "fp8"}, force=True)
        ckpt.wait()
        restored, _ = ckpt.restore(jax.eval_shape(lambda: state))
    assert bits(restored) == bits(state)
    a, _ = STEP(state, make_batch(9), counting_loss)
    b, _ = STEP(restored, make_batch(9), counting_loss)
    assert bits(a) == bits(b) and len(traces) == 1


@pytest.mark.slow
def test_flax_dense_with_fp8_ops_trains_with_no_extra_plumbing():
    """Research code: stock `nn.Dense(dot_general_cls=nn.Fp8DirectDotGeneralOp)`, the variables dict as params."""

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(32, dot_general_cls=nn.Fp8DirectDotGeneralOp)(x))
            return nn.Dense(1, dot_general_cls=nn.Fp8DirectDotGeneralOp)(x)

    model = Mlp()
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8)))

    def loss_fn(params, batch, rng):
        del rng
        y = model.apply(params, batch["x"].astype(jnp.bfloat16))
        return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"]))

    state = TrainState.create(params=variables, tx=optax.adam(3e-2), policy="fp8", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(1))
    batch = make_batch(0)
    losses = []
    for _ in range(20):
        state, metrics = STEP(state, batch, loss_fn)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.7 * losses[0]
    fp8 = state.params[FP8_COLLECTION]
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(fp8))
    assert float(fp8["Dense_0"]["Fp8DirectDotGeneralOp_0"]["input_scale"][0]) != 1.0  # delayed scaling ran
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.opt_state) if hasattr(x, "dtype")
               and jnp.issubdtype(x.dtype, jnp.floating))
    assert FP8_COLLECTION not in str(jax.tree_util.tree_structure(state.opt_state))  # no optimizer state for it


@pytest.mark.slow
def test_precision_fp8_trains_close_to_bf16(text_corpus, tmp_path):
    """`--precision fp8` for 60 steps: the loss falls, and it differs from bf16 while staying within a few %."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import train_lm

    args = ["--data", str(text_corpus), "--layers", "1", "--heads", "2", "--width", "64", "--seq-len", "32",
            "--batch-size", "16", "--steps", "60", "--warmup-steps", "10", "--eval-every", "60", "--eval-batches", "4",
            "--sample-tokens", "0", "--no-progress"]
    curves = {}
    for precision in ("bf16", "fp8"):
        assert train_lm.main([*args, "--precision", precision, "--workdir", str(tmp_path / precision)]) == 0
        curves[precision] = [r["loss"] for r in read_metrics(tmp_path / precision / "metrics.jsonl")]
    fp8, bf16 = np.asarray(curves["fp8"]), np.asarray(curves["bf16"])
    assert fp8[-10:].mean() < 0.85 * fp8[:5].mean()
    assert not np.array_equal(fp8, bf16)
    assert abs(fp8[-10:].mean() - bf16[-10:].mean()) / bf16[-10:].mean() < 0.03


@pytest.mark.slow
def test_fp8_ranges_report_saturation_against_the_delayed_scale():
    from jaxamp.fp8_report import FP8_FORMATS, format_fp8_table, fp8_ranges

    assert (FP8_FORMATS["e4m3"].max, FP8_FORMATS["e5m2"].max) == (E4M3_MAX, E5M2_MAX)
    state = make_state()
    for i in range(3):
        state, _ = STEP(state, make_batch(i), net_loss)
    calm = {(r["layer"], r["tensor"]): r for r in fp8_ranges(state, make_batch(5), net_loss)}
    assert set(calm) == {(f"{d}/fp8", t) for d in ("d0", "d1") for t in ("input", "kernel", "output_grad")}
    history = fp8_state(state)["input_amax_history"]
    assert calm[("d0/fp8", "input")]["capacity"] == pytest.approx(float(history.max()), rel=1e-6)  # 448 * amax/448
    assert calm[("d0/fp8", "input")]["saturated"] == 0.0 and calm[("d0/fp8", "output_grad")]["format"] == \
        "float8_e5m2"
    loud = {(r["layer"], r["tensor"]): r for r in fp8_ranges(state, make_batch(5, scale=200.0), net_loss)}
    assert loud[("d0/fp8", "input")]["amax_over_capacity"] > 100 and loud[("d0/fp8", "input")]["saturated"] > 0.9
    assert loud[("d0/fp8", "kernel")] == calm[("d0/fp8", "kernel")]  # the kernel did not change
    assert "| d0/fp8 | input | float8_e4m3fn |" in format_fp8_table(list(loud.values()))
    with pytest.raises(ValueError, match="no FP8 collection"):
        fp8_ranges(TrainState.create(params={"w": jnp.ones(2)}, tx=optax.sgd(1.0), policy="bf16",
                                     loss_scale=NoOpLossScale(), rng=jax.random.key(0)), make_batch(0), net_loss)


class EinsumNet(nn.Module):
    """Flax's `Fp8Einsum` (its equation comes before the operands)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (8, 4), jnp.float32).astype(x.dtype)
        return nn.Fp8Einsum(amax_history_length=HISTORY, name="ein")("bi,io->bo", x, w)


def test_fp8_ranges_reads_fp8_einsum_operands_and_frozen_dict_params():
    import flax

    from jaxamp.fp8_report import fp8_ranges

    net = EinsumNet()
    state = TrainState.create(params=net.init(jax.random.key(0), jnp.zeros((1, 8))), tx=optax.sgd(0.1),
                              policy="fp8", loss_scale=NoOpLossScale(), rng=jax.random.key(1))

    def loss(params, batch, rng):
        return jnp.mean(net.apply(params, batch["x"].astype(jnp.bfloat16)).astype(jnp.float32) ** 2)

    batch = make_batch(0)
    state, _ = STEP(state, batch, loss)
    state = state.replace(params=flax.core.freeze(state.params))  # a FrozenDict variables dict is one too
    rows = {r["tensor"]: r for r in fp8_ranges(state, batch, loss)}
    x_amax = float(jnp.max(jnp.abs(batch["x"].astype(jnp.bfloat16))).astype(jnp.float32))
    w_amax = float(jnp.max(jnp.abs(state.params["params"]["w"].astype(jnp.bfloat16))).astype(jnp.float32))
    assert (rows["input"]["amax"], rows["kernel"]["amax"]) == (x_amax, w_amax)
    assert rows["input"]["layer"] == "ein" and rows["output_grad"]["amax"] > 0


FSDP_CHILD = """
import json, sys
import jax, numpy as np
sys.path.insert(0, sys.argv[1])
from asserts import leaf_pairs
from test_fp8 import FP8_COLLECTION, STEP, make_batch, make_state, net_loss
from jaxamp import sharding, train_step

mesh = sharding.make_mesh("data=2,fsdp=2")
one = make_state()
many = sharding.shard_state(make_state(), mesh)
step = sharding.jit_train_step(lambda s, b: train_step(s, b, net_loss), mesh)
for i in range(3):
    batch = {**make_batch(i), "poison": np.ones((32, 1), np.float32)}  # every leaf with a leading batch axis
    one, _ = STEP(one, batch, net_loss)
    many, metrics = step(many, sharding.make_global_batch(lambda a, z: jax.tree.map(lambda x: x[a:z], batch), 32,
                                                          mesh))
history = many.params[FP8_COLLECTION]["d0"]["fp8"]["input_amax_history"]
host = sharding.gather_to_host(many.params)
diff = max(float(np.max(np.abs(a - b))) for _, a, b in leaf_pairs(host, one.params))  # fails on a lost leaf
print(json.dumps({"spec": str(history.sharding.spec), "finite": bool(metrics["grads_finite"]), "diff": diff,
                  "fp8_equal": all(np.array_equal(a, b) for _, a, b in leaf_pairs(host[FP8_COLLECTION],
                                                                                   one.params[FP8_COLLECTION]))}))
"""


@pytest.mark.slow
def test_fp8_state_shards_like_the_rest_and_matches_one_device():
    """data=2,fsdp=2 on 4 fake devices: the FP8 histories are sharded along fsdp like any params leaf, and three
    steps match one device (the FP8 state exactly: maxima do not depend on the sum order)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
           "PYTHONPATH": os.pathsep.join([str(tests.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", FSDP_CHILD, str(tests)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["spec"] in ("PartitionSpec('fsdp',)", "P('fsdp',)") and out["finite"]  # jax's repr varies
    # Params: the cross-device sum changes the order of additions; Adam (lr 1e-2) turns that into differences far
    # below one learning-rate step (measured 1.2e-4), as the README's scaling section explains.
    assert out["fp8_equal"] and out["diff"] < 2e-3


def test_fp8_ranges_count_as_saturated_only_what_the_clip_changes_beyond_rounding():
    """9.383188 / (9.383188 / 448) is 448.00003 in float32: the value that set the scale rounds to 448, not saturated.
    e4m3 casts above 464 to NaN (the clip matters there), e5m2 from 61440 on to inf."""
    from jaxamp.fp8_report import _row

    amax = np.float32(9.383188)
    assert np.abs(np.array([amax])) / (float(amax) / 448.0) > 448  # the division rounds up
    history, scale = np.array([amax], np.float32), np.array([1.0], np.float32)
    at_amax = _row("d", "input", np.array([amax, amax / 2], np.float32), history, scale)
    assert at_amax["saturated"] == 0.0 and at_amax["amax_over_capacity"] == pytest.approx(1.0)
    assert _row("d", "input", np.array([amax * 1.035, amax * 1.036], np.float32), history, scale)["saturated"] == 0.5
    grads = np.array([amax * 1.0714, amax * 1.0715], np.float32)  # 61438.6 and 61444.4 after the division
    assert _row("d", "output_grad", grads, history, scale)["saturated"] == 0.5


class SharedNet(nn.Module):
    """One FP8 Dense applied twice (a weight-shared layer)."""

    @nn.compact
    def __call__(self, x):
        dense = Dense(8, use_bias=False, fp8=True, fp8_amax_history=HISTORY, name="d")
        return dense(jax.nn.relu(dense(x)))


def square_setup(net: nn.Module, width: int = 8) -> tuple[TrainState, Callable]:
    """A fresh fp8 state of `net` (inputs f32[1, width]; SGD at lr 0: the weights stay put) and the loss
    mean(net(x)^2) with x cast to bfloat16."""
    state = TrainState.create(params=net.init(jax.random.key(0), jnp.zeros((1, width))), tx=optax.sgd(0.0),
                              policy="fp8", loss_scale=NoOpLossScale(), rng=jax.random.key(1))

    def loss(params, batch, rng):
        del rng
        return jnp.mean(jnp.square(net.apply(params, batch["x"].astype(jnp.bfloat16)).astype(jnp.float32)))

    return state, loss


@pytest.mark.slow
def test_a_linen_fp8_op_called_twice_keeps_the_larger_amax_not_the_sum():
    """The two calls' new values combine by maximum (Flax's fp32_max_grad dtype), not by sum: the sum doubled the
    history every step until the loss flushed to 0."""
    state, loss = square_setup(SharedNet())

    batch = {"x": jax.random.normal(jax.random.key(2), (4, 8))}
    for _ in range(20):
        state, metrics = STEP(state, batch, loss)
    fp8 = state.params[FP8_COLLECTION]["d"]["fp8"]
    kernel_amax = float(jnp.max(jnp.abs(state.params["params"]["d"]["kernel"].astype(jnp.bfloat16))).astype(
        jnp.float32))
    assert float(fp8["kernel_amax_history"].max()) == kernel_amax
    # Fixed weights, one batch: every step records the same input amax (the larger call's), as a sum would not.
    history = np.asarray(fp8["input_amax_history"])
    assert (history == history[0]).all() and history[0] >= float(
        jnp.max(jnp.abs(batch["x"].astype(jnp.bfloat16))).astype(jnp.float32))
    assert bool(metrics["grads_finite"]) and float(metrics["loss"]) > 0.01
    eager, _ = train_step(state, batch, loss)  # without jit too (fm32's max-add exists in compiled code only)
    assert float(eager.params[FP8_COLLECTION]["d"]["fp8"]["kernel_amax_history"].max()) == kernel_amax


@pytest.mark.slow
def test_fp8_ranges_reads_the_formats_of_flax_nanoo_op():
    """Flax's NANOOFp8DotGeneralOp (AMD GPUs) quantizes to e4m3fnuz (max 240) and e5m2fnuz: the rows say so and
    scale by 240, not by e4m3fn's 448."""
    import warnings

    from jaxamp.fp8_report import fp8_ranges

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Flax deprecates the op's base class
        net = nn.Dense(4, dot_general_cls=nn.NANOOFp8DotGeneralOp)
        state = TrainState.create(params=net.init(jax.random.key(0), jnp.zeros((1, 8))), tx=optax.sgd(0.1),
                                  policy="fp8", loss_scale=NoOpLossScale(), rng=jax.random.key(1))

        def loss(params, x, rng):
            del rng
            return jnp.mean(net.apply(params, x.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)

        x = jax.random.normal(jax.random.key(2), (16, 8))
        state, _ = STEP(state, x, loss)
        rows = {r["tensor"]: r for r in fp8_ranges(state, x, loss)}
    assert [rows[t]["format"] for t in ("input", "kernel", "output_grad")] == [
        "float8_e4m3fnuz", "float8_e4m3fnuz", "float8_e5m2fnuz"]
    x_amax = float(jnp.max(jnp.abs(x.astype(jnp.bfloat16))).astype(jnp.float32))
    assert rows["input"]["scale"] == pytest.approx(x_amax / 240, rel=1e-6)
    assert rows["input"]["capacity"] == pytest.approx(x_amax, rel=1e-6) and rows["input"]["saturated"] == 0.0


@pytest.mark.parametrize("op, formats", [
    ("Fp8DotGeneralOp", ("float8_e4m3fn", "float8_e5m2")),  # quantize-dequantize: bf16 dots on convert(f8) * scale
    ("NANOOFp8DotGeneralOp", ("float8_e4m3fnuz", "float8_e5m2fnuz")),
    ("Fp8DirectDotGeneralOp", ("float8_e4m3fn", "float8_e5m2")),  # dots on FP8 operands
])
def test_the_audit_counts_flax_fp8_ops_in_fp8_and_the_step_does_not_warn(op, formats):
    """Flax's quantize-dequantize FP8 ops run their dot on `convert(f8) * scale` (XLA on a GPU rewrites that into one
    FP8 GEMM): the audit reads the operands' FP8 formats through the dequantization, as for the direct op."""
    import warnings

    from jaxamp import PrecisionWarning, precision_audit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Flax deprecates the NANOO op's base class
        net = nn.Dense(4, dot_general_cls=getattr(nn, op))
        state = TrainState.create(params=net.init(jax.random.key(0), jnp.zeros((1, 8))), tx=optax.sgd(0.1),
                                  policy="fp8", loss_scale=NoOpLossScale(), rng=jax.random.key(1))

        def loss(params, x, rng):
            return jnp.mean(net.apply(params, x.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)

        x = jax.random.normal(jax.random.key(2), (16, 8))
        report = precision_audit(state, x, loss)
        warnings.simplefilter("error", PrecisionWarning)
        STEP(state, x, loss)  # no "no matmul ran in FP8" warning
    e4m3, e5m2 = formats
    assert [(r["pass"], r["lhs"], r["rhs"]) for r in report.rows] == [
        ("forward", e4m3, e4m3), ("backward", e5m2, e4m3), ("backward", e5m2, e4m3)]
    assert report.fp8_fraction == 1.0 and "(100.0% in FP8)" in report.summary()


def test_data_times_a_mask_stored_in_fp8_is_not_an_fp8_matmul():
    """Only `convert(f8) * scale` is a dequantization: float32 data times a 0/1 mask stored in FP8 (both full-size)
    stays what autocast makes it."""
    from jaxamp import precision_audit

    mask = (jax.random.uniform(jax.random.key(2), (4, 8)) > 0.1).astype(jnp.float8_e4m3fn)

    def loss(p, b, rng):
        x = b["x"] * b["mask"].astype(jnp.float32)  # f32[4, 8], masked
        w = p["w"] * b["wmask"].astype(jnp.float32)  # f32[8, 8], pruned
        return jnp.mean((x @ w) ** 2)

    state = TrainState.create(params={"w": jnp.ones((8, 8))}, tx=optax.sgd(0.1), policy="bf16;autocast",
                              loss_scale=NoOpLossScale(), rng=jax.random.key(1))
    batch = {"x": jax.random.normal(jax.random.key(1), (4, 8)), "mask": mask,
             "wmask": jnp.ones((8, 8), jnp.float8_e4m3fn)}
    report = precision_audit(state, batch, loss)
    assert {(r["lhs"], r["rhs"]) for r in report.rows} == {("bfloat16", "bfloat16")} and report.fp8_fraction == 0.0

class TwoHeads(nn.Module):
    """Two FP8 Dense heads; the loss calls `a`, and `b` only when `use_b` (a layer the loss may leave out)."""

    use_b: bool = True

    @nn.compact
    def __call__(self, x):
        y = Dense(1, use_bias=False, fp8=True, fp8_amax_history=HISTORY, name="a")(x)
        b = Dense(1, use_bias=False, fp8=True, fp8_amax_history=HISTORY, name="b")
        return y + b(x) if self.use_b else y


@pytest.mark.slow
def test_an_fp8_op_the_loss_does_not_call_keeps_its_scales_and_history():
    """Its "gradient" is 0: taken as its new value, the scales became 0 and its next call divided by 0 (NaN)."""
    variables = TwoHeads().init(jax.random.key(0), jnp.zeros((1, 8)))
    state = TrainState.create(params=variables, tx=optax.sgd(0.1), policy="fp8", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(1))

    def make_loss(use_b):
        def loss(params, batch, rng):
            del rng
            y = TwoHeads(use_b).apply(params, batch["x"].astype(jnp.bfloat16))
            return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"]))
        return loss

    only_a, both = make_loss(False), make_loss(True)
    before = bits(state.params[FP8_COLLECTION]["b"])
    for i in range(3):
        state, _ = STEP(state, make_batch(i), only_a)
    assert bits(state.params[FP8_COLLECTION]["b"]) == before  # scales 1, histories 0: as initialised
    assert float(state.params[FP8_COLLECTION]["a"]["fp8"]["input_scale"][0]) != 1.0  # a's did move
    for i in range(3, 6):
        state, metrics = STEP(state, make_batch(i), both)
        assert bool(metrics["grads_finite"]) and np.isfinite(float(metrics["loss"])), i
    assert float(state.params[FP8_COLLECTION]["b"]["fp8"]["kernel_scale"][0]) > 0


class Branches(nn.Module):
    """Two FP8 Dense layers; `use_a` / `use_b` call one each (for a `lax.cond` in the loss)."""

    def setup(self):
        self.a = Dense(4, use_bias=False, fp8=True, fp8_amax_history=HISTORY)
        self.b = Dense(4, use_bias=False, fp8=True, fp8_amax_history=HISTORY)

    def __call__(self, x):
        return self.a(x) + self.b(x)

    def use_a(self, x):
        return self.a(x)

    def use_b(self, x):
        return self.b(x)


@pytest.mark.slow
def test_an_fp8_op_in_a_cond_branch_not_taken_keeps_its_state_and_the_step_applies():
    """The branch not taken gives its FP8 state fm32's zero, -inf: every step was skipped (and under accumulation
    the scale became 0, then NaN); also without jit, and a per-example vmap of an FP8 layer is one clear error."""
    net = Branches()
    state = TrainState.create(params=net.init(jax.random.key(0), jnp.ones((2, 4))), tx=optax.sgd(1e-3),
                              policy="fp8", loss_scale=NoOpLossScale(), rng=jax.random.key(1))

    def loss(params, batch, rng):
        del rng
        x = batch["x"].astype(jnp.bfloat16)
        y = jax.lax.cond(batch["flag"][0] > 0, lambda: net.apply(params, x, method="use_a"),
                         lambda: net.apply(params, x, method="use_b"))
        return jnp.mean(jnp.square(y.astype(jnp.float32) - 1))

    x = jax.random.normal(jax.random.key(3), (4, 4))
    b_before = bits(state.params[FP8_COLLECTION]["b"])
    for accum in (1, 2):
        state, metrics = STEP(state, {"x": x, "flag": jnp.ones((4,), jnp.int32)}, loss, accum_steps=accum)
        assert bool(metrics["grads_finite"]), accum
        assert bits(state.params[FP8_COLLECTION]["b"]) == b_before, accum  # b not called: unchanged
    state, metrics = train_step(state, {"x": x, "flag": jnp.zeros((4,), jnp.int32)}, loss)  # eager: b's turn
    assert bool(metrics["grads_finite"]) and np.isfinite(float(metrics["loss"]))
    b = state.params[FP8_COLLECTION]["b"]["fp8"]
    assert float(b["input_amax_history"][0]) == float(jnp.max(jnp.abs(x.astype(jnp.bfloat16))).astype(jnp.float32))

    one = Dense(4, use_bias=False, fp8=True, fp8_amax_history=HISTORY)
    per_example = TrainState.create(params=one.init(jax.random.key(0), jnp.ones((1, 4))), tx=optax.sgd(1e-3),
                                    policy="fp8", loss_scale=NoOpLossScale(), rng=jax.random.key(1))

    def vmapped_loss(params, batch, rng):
        del rng
        y = jax.vmap(lambda xi: one.apply(params, xi[None].astype(jnp.bfloat16))[0])(batch["x"])
        return jnp.mean(jnp.square(y.astype(jnp.float32) - 1))

    with pytest.raises(ValueError, match="vmapped an FP8 layer per example"):
        STEP(per_example, {"x": x}, vmapped_loss)


@pytest.mark.slow
def test_fp8_ranges_gives_each_call_of_a_shared_op_its_rows_and_refuses_inner_traces():
    """Before: the last call's input overwrote the first's (its saturation invisible), the output gradient was the
    sum over calls, and calls of other shapes failed; an op inside nn.remat leaked a tracer."""
    from jaxamp.fp8_report import fp8_ranges

    state, loss = square_setup(SharedNet())

    batch = {"x": 5 * jax.random.normal(jax.random.key(2), (4, 8))}
    state, _ = STEP(state, batch, loss)
    rows = {(r["layer"], r["tensor"]): r for r in fp8_ranges(state, batch, loss)}
    assert {layer for layer, _ in rows} == {"d/fp8", "d/fp8 (call 2)"}
    state, _ = STEP(state, batch, loss)  # the same pass as the report's, from the same state
    history = state.params[FP8_COLLECTION]["d"]["fp8"]
    inputs = max(rows[(layer, "input")]["amax"] for layer in ("d/fp8", "d/fp8 (call 2)"))
    assert inputs == float(history["input_amax_history"][0])  # what the step recorded: the larger call's
    assert rows[("d/fp8", "input")]["amax"] == float(
        jnp.max(jnp.abs(batch["x"].astype(jnp.bfloat16))).astype(jnp.float32))

    class Remat(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.remat(Dense)(4, use_bias=False, fp8=True, fp8_amax_history=HISTORY, name="d")(x)

    remat_state, remat_loss = square_setup(Remat())

    with pytest.raises(ValueError, match="inside a transform of loss_fn"):
        fp8_ranges(remat_state, batch, remat_loss)


def test_an_fp8_policy_needs_the_fp8_collection():
    """Refused: variables['params'] alone (FP8 state dropped), an empty collection, with_policy into fp8, and a
    trainable rule that names the collection (it always updates)."""
    variables = NET.init(jax.random.key(0), jnp.zeros((1, 8)))
    make = lambda params, policy="fp8", **kw: TrainState.create(  # noqa: E731
        params=params, tx=optax.sgd(0.1), policy=policy, loss_scale=NoOpLossScale(), rng=jax.random.key(1), **kw)
    for params in (variables["params"], {"params": variables["params"], FP8_COLLECTION: {}}):
        with pytest.raises(ValueError, match="params hold no FP8 collection"):
            make(params)
    with pytest.raises(ValueError, match="params hold no FP8 collection"):
        make(variables["params"], "bf16").with_policy("fp8", NoOpLossScale())
    assert make(variables).with_policy("bf16", NoOpLossScale()).policy is not None
    with pytest.raises(ValueError, match="trainable names the FP8 collection"):
        make(variables, trainable=jax.tree.map(lambda _: True, variables))
