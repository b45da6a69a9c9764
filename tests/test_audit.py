"""The precision audit (`jaxamp.precision_audit`, `jaxamp.nnx.precision_audit`), its warning in `train_step`, and
the fidelity report's near-zero leaves and global-norm errors."""

from __future__ import annotations

import functools
import inspect
import os
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
import jaxamp.nnx as jnnx
from jaxamp import NoOpLossScale, PrecisionWarning, TrainState, get_policy, precision_audit, train_step
from jaxamp.fidelity import fidelity_report, worst


class BatchNormMLP(nnx.Module):
    """Linear -> BatchNorm without dtype= (returns float32: its statistics are float32) -> Linear."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        h = self.l1(x)
        h = self.bn(h)  # BN_LINE
        return self.l2(nnx.relu(h))


BN_LINE = next(i for i, line in enumerate(inspect.getsource(inspect.getmodule(BatchNormMLP)).splitlines(), 1)
               if line.rstrip().endswith("# BN_LINE"))


def nnx_loss(model, batch):
    x, y = batch
    with jax.numpy_dtype_promotion("standard"):  # Flax's BatchNorm mixes float32 statistics with its input
        logits = model(x.astype(model.l1.kernel.dtype))
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def nnx_batch():
    return jax.random.normal(jax.random.key(1), (64, 16)), jnp.arange(64) % 4


def test_the_audit_names_the_batchnorm_that_made_the_next_layer_float32():
    model = BatchNormMLP(nnx.Rngs(0))
    opt = jnnx.Optimizer(model, optax.adam(1e-3), policy="bf16", loss_scale=NoOpLossScale())
    report = jnnx.precision_audit(model, opt, nnx_batch(), nnx_loss)
    l2 = [r for r in report.rows if r["shape"].endswith("x [32, 4]") or "[32, 4]" in r["shape"]]
    assert l2 and all(r["lhs"] == "float32" for r in l2 if r["pass"] == "forward")
    assert report.fallbacks, report
    assert report.fallbacks[0]["source"] == f"{__name__.split('.')[-1]}.py:{BN_LINE + 1}"  # the l2 call
    cause = report.fallbacks[0]["cause"]
    assert f"test_audit.py:{BN_LINE}" in cause and "normalization.py" in cause and "BatchNorm" in cause, cause
    assert 0.0 < report.half_fraction < 0.9
    assert {r["pass"] for r in report.rows} == {"forward", "backward"}
    text = str(report)
    assert "first float32 fall-back" in text and f"test_audit.py:{BN_LINE}" in text
    assert report.summary().startswith("precision audit (bf16): ")


def test_a_model_that_runs_in_half_precision_has_no_fallbacks_and_no_warning():
    model = BatchNormMLP(nnx.Rngs(0))
    model.bn = nnx.BatchNorm(32, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    opt = jnnx.Optimizer(model, optax.adam(1e-3), policy="bf16", loss_scale=NoOpLossScale())
    report = jnnx.precision_audit(model, opt, nnx_batch(), nnx_loss)
    assert report.half_fraction == 1.0 and not report.fallbacks, report
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            jnnx.train_step(model, opt, nnx_batch(), nnx_loss)
    assert not [w for w in caught if issubclass(w.category, PrecisionWarning)]


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(4)(x)


def linen_setup(policy, rows=512):
    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 16)))["params"]
    state = TrainState.create(params=params, tx=optax.adam(1e-3), policy=policy, loss_scale=NoOpLossScale(),
                              rng=jax.random.key(1))
    batch = (jax.random.normal(jax.random.key(2), (rows, 16)), jnp.arange(rows) % 4)

    def loss_fn(params, batch, rng):
        x, y = batch
        logits = model.apply({"params": params}, x.astype(jax.tree.leaves(params)[0].dtype))
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

    return state, batch, loss_fn


@pytest.mark.slow
def classifier_audit(net: nn.Module, batch: dict, policy: str):
    """The precision audit of one step of the linen classifier `net` on `batch` (`x`, integer labels `y`: softmax
    cross-entropy) under `policy`."""
    params = net.init(jax.random.key(0), batch["x"])["params"]

    def loss(p, b, rng):
        return optax.softmax_cross_entropy_with_integer_labels(net.apply({"params": p}, b["x"]), b["y"]).mean()

    return precision_audit(TrainState.create(params=params, tx=optax.sgd(0.1), policy=policy,
                                             loss_scale=NoOpLossScale(), rng=jax.random.key(1)), batch, loss)


def test_half_precision_bias_sums_past_the_format_limit_are_listed_and_warned_once_per_compilation():
    state, batch, loss_fn = linen_setup("bf16", rows=512)
    report = precision_audit(state, batch, loss_fn)
    assert report.half_fraction == 1.0 and not report.fallbacks
    sums = report.half_accumulations
    assert len(sums) == 2 and all(s["dtype"] == "bfloat16" and s["size"] == 512 for s in sums), sums
    assert all(s["pass"] == "backward" and s["source"].startswith("test_audit.py:") for s in sums)
    small_state, small_batch, _ = linen_setup("bf16", rows=128)  # 128 values: within bfloat16's 256
    assert not precision_audit(small_state, small_batch, loss_fn).half_accumulations
    step = jax.jit(train_step, static_argnames="loss_fn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            state, metrics = step(state, batch, loss_fn)
        assert bool(metrics["grads_finite"])
        step(state, (batch[0][:384], batch[1][:384]), loss_fn)  # a new shape: a second compilation
    found = [w for w in caught if issubclass(w.category, PrecisionWarning)]
    assert len(found) == 2, [str(w.message) for w in found]
    assert "512 values in bfloat16" in str(found[0].message) and "384 values" in str(found[1].message)


def test_the_warning_is_at_the_users_line_and_not_hidden_by_the_default_filter():
    """The warning's location is the user's line that ran the jitted step (it was jaxamp/step.py's), and each
    compilation warns under Python's default filter too (its once-per-location registry hid the second)."""
    state, batch, loss_fn = linen_setup("bf16", rows=512)
    step = jax.jit(train_step, static_argnames="loss_fn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        state, _ = step(state, batch, loss_fn)  # STEP_LINE
        step(state, (batch[0][:384], batch[1][:384]), loss_fn)  # a second compilation
        step(state, (batch[0][:384], batch[1][:384]), loss_fn)  # none
    found = [w for w in caught if issubclass(w.category, PrecisionWarning)]
    assert len(found) == 2, [str(w.message) for w in found]
    line = next(i for i, text in enumerate(inspect.getsourcelines(
        test_the_warning_is_at_the_users_line_and_not_hidden_by_the_default_filter)[0]) if "# STEP_LINE" in text)
    start = inspect.getsourcelines(test_the_warning_is_at_the_users_line_and_not_hidden_by_the_default_filter)[1]
    assert [(os.path.basename(w.filename), w.lineno) for w in found] == [
        ("test_audit.py", start + line), ("test_audit.py", start + line + 1)], found


def test_the_warning_is_at_an_ipython_cells_line():
    """A notebook cell's code is compiled as `<ipython-input-N-...>`: the warning is at the cell's line, not at
    IPython's `exec` (every `<...>` name was skipped) nor at jaxamp's."""
    state, batch, loss_fn = linen_setup("bf16", rows=512)
    import importlib.machinery

    cell = compile("\n\nstep(state, batch, loss_fn)\n", "<ipython-input-3-0f1e2d>", "exec")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(cell, {"step": jax.jit(train_step, static_argnames="loss_fn"), "state": state, "batch": batch,
                    "loss_fn": loss_fn})
        # a `python -c` program: its globals' __loader__ cannot give a source (an ImportError, were they passed on)
        exec(compile("step(state, batch, loss_fn)\n", "<string>", "exec"),
             {"__name__": "__main__", "__loader__": importlib.machinery.BuiltinImporter,
              "step": jax.jit(train_step, static_argnames="loss_fn"), "state": state,
              "batch": (batch[0][:384], batch[1][:384]), "loss_fn": loss_fn})  # (another shape: another trace)
    found = [(w.filename, w.lineno) for w in caught if issubclass(w.category, PrecisionWarning)]
    assert found == [("<ipython-input-3-0f1e2d>", 3), ("<string>", 1)], found


def test_the_warning_under_autocast_points_at_the_codes_own_float32_not_at_autocast():
    state, batch, loss_fn = linen_setup("bf16;autocast")

    def float32_loss(params, batch, rng):
        with jaxamp.autocasting.disabled():  # the code asks for float32 here
            return loss_fn(params, batch, rng)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(train_step, static_argnames="loss_fn")(state, batch, float32_loss)
    found = [str(w.message) for w in caught if issubclass(w.category, PrecisionWarning)]
    assert len(found) == 1 and "only 0.0% of its matmul FLOPs" in found[0], found
    assert "under autocast, a float32 matmul is one the code keeps so" in found[0]
    assert "get_policy(..., autocast=True)" not in found[0]


def test_a_half_sum_under_autocast_is_blamed_on_the_models_own_cast():
    """A model that fixes its own dtype (HF's `dtype=jnp.bfloat16`) casts its table: its lookup gradient sums in
    bf16 even under autocast. The warning says so instead of advising autocast."""

    def own_dtype_loss(params, ids, rng):
        h = params["table"].astype(jnp.bfloat16)[ids]  # bf16[4096, 8]: the cast is written, autocast keeps it
        return jnp.mean(jnp.square(h @ params["w"].astype(jnp.bfloat16)))

    params = {"table": jnp.ones((16, 8)), "w": jnp.ones((8, 4))}
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16;autocast", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(train_step, static_argnames="loss_fn")(state, jnp.zeros((4096,), jnp.int32), own_dtype_loss)
    found = [str(w.message) for w in caught if issubclass(w.category, PrecisionWarning)]
    assert len(found) == 1 and "4,096 values in bfloat16 at test_audit.py:" in found[0], found
    assert found[0].endswith("a half-precision sum comes from the model's own casts (a dtype=jnp.bfloat16 or "
                             "float16 in a Flax or Hugging Face config): build the model in float32 and let autocast "
                             "choose")


def test_no_audit_and_no_warning_in_float32():
    state, batch, loss_fn = linen_setup("fp32")
    report = precision_audit(state, batch, loss_fn)
    assert report.half_fraction == 0.0 and not report.fallbacks and not report.half_accumulations
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(train_step, static_argnames="loss_fn")(state, batch, loss_fn)
    assert not [w for w in caught if issubclass(w.category, PrecisionWarning)]


def test_flops_of_matmuls_and_convolutions_and_scan_trip_counts():
    def loss(params, x, rng):
        del rng
        h = x.astype(params["w"].dtype) @ params["w"]  # [8, 16] x [16, 32]: 2 * 8 * 32 * 16 FLOPs

        def body(c, _):
            return c @ params["v"], None  # [8, 32] x [32, 32], 3 times

        h, _ = jax.lax.scan(body, h, None, length=3)
        img = h.reshape(8, 32, 1, 1)
        y = jax.lax.conv_general_dilated(img, params["k"], (1, 1), "SAME",
                                         dimension_numbers=("NCHW", "OIHW", "NCHW"))  # k: [4, 32, 1, 1]
        return jnp.sum(y.astype(jnp.float32))

    params = {"w": jnp.ones((16, 32)), "v": jnp.ones((32, 32)) * 0.01, "k": jnp.ones((4, 32, 1, 1))}
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(0))
    report = precision_audit(state, jnp.ones((8, 16)), loss)
    forward = {r["shape"]: r["flops"] for r in report.rows if r["pass"] == "forward"}
    assert forward["[8, 16] x [16, 32]"] == 2 * 8 * 32 * 16
    assert forward["[8, 32] x [32, 32]"] == 3 * 2 * 8 * 32 * 32
    assert forward["[8, 32, 1, 1] x [4, 32, 1, 1]"] == 2 * (8 * 4) * 32
    assert report.half_fraction == 1.0
    # The transposed scan's body matmuls are backward ones (their own name stacks say nothing of it): the forward
    # has one row per matmul written, the backward the wgrads (w, v, k) and the dgrads of v and the conv.
    assert sum(r["pass"] == "forward" for r in report.rows) == 3
    scanned = [r["pass"] for r in report.rows if r["flops"] == 3 * 2 * 8 * 32 * 32]
    assert scanned == ["forward", "backward", "backward"], scanned


def test_the_summary_and_warning_name_the_line_with_the_most_float32_flops_not_the_largest_single_matmul():
    """A float32 layer called in each of 4 blocks (4 x 2 x 8 x 32 x 32 FLOPs forward) outweighs one larger float32
    matmul elsewhere (2 x 8 x 32 x 96): the summary and the `PrecisionWarning` name the layer's line, as the table's
    grouped lines rank them (they named the largest single matmul: a diffusion UNet's upsampler conv at 9.9% of the
    FLOPs over its ResNet blocks' conv at 29.7%)."""
    def loss(params, x, rng):
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        h = x
        for _ in range(4):
            h = f32(h) @ f32(params["v"])  # the block's layer: float32 under the cast policy
        wide = f32(x) @ f32(params["w"])  # one larger matmul
        return jnp.sum(h) + jnp.sum(wide)

    params = {"v": jnp.ones((32, 32)) * 0.01, "w": jnp.ones((32, 96)) * 0.01}
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(0))
    report = precision_audit(state, jnp.ones((8, 32)), loss)
    line = inspect.getsourcelines(loss)[1] + 4
    assert max(report.rows, key=lambda r: r["flops"])["source"] == f"test_audit.py:{line + 1}"  # the single largest
    assert f"the most FLOPs at test_audit.py:{line} (" in report.summary(), report.summary()
    with pytest.warns(PrecisionWarning, match=f"the most float32 matmul FLOPs at test_audit.py:{line};"):
        jaxamp.audit.warn_if_degraded(report)


def test_a_scanned_matmul_counts_as_many_times_as_it_runs_in_the_summary_and_the_table():
    """A float32 matmul in a scan of length 3 counts as the same matmul written 3 times (rows' `trips`)."""

    def loss(scanned, params, x, rng):
        del rng
        layer = lambda c: (c.astype(jnp.float32) @ params["v"].astype(jnp.float32)).astype(c.dtype)  # float32

        h = x.astype(params["x0"].dtype) * params["x0"]  # differentiated: the first layer's dgrad runs, scanned or not
        if scanned:
            h, _ = jax.lax.scan(lambda c, _: (layer(c), None), h, None, length=3)
        else:
            h = layer(layer(layer(h)))
        return jnp.sum(h.astype(jnp.float32))

    params = {"v": jnp.ones((32, 32)) * 0.01, "x0": jnp.ones((8, 32))}
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(0))
    reports = [precision_audit(state, jnp.ones((8, 32)), functools.partial(loss, scanned)) for scanned in (0, 1)]
    for report in reports:  # forward 3, backward 3 dgrads + 3 wgrads (2 * 8 * 32 * 32 FLOPs each): 9 in float32
        assert "100.0% of 0.1" not in report.summary() and "0.0% of 0.1 MFLOP of matmuls" in report.summary()
        assert "; 9 in float32, the most FLOPs at test_audit.py:" in report.summary(), report.summary()
        assert sum(r["trips"] for r in report.rows) == 9 and sum(r["flops"] for r in report.rows) == 9 * 16384
        table = [line for line in str(report).splitlines() if " dot_general x" in line]
        counts = sorted(int(line.split(" dot_general x")[1].split()[0]) for line in table)
        assert counts == [3, 6], str(report)  # forward x3, backward x6
    assert [r["trips"] for r in reports[1].rows] == [3, 3, 3] and len(reports[0].rows) == 9


def test_fidelity_report_marks_near_zero_leaves_and_keeps_them_out_of_the_worst():
    """A bias just before a softmax over its own axis has a true gradient of 0: near zero, not ranked."""

    def loss(params, batch, rng):
        del rng
        x, y = batch
        h = x @ params["w"] + params["b"]  # [batch, 4]
        z = h @ params["q"] + params["shift"]  # a per-row constant shift: softmax ignores it
        z = z - params["shift"] + params["shift"].mean()  # keeps the shift's gradient exactly 0 in exact maths
        return optax.softmax_cross_entropy_with_integer_labels(z.astype(jnp.float32), y).mean()

    key = jax.random.split(jax.random.key(0), 4)
    params = {"w": jax.random.normal(key[0], (16, 8)), "b": jax.random.normal(key[1], (8,)),
              "q": jax.random.normal(key[2], (8, 4)), "shift": jnp.ones((4,))}
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(1))
    batch = (jax.random.normal(key[3], (64, 16)), jnp.arange(64) % 4)
    with jax.numpy_dtype_promotion("standard"):
        report = jax.jit(fidelity_report, static_argnames=("loss_fn", "noise_floor"))(
            state, batch, loss, noise_floor=True)
    near = {k: bool(v) for k, v in report["near_zero"].items()}
    assert near == {"b": False, "q": False, "shift": True, "w": False}, near
    assert "shift" not in [name for name, _ in worst(report["rel_err"], 4, near_zero=report["near_zero"])]
    for name in ("b", "q", "w"):
        assert 0 < float(report["global_rel_err"][name]) <= float(report["rel_err"][name]) < 0.05, name
        assert 0 < float(report["noise_floor"][name]) < 0.05, name
    assert float(report["global_rel_err"]["shift"]) < 1e-3


def test_noise_floor_true_under_a_float32_policy_warns_and_a_dtype_gives_the_floor():
    """`noise_floor=True` rounds to the policy's compute dtype: under `fp32` (a model that fixes its own bf16 dtype)
    every floor would read 0, so it warns and names the fix; `noise_floor=jnp.bfloat16` gives the floor."""
    def loss(params, batch, rng):
        return jnp.mean((batch @ params["w"].astype(jnp.bfloat16)).astype(jnp.float32) ** 2)

    params = {"w": jax.random.normal(jax.random.key(0), (16, 8))}
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="fp32", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(1))
    batch = jax.random.normal(jax.random.key(2), (64, 16)).astype(jnp.bfloat16)
    with pytest.warns(PrecisionWarning, match=r"float32 here, so every floor reads 0.*noise_floor=jnp.bfloat16"):
        zero = fidelity_report(state, batch, loss, noise_floor=True)
    assert float(zero["noise_floor"]["w"]) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        floor = fidelity_report(state, batch, loss, noise_floor=jnp.bfloat16)
    assert 1e-4 < float(floor["noise_floor"]["w"]) < 0.05 and float(floor["rel_err"]["w"]) > 0


def test_keep_float32_matches_boxed_params_and_its_refusal_suggests_a_pattern_that_matches():
    class Boxed(nn.Module):
        @nn.compact
        def __call__(self, ids):
            table = nn.Embed(32, 8, embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(1.0), ("vocab", "embed")), name="embed")
            return nn.Dense(4)(table(ids))

    variables = Boxed().init(jax.random.key(0), jnp.zeros((2, 3), jnp.int32))
    paths = [jaxamp.precision.leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(variables["params"])[0]]
    assert "embed/embedding/value" in paths
    policy = get_policy("bf16", keep_float32=("*/embedding",))
    state = TrainState.create(params=variables["params"], tx=optax.sgd(0.1), policy=policy,
                              loss_scale=NoOpLossScale(), rng=jax.random.key(1))
    compute = state.compute_params()
    assert compute["embed"]["embedding"].value.dtype == jnp.float32
    assert compute["Dense_0"]["kernel"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"'\*/embedding' would match 'embed/embedding'") as err:
        TrainState.create(params=variables["params"], tx=optax.sgd(0.1), loss_scale=NoOpLossScale(),
                          policy=get_policy("bf16", keep_float32=("*/wte/embedding",)), rng=jax.random.key(1))
    assert "matches no params leaf" in str(err.value)


def test_jaxamp_exports_the_audit():
    assert {"precision_audit", "PrecisionWarning", "PrecisionReport"} <= set(jaxamp.__all__)
    assert issubclass(PrecisionWarning, UserWarning)
    np.testing.assert_equal(jaxamp.audit.ABSORB_LIMIT, {"bfloat16": 256, "float16": 2048})


def test_a_per_row_gather_gradient_is_no_half_sum_but_a_shared_row_is():
    """take_along_axis (a loss's label pick) scatters one value per row: nothing accumulates. A bf16 table looked up
    768 times at the same row does: 768 values into one element, past bfloat16's 256."""
    from jaxamp.audit import audit_jaxpr

    logits, labels = jnp.ones((12, 64, 65), jnp.bfloat16), jnp.zeros((12, 64), jnp.int32)
    pick = jax.make_jaxpr(jax.grad(lambda z: jnp.take_along_axis(z, labels[..., None], -1).astype(jnp.float32).sum()))
    report = audit_jaxpr(pick(logits), policy="bf16", compute_dtype=jnp.bfloat16)
    assert report.half_accumulations == ()
    table, ids = jnp.ones((65, 8), jnp.bfloat16), jnp.zeros((12, 64), jnp.int32)
    lookup = jax.make_jaxpr(jax.grad(lambda t: t[ids].astype(jnp.float32).sum()))
    sums = audit_jaxpr(lookup(table), policy="bf16", compute_dtype=jnp.bfloat16).half_accumulations
    assert [(s["primitive"], s["dtype"], s["size"]) for s in sums] == [("scatter-add", "bfloat16", 768)]


def test_a_count_of_ties_is_no_half_sum_but_a_sum_of_values_is():
    """A bias-less head's bf16 logits under autocast without its float32 head rule (`float32_results=`; its
    `.astype(float32)` is a no-op in float32 code, so not in the jaxpr): the cross-entropy's max has a derivative
    that counts the max's ties over the whole vocabulary in bf16 (JAX writes it in the max's dtype). A count of
    booleans is exact far past any tie count, so it is no half-precision accumulation and no warning; a bf16 sum of
    the same size still is."""
    def loss_fn(params, batch, rng):
        logits = batch @ params["head"]  # f32 code; bf16[64, 1024] under autocast (matmul class, no bias)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), jnp.arange(64)).mean()

    params = {"head": jax.random.normal(jax.random.key(0), (32, 1024)) * 0.1}
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16;autocast;float32_results=",
                              loss_scale=NoOpLossScale(), rng=jax.random.key(1))
    batch = jax.random.normal(jax.random.key(2), (64, 32))
    assert precision_audit(state, batch, loss_fn).half_accumulations == ()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(train_step, static_argnames="loss_fn")(state, batch, loss_fn)
    assert not [w for w in caught if issubclass(w.category, PrecisionWarning)]
    with pytest.MonkeyPatch.context() as mp:  # the count is there, and only the exemption passes it
        mp.setattr(jaxamp.audit._Walk, "_counts_booleans", lambda self, eqn: False)
        sums = precision_audit(state, batch, loss_fn).half_accumulations
    assert [(s["dtype"], s["size"]) for s in sums] == [("bfloat16", 1024)], sums


@pytest.mark.parametrize("policy", ["bf16", "bf16;autocast"])
def test_a_half_lookup_through_a_jitted_jnp_function_names_the_users_line(policy):
    """`jnp.take` (what `nn.Embed` calls) is a jit whose body JAX traces with tracebacks that end inside JAX: the
    bf16 scatter-add of its gradient names the user's line of the lookup, under the cast policy (the nested jit
    stays) and under autocast (which inlines it), not "?"."""
    def loss_fn(params, batch, rng):
        table = params["table"].astype(jnp.bfloat16)  # a model that fixes its own dtype
        rows = jnp.take(table, batch, axis=0)  # the lookup
        return jnp.mean(rows.astype(jnp.float32) ** 2)

    line = inspect.getsourcelines(loss_fn)[1] + 2
    state = TrainState.create(params={"table": jnp.ones((64, 8))}, tx=optax.sgd(0.1), policy=policy,
                              loss_scale=NoOpLossScale(), rng=jax.random.key(1))
    sums = precision_audit(state, jnp.zeros((4, 512), jnp.int32), loss_fn).half_accumulations
    assert [(s["primitive"], s["dtype"], s["size"], s["pass"]) for s in sums] == \
        [("scatter-add", "bfloat16", 2048, "backward")], sums
    assert sums[0]["source"] == f"test_audit.py:{line}", sums


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.LSTMCell(16))(x)  # RNN_LINE
        return nn.Dense(4, name="head")(h[:, -1])


def test_a_library_scan_names_the_users_line():
    """`nn.RNN(nn.LSTMCell)`: JAX traces a scan's body with a traceback that ends at the body (Flax's `axes_scan`),
    which holds no user frame; the LSTM's rows name the user's line that called `nn.RNN`, forward and backward (they
    read `flax/core/axes_scan.py:...body_fn`)."""
    model = Encoder()
    x = jnp.ones((2, 5, 3))
    line = next(i for i, text in enumerate(inspect.getsource(Encoder).splitlines(), inspect.getsourcelines(Encoder)[1])
                if text.rstrip().endswith("# RNN_LINE"))

    def loss_fn(params, batch, rng):
        return jnp.mean(model.apply({"params": params}, batch.astype(jnp.float32)) ** 2)

    state = TrainState.create(params=model.init(jax.random.key(0), x)["params"], tx=optax.sgd(0.1),
                              policy=get_policy("bf16", autocast=True),
                              loss_scale=NoOpLossScale(), rng=jax.random.key(1))
    rows = [r for r in precision_audit(state, x, loss_fn).rows if "RNN" in r["scope"] or "LSTMCell" in r["weight"]]
    assert {r["pass"] for r in rows} == {"forward", "backward"}, rows
    assert {r["source"] for r in rows} == {f"test_audit.py:{line}"}, {r["source"] for r in rows}
    assert {r["library"] for r in rows} == {"flax/linen/recurrent.py:RNN.__call__"}, {r["library"] for r in rows}


def test_a_file_of_an_installed_package_is_named_by_its_path_in_the_package():
    """A frame in a package the audit does not count as a library (jraph's `_src/models.py`) reads as that path,
    not as a bare `models.py` the user's own model file may also be called."""
    from jaxamp import audit

    assert audit._short_file("/x/lib/python3.11/site-packages/jraph/_src/models.py") == "jraph/_src/models.py"
    assert audit._short_file("/usr/lib/python3/dist-packages/pkg/models.py") == "pkg/models.py"
    assert audit._short_file("/home/me/project/models.py") == "models.py"


def test_every_op_autocast_rewrites_keeps_a_users_line_inside_jitted_and_custom_jvp_library_code():
    """Under autocast (and its gradient) no equation lacks a frame outside JAX, at any depth: `jnp.take` and
    `jnp.searchsorted` (nested jits, one with a scan inside), `jax.nn.relu` (a custom_jvp), a remat around a
    lookup. (A scatter's scalar update computation is not an op of the program: JAX caches it with the frames of
    whichever trace built it first, so it is not checked.)"""
    from jax.extend import source_info_util

    def unattributed(jaxpr, path=""):
        out = []
        for eqn in jaxpr.eqns:
            where = f"{path}/{eqn.primitive.name}"
            if not source_info_util.summarize(eqn.source_info):
                out.append(where)
            if not eqn.primitive.name.startswith("scatter"):  # its update computation: not an op of the program,
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):  # and JAX caches it with the first
                    out += unattributed(sub, where)  # tracer's frames (another test's, or none)
        return out

    def loss(w, x, i):
        h = jax.nn.relu(x @ w)
        h = jax.nn.gelu(h) + jnp.take(h, i, axis=0).sum()
        h = jax.checkpoint(lambda h: jnp.cumsum(jnp.take(h, i, axis=1), axis=0))(h)
        return jnp.sum(h) + jnp.searchsorted(jnp.arange(8.0), x[0, :3]).sum().astype(jnp.float32)

    w, x, i = jnp.ones((8, 8)), jnp.ones((4, 8)), jnp.array([1, 2])
    program = jax.make_jaxpr(jaxamp.autocast(jax.grad(loss), jnp.bfloat16))(w, x, i).jaxpr
    assert [e.primitive.name for e in program.eqns].count("scatter-add") == 1  # (and one inside the remat)
    assert unattributed(program) == []


@pytest.mark.parametrize("policy", ["bf16", "bf16;autocast"])
def test_rows_inside_jaxamp_attention_name_the_users_line_that_called_it(policy):
    """`jaxamp.attention.dot_product_attention` is a nested jit, whose body JAX traces with tracebacks that end at
    the jit: its matmul rows still name the user's line that called it, the library entry point and the callers."""
    from jaxamp.attention import dot_product_attention

    def loss_fn(params, batch, rng):
        qkv = (batch.astype(params["w"].dtype) @ params["w"]).reshape(2, 16, 3, 2, 32)  # [b, t, qkv, heads, dim]
        out = dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)  # the call
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    line = inspect.getsourcelines(loss_fn)[1] + 2
    state = TrainState.create(params={"w": jnp.ones((64, 192)) * 0.01}, tx=optax.sgd(0.1), policy=policy,
                              loss_scale=NoOpLossScale(), rng=jax.random.key(1))
    rows = precision_audit(state, jnp.ones((2, 16, 64)), loss_fn).rows
    attention = [r for r in rows if r["source"] != f"test_audit.py:{line - 1}"]  # all but the projection's 2
    assert len(attention) == 6 and len(rows) == 8, rows  # QK and PV forward and their 4 backward matmuls
    assert {(r["source"], r["library"]) for r in attention} == {
        (f"test_audit.py:{line}", "jaxamp/attention.py:dot_product_attention")}, attention
    assert all("loss_fn" in r["callers"] for r in attention), attention


class OutputLayerNet(nn.Module):
    """A head whose name is none of the usual ones (the JAX AI Stack's miniGPT calls it `output_layer`)."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(10, name="output_layer")(nn.relu(nn.Dense(32, name="linear1")(x)))


@pytest.mark.parametrize("loss", ["optax", "log_sigmoid"])
def test_a_head_into_a_log_sigmoid_is_found_and_a_softplus_activation_is_not(loss):
    """Binary and multi-label losses (optax's sigmoid_binary_cross_entropy; Flax's VAE example writes its own with
    `nn.log_sigmoid`) take the head's logits through a log-sigmoid, `-softplus(-x)`: the unnamed head is found
    (`into`: "log-sigmoid") and the note names its policy; a softplus of a hidden layer's result (a positive step
    size, as Mamba's) and a log-sigmoid gate (xLSTM's forget gate, into a cumsum) are no heads."""
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jax.nn.softplus(nn.Dense(32, name="step")(x))  # a softplus activation: not a loss's
            h = h * jnp.exp(jnp.cumsum(nn.log_sigmoid(nn.Dense(1, name="fgate")(h)), axis=0))  # a log-space gate
            return nn.Dense(6, name="fc2")(nn.Dense(32, name="fc1")(h))

    net = Net()
    params = net.init(jax.random.key(0), jnp.ones((1, 8)))["params"]

    def loss_fn(params, batch, rng):
        logits = net.apply({"params": params}, batch[0])
        if loss == "optax":
            return optax.sigmoid_binary_cross_entropy(logits, batch[1]).mean()
        log_p = nn.log_sigmoid(logits)  # Flax's VAE: binary_cross_entropy_with_logits
        return -jnp.sum(batch[1] * log_p + (1.0 - batch[1]) * jnp.log(-jnp.expm1(log_p)))

    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16;autocast", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(1))
    report = precision_audit(state, (jnp.ones((4, 8)), jnp.ones((4, 6))), loss_fn)
    assert [(r["weight"], r["into"]) for r in report.half_logits] == [("fc2.kernel", "log-sigmoid")]
    assert ("fc2.kernel at test_audit.py:" in report.summary() and "writes bfloat16 logits into a log-sigmoid"
            in report.summary() and "'bf16;autocast;float32_results+=^fc2\\.kernel$'" in report.summary())


def test_the_audit_says_when_no_matmul_writes_float32_logits_and_which_pattern_did():
    """Under autocast: a head without a usual name writes bf16 logits, and the summary says so and how to name it;
    `;float32_results+=` names it (its forward row writes float32, `float32_result_by` the pattern); a pattern that
    matches nothing is listed; the table keeps `linear1` apart from a layer number."""
    net = OutputLayerNet()  # (a class name ending in "Head" would match the default `Head\.__call__$`)
    params = net.init(jax.random.key(0), jnp.ones((1, 8)))["params"]

    def loss_fn(params, batch, rng):
        return optax.softmax_cross_entropy_with_integer_labels(net.apply({"params": params}, batch[0]),
                                                               batch[1]).mean()

    batch = (jnp.ones((4, 8)), jnp.zeros(4, jnp.int32))

    def audit(policy):
        state = TrainState.create(params=params, tx=optax.sgd(0.1), policy=policy, loss_scale=NoOpLossScale(),
                                  rng=jax.random.key(1))
        return precision_audit(state, batch, loss_fn)

    plain = audit("bf16;autocast")  # the head, found by the softmax it feeds: the pattern that names it
    assert ("writes bfloat16 logits into a softmax (a head, or a router, no pattern names): policy "
            "'bf16;autocast;float32_results+=^output_layer\\.kernel$' keeps them") in plain.summary()
    assert {r["out"] for r in plain.rows} == {"bfloat16"}

    def squared_error(params, batch, rng):  # no softmax: no head found, the general note
        return jnp.mean(net.apply({"params": params}, batch[0]).astype(jnp.float32) ** 2)

    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16;autocast", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(1))
    regression = precision_audit(state, batch, squared_error)
    assert regression.half_logits == () and "float32_results kept no matmul result float32" in regression.summary()
    assert "right for a regression" in regression.summary() and "logits" not in regression.summary()
    named = audit("bf16;autocast;float32_results+=^output_layer$")
    assert "float32_results kept" not in named.summary() and "match no matmul" not in named.summary()
    wrote = [(r["weight"], r["pass"], r["float32_result_by"]) for r in named.rows if r["out"] == "float32"]
    assert wrote == [("output_layer.kernel", "forward", "^output_layer$")]
    typo = audit("bf16;autocast;float32_results+=^outputlayer$")
    assert typo.float32_results_unused == ("^outputlayer$",) and typo.summary().endswith(
        "float32_results patterns that match no matmul: ^outputlayer$")
    with jax.numpy_dtype_promotion("standard"):  # the cast policy's bf16 params meet the float32 batch
        assert "float32_results" not in audit("bf16").summary()  # no autocast, no rule
    assert "linear1.kernel" in str(named) and "output_layer.kernel" in str(named)
    assert jaxamp.audit._layers("blocks_0.linear1.kernel") == "blocks_*.linear1.kernel"
    assert jaxamp.audit._layers("h/12/mlp/c_fc2") == "h/*/mlp/c_fc2"


class Unusual(nn.Module):
    """A head without a usual name (`out_proj`), beside an attention softmax over activations and a max over the
    output of a Dense (a max that is no softmax)."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, name="up")(x))
        h = jax.nn.softmax(nn.Dense(32, name="q")(h) @ h.T, axis=-1) @ h  # f32[batch, 32]
        pooled = jnp.max(nn.Dense(32, name="pre_pool")(h), axis=-1, keepdims=True)  # f32[batch, 1]
        return nn.Dense(4, name="out_proj")(h + pooled)  # f32[batch, 4] logits


@pytest.mark.slow  # 3-6 s: five audits and two three-step runs
def test_a_head_without_a_usual_name_is_found_by_its_softmax_and_the_warning_names_the_pattern():
    """Under autocast the audit follows each weight matmul's result through elementwise and shape ops: the one that
    reaches the loss's softmax is the output head, and the summary and the warning give the pattern that keeps its
    logits float32 (or out of FP8); an attention's softmax (activation x activation) and a max pool are not heads."""
    net = Unusual()
    params = net.init(jax.random.key(0), jnp.ones((8, 16)))["params"]

    def loss(p, batch, rng):
        return optax.softmax_cross_entropy_with_integer_labels(net.apply({"params": p}, batch["x"]),
                                                               batch["y"]).mean()

    batch = {"x": jax.random.normal(jax.random.key(1), (8, 16)), "y": jnp.arange(8) % 4}

    def state(policy):
        return TrainState.create(params=params, tx=optax.sgd(0.1), policy=policy, loss_scale=NoOpLossScale(),
                                 rng=jax.random.key(2))

    line = inspect.getsourcelines(Unusual.__call__)[1] + 5
    for policy, dtype in (("bf16;autocast", "bfloat16"), ("fp16;autocast", "float16")):
        report = precision_audit(state(policy), batch, loss)
        assert [r["weight"] for r in report.half_logits] == ["out_proj.kernel"]
        assert (f"the output head out_proj.kernel at test_audit.py:{line} writes {dtype} logits into a softmax (a "
                f"head, or a router, no pattern names): policy '{policy};float32_results+=^out_proj\\.kernel$' keeps "
                "them float32") in report.summary()
    fixed = precision_audit(state("bf16;autocast;float32_results+=^out_proj$"), batch, loss)
    assert fixed.half_logits == () and "output head" not in fixed.summary()
    assert [r["out"] for r in fixed.rows if r["weight"] == "out_proj.kernel" and r["pass"] == "forward"] == ["float32"]
    # torch.amp's half-precision logits, asked for: found, but nothing to say
    opted_out = precision_audit(state("bf16;autocast;float32_results="), batch, loss)
    assert len(opted_out.half_logits) == 1 and "output head" not in opted_out.summary()
    fp8 = precision_audit(state("fp8-current"), batch, loss)
    assert [(r["weight"], r["lhs"]) for r in fp8.half_logits] == [("out_proj.kernel", "float8_e4m3fn")]
    assert ("runs in FP8 into a softmax (a head, or a router, no pattern names): policy "
            "'fp8-current;fp8_exclude+=^out_proj\\.kernel$;float32_results+=^out_proj\\.kernel$' "
            "keeps it out") in fp8.summary()
    # a policy that already adds patterns: the suggestion extends its rules (a rule given twice is refused)
    given = "bf16;autocast;float32_results+=^decoder$"
    note = precision_audit(state(given), batch, loss).logits_note()
    suggested = re.search(r"policy '([^']*)'", note).group(1)
    assert suggested == r"bf16;autocast;float32_results+=^decoder$,^out_proj\.kernel$"
    assert precision_audit(state(suggested), batch, loss).half_logits == ()
    note = precision_audit(state("fp8-current;fp8_exclude+=^decoder$"), batch, loss).logits_note()
    suggested = re.search(r"policy '([^']*)'", note).group(1)
    assert suggested == r"fp8-current;fp8_exclude+=^decoder$,^out_proj\.kernel$;float32_results+=^out_proj\.kernel$"
    assert precision_audit(state(suggested), batch, loss).half_logits == ()
    fp8_fixed = precision_audit(state("fp8-current;fp8_exclude+=^out_proj$;float32_results+=^out_proj$"), batch, loss)
    assert fp8_fixed.half_logits == () and fp8_fixed.fp8_fraction > 0.5
    step = jax.jit(train_step, static_argnames="loss_fn")
    for policy, expected in (("bf16;autocast", 1), ("bf16;autocast;float32_results+=^out_proj$", 0)):
        s = state(policy)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                s, _ = step(s, batch, loss)
        found = [str(w.message) for w in caught if issubclass(w.category, PrecisionWarning)]
        suggestion = r"'bf16;autocast;float32_results+=^out_proj\.kernel$'"
        assert len(found) == expected and all(suggestion in m for m in found), found


@pytest.mark.slow  # 3 s
def test_a_convolution_head_is_found_and_the_suggested_policy_makes_its_logits_float32():
    """A segmentation network's per-pixel logits come from a 1x1 convolution: the audit finds it by its softmax, and
    the policy it suggests makes that convolution write float32 (its backward convolutions stay bfloat16)."""
    class Seg(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Conv(5, (1, 1), name="seg_out")(nn.relu(nn.Conv(8, (3, 3))(x)))  # f32[batch, h, w, 5]

    batch = {"x": jax.random.normal(jax.random.key(2), (2, 8, 8, 3)), "y": jnp.zeros((2, 8, 8), jnp.int32)}
    audit = functools.partial(classifier_audit, Seg(), batch)

    found = audit("bf16;autocast")
    assert [(r["weight"], r["primitive"], r["out"]) for r in found.half_logits] == [
        ("seg_out.kernel", "conv_general_dilated", "bfloat16")]
    suggested = re.search(r"policy '([^']*)'", found.logits_note()).group(1)
    assert suggested == r"bf16;autocast;float32_results+=^seg_out\.kernel$"
    fixed = audit(suggested)
    assert fixed.half_logits == () and fixed.summary().endswith("matmuls in half precision")
    head = [(r["pass"], r["lhs"], r["rhs"], r["out"], r["float32_result_by"]) for r in fixed.rows
            if r["weight"] == "seg_out.kernel"]
    assert head[0] == ("forward", "bfloat16", "bfloat16", "float32", r"^seg_out\.kernel$")
    assert [row[1:4] for row in head[1:]] == [("bfloat16", "bfloat16", "bfloat16")] * 2  # its backward in bf16



@pytest.mark.slow  # 6 s: eight audits
def test_a_bias_free_head_is_found_through_the_usual_losses_and_a_pooling_softmax_is_not_a_head():
    """Without a bias, autocast's float32 cast sits between the logits and `logsumexp`'s `x - max` (and a `where=`
    mask between them and the max): the head is still found; an attention pooling's softmax over the sequence (a
    `Dense(1)` scorer) is not a head; a head inside `nn.scan` (a cell emitting logits each step) is found."""
    class LM(nn.Module):
        pool: bool = False

        @nn.compact
        def __call__(self, ids):  # i32[batch, seq] -> f32[batch, seq, 16] (or f32[batch, 16] pooled)
            x = nn.relu(nn.Dense(8)(nn.Embed(16, 8)(ids)))
            if self.pool:
                weights = jax.nn.softmax(nn.Dense(1, name="score")(x)[..., 0], axis=-1)  # f32[batch, seq]
                x = jnp.einsum("bs,bsd->bd", weights, x)
            return nn.Dense(16, use_bias=False, name="proj_out")(x)

    class Cell(nn.Module):
        @nn.compact
        def __call__(self, h, x):  # h: f32[batch, 8], x: f32[batch, 8]
            h = jnp.tanh(nn.Dense(8, name="rec")(h) + x)
            return h, nn.Dense(16, use_bias=False, name="proj_out")(h)

    class ScanLM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            xs = nn.Embed(16, 8)(ids).swapaxes(0, 1)  # f32[seq, batch, 8]
            scan = nn.scan(Cell, variable_broadcast="params", split_rngs={"params": False})
            return scan()(jnp.zeros(xs.shape[1:]), xs)[1].swapaxes(0, 1)  # f32[batch, seq, 16]

    ids = jnp.arange(24).reshape(3, 8) % 16
    losses = {
        "integer labels": lambda logits: optax.softmax_cross_entropy_with_integer_labels(logits, ids).mean(),
        "logsumexp": lambda logits: jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0]),
        "log_softmax where=": lambda logits: -jnp.mean(jax.nn.log_softmax(logits, where=jnp.arange(16) < 12)[..., 0]),
    }
    for model, named in [(LM(), losses), (ScanLM(), {"integer labels": losses["integer labels"]})]:
        params = model.init(jax.random.key(0), ids)["params"]
        for name, of_logits in named.items():
            for policy in ("bf16;autocast", "fp8-current"):
                state = TrainState.create(params=params, tx=optax.sgd(0.1), policy=policy,
                                          loss_scale=NoOpLossScale(), rng=jax.random.key(1))
                report = precision_audit(state, {"ids": ids},
                                         lambda p, b, rng, m=model, f=of_logits: f(m.apply({"params": p}, b["ids"])))
                found = [r["weight"] for r in report.half_logits]
                expected = "proj_out.kernel" if isinstance(model, LM) else "ScanCell_0.proj_out.kernel"
                assert found == [expected], (name, policy, found)
    pooled = LM(pool=True)
    params = pooled.init(jax.random.key(0), ids)["params"]
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16;autocast;float32_results+=^proj_out$",
                              loss_scale=NoOpLossScale(), rng=jax.random.key(1))
    report = precision_audit(state, {"ids": ids}, lambda p, b, rng: optax.softmax_cross_entropy_with_integer_labels(
        pooled.apply({"params": p}, b["ids"]), ids[:, 0]).mean())
    assert report.half_logits == () and "output head" not in report.summary()


def test_a_float32_results_pattern_that_takes_every_matmul_is_reported():
    """`;float32_results+=` matching every forward matmul (a Hugging Face model's class name) makes the activations
    between matmuls float32: the summary says so (it said nothing)."""
    class Deeper(nn.Module):
        @nn.compact
        def __call__(self, x):
            return OutputLayerNet()(nn.Dense(8, name="stem")(x))

    model = Deeper()
    params = model.init(jax.random.key(0), jnp.ones((1, 8)))["params"]

    def loss_fn(params, batch, rng):
        return jnp.mean(model.apply({"params": params}, batch) ** 2)

    def summary(policy):
        state = TrainState.create(params=params, tx=optax.sgd(0.1), policy=policy, loss_scale=NoOpLossScale(),
                                  rng=jax.random.key(1))
        return precision_audit(state, jnp.ones((4, 8)), loss_fn).summary()

    assert "made every forward matmul (3) write float32" in summary("bf16;autocast;float32_results+=^Deeper$")
    assert "made every forward matmul" not in summary("bf16;autocast;float32_results+=^output_layer$")


def test_the_cause_in_a_model_from_a_package_names_the_layer_that_went_float32_first():
    """Every op of a Hugging Face model is on the user's one line that called it, so the line alone cannot say which
    layer made the activations float32; the cause names the module scope. A layer promoting its own weight (each
    module of an HF model built with `dtype=float32`: its LayerNorms, its Dense layers) only shows that it computes
    in float32: the cause is the most upstream such layer, the embedding, not the LayerNorm before the matmul."""
    from transformers import BloomConfig, FlaxBloomForCausalLM

    with jax.numpy_dtype_promotion("standard"):  # Hugging Face's code mixes dtypes
        model = FlaxBloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=2),
                                     input_shape=(2, 8), seed=0, _do_init=False)
        params = model.init_weights(jax.random.key(0), (2, 8))
    ids = jnp.arange(16).reshape(2, 8) % 64

    def loss_fn(params, batch, rng):
        with jax.numpy_dtype_promotion("standard"):
            logits = model(batch, params=params).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch[:, 1:]).mean()

    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(1))
    report = precision_audit(state, ids, loss_fn)
    cause = report.fallbacks[0]["cause"]
    assert report.half_fraction == 0.0
    assert "(in FlaxBloomForCausalLMModule/transformer/word_embeddings) promoted a half-precision param" in cause, cause


def test_a_bfloat16_batch_the_model_converts_to_float32_is_the_cause_not_a_params_promotion():
    """A model that converts a bfloat16 batch to float32 made its activations float32: that line is the cause, even
    with a param promoted to float32 after it (a learned input scale); a half-precision input of the step is no
    cast master weight."""
    params = {"w1": jax.random.normal(jax.random.key(0), (48, 64)) / 7, "scale": jnp.ones((48,))}
    batch = (jax.random.normal(jax.random.key(2), (16, 48)).astype(jnp.bfloat16), jnp.arange(16) % 10)

    def loss(p, b, rng):
        x = b[0].astype(jnp.float32)  # CAUSE_LINE
        x = x * p["scale"].astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(jnp.tanh(x @ p["w1"].astype(jnp.float32))[:, :10],
                                                               b[1]).mean()

    line = next(i for i, text in enumerate(inspect.getsource(loss).splitlines()) if "# CAUSE_LINE" in text)
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(1))
    cause = precision_audit(state, batch, loss).fallbacks[0]["cause"]
    assert cause == (f"test_audit.py:{inspect.getsourcelines(loss)[1] + line} returned float32 from "
                     "half-precision inputs (convert_element_type)"), cause


def test_a_scanned_layers_cause_follows_the_carry_out_of_the_scan():
    """ESM2's pattern: layers scanned over their stacked params (xs), each a LayerNorm that promotes its own
    half-precision scale and a matmul; the activation is the scan's carry, made float32 before the scan. The cause
    is that line before the scan, not the LayerNorm's promotion of its scale inside it (the scale is a slice of a
    cast param: the audit follows xs out of the scan), nor "a float32 input of the step" (the carry's first value
    is followed out too)."""
    params = {"emb": jax.random.normal(jax.random.key(0), (16, 32)),
              "layers": {"scale": jnp.ones((2, 32)), "w": jax.random.normal(jax.random.key(1), (2, 32, 32)) / 6},
              "head": jax.random.normal(jax.random.key(2), (32, 16)) / 6}
    ids = jnp.arange(8) % 16

    def loss(p, b, rng):
        with jax.numpy_dtype_promotion("standard"):  # the model's own code mixes dtypes, as ESM2's
            x = p["emb"][b] * jnp.float32(0.5)  # CAUSE_LINE

            def layer(x, lp):
                h = x - x.mean(-1, keepdims=True)
                h = h * lp["scale"].astype(jnp.float32)  # a norm computing in float32 with its own scale
                return x + jnp.tanh(h @ lp["w"]), None

            x, _ = jax.lax.scan(layer, x, p["layers"])
            return optax.softmax_cross_entropy_with_integer_labels(x @ p["head"], b).mean()

    line = next(i for i, text in enumerate(inspect.getsource(loss).splitlines()) if "# CAUSE_LINE" in text)
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(1))
    report = precision_audit(state, ids, loss)
    cause = report.fallbacks[0]["cause"]
    assert cause == (f"test_audit.py:{inspect.getsourcelines(loss)[1] + line} returned float32 from "
                     "half-precision inputs (convert_element_type)"), cause


def test_integer_matmuls_are_no_rows_and_selections_are_outside_every_share():
    """An integer einsum (BigBird's block masks from its int32 attention mask) is no GEMM of the step: it was a
    float32 fall-back (99.0% half precision, "no half-precision value reached it"). One-hot selections are left out
    of the FP8 share and of the summary's FLOPs as they are of `half_fraction` (a character RNN read "100.0% of 8.4
    MFLOP ... (75.0% in FP8)" with 2.1 of the 8.4 MFLOP float32 selections and every other matmul FP8)."""
    params = {"w": jax.random.normal(jax.random.key(0), (32, 32)) * 0.1,
              "table": jax.random.normal(jax.random.key(1), (64, 32))}

    def loss_fn(params, batch, rng):
        band = jnp.einsum("bq,bk->bqk", batch["mask"], batch["mask"])  # i32 x i32 -> i32
        h = (jax.nn.one_hot(batch["ids"], 64) @ params["table"]) @ params["w"]  # f32[B, T, 32]
        s = jnp.where(band > 0, jnp.einsum("bqd,bkd->bqk", h, h), -1e4)
        return jnp.mean(jax.nn.softmax(s, axis=-1) ** 2)

    batch = {"ids": jnp.arange(64).reshape(4, 16) % 64, "mask": jnp.ones((4, 16), jnp.int32)}
    for policy, fp8 in (("bf16;autocast", 0.0), ("fp8-current", None)):
        state = TrainState.create(params=params, tx=optax.sgd(0.1), policy=policy, loss_scale=NoOpLossScale(),
                                  rng=jax.random.key(2))
        report = precision_audit(state, batch, loss_fn)
        assert all(r["lhs"] != "int32" for r in report.rows) and report.fallbacks == (), report.rows
        assert report.half_fraction == 1.0
        counted = [r for r in report.rows if not r["selection"]]
        selected = sum(r["flops"] for r in report.rows if r["selection"])
        assert selected > 0 and f"{selected / 1e6:,.1f} MFLOP of one-hot selections besides" in report.summary()
        assert f"of {sum(r['flops'] for r in counted) / 1e6:,.1f} MFLOP of matmuls" in report.summary()
        in_fp8 = sum(r["flops"] for r in counted if r["lhs"].startswith("float8") and r["rhs"].startswith("float8"))
        assert report.fp8_fraction == (fp8 if fp8 is not None else in_fp8 / sum(r["flops"] for r in counted))
        assert fp8 is not None or 0 < report.fp8_fraction < 1  # the weight matmul, not attention's product


def test_a_loop_carry_that_starts_one_hot_is_no_selection_and_complex_matmuls_stay_rows():
    """A review's cases: an HMM's forward pass carries `one_hot(start)` into a scan where it becomes a distribution:
    `alpha @ T` is an ordinary matmul, a float32 fall-back under the cast policy (following the carry to its first
    value had made it a selection: 2 fall-backs where there are 3). A complex matmul (an FNO's spectral mixing) is
    still a row, as before integer matmuls were dropped."""
    V = 16
    params = {"T": jax.random.normal(jax.random.key(0), (V, V)), "E": jax.random.normal(jax.random.key(1), (V, V))}

    def hmm(p, obs, rng):
        T = jax.nn.softmax(p["T"], -1)
        alpha0 = jax.nn.one_hot(jnp.zeros(8, jnp.int32), V)  # f32[batch, states], the start state

        def step(alpha, o):
            with jax.numpy_dtype_promotion("standard"):  # float32 alpha x the cast policy's bfloat16 T
                alpha = (alpha @ T) * jax.nn.softmax(p["E"], -1)[:, o].T
            return alpha / alpha.sum(-1, keepdims=True), None

        alpha, _ = jax.lax.scan(step, alpha0, obs)
        return -jnp.log(alpha.sum(-1) + 1e-6).mean()

    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(2))
    report = precision_audit(state, jnp.arange(32).reshape(4, 8) % V, hmm)
    assert not any(r["selection"] for r in report.rows) and len(report.fallbacks) == 3, report.rows

    def spectral(p, x, rng):
        hf = jnp.fft.rfft(x @ p["lift"], axis=1)  # c64[batch, modes, channels]
        w = (p["wr"] + 1j * p["wi"]).astype(jnp.complex64)
        return jnp.mean(jnp.fft.irfft(jnp.einsum("bmi,iom->bmo", hf, w), n=16, axis=1) ** 2)

    params = {"wr": jnp.ones((4, 4, 9)) / 8, "wi": jnp.ones((4, 4, 9)) / 8, "lift": jnp.ones((4, 4)) / 3}
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16;autocast", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(2))
    with jax.numpy_dtype_promotion("standard"):
        report = precision_audit(state, jnp.ones((2, 16, 4)), spectral)
    assert {r["lhs"] for r in report.rows} == {"bfloat16", "complex64"} and 0 < report.half_fraction < 1


def test_a_module_named_like_a_transpose_is_forward_and_a_hidden_layer_is_no_output_layer():
    """`_pass` read "transpose" anywhere in a name stack as autodiff's transpose: a decoder's `conv_transpose`
    module ran "backward", so the FP8 Dense before it seemed to feed the loss through no other matmul and was named
    an output layer. A Double DQN applies the online net twice: its patterns are suggested once each."""

    class Decoder(nn.Module):
        def setup(self):
            self.fc = nn.Dense(4 * 4 * 8)
            self.conv_transpose = nn.ConvTranspose(8, (3, 3), strides=(2, 2))
            self.out = nn.Conv(1, (3, 3))

        def __call__(self, z):
            h = nn.relu(self.fc(z)).reshape(z.shape[0], 4, 4, 8)  # f32[batch, 4, 4, 8]
            return self.out(nn.relu(self.conv_transpose(h)))

    model, z = Decoder(), jax.random.normal(jax.random.key(0), (4, 16))
    state = TrainState.create(params=model.init(jax.random.key(1), z)["params"], tx=optax.sgd(0.1),
                              policy="fp8-current", loss_scale=NoOpLossScale(), rng=jax.random.key(2))
    report = precision_audit(state, z, lambda p, b, r: jnp.mean(model.apply({"params": p}, b) ** 2))
    assert {r["pass"] for r in report.rows if r["weight"] == "conv_transpose.kernel"} == {"forward", "backward"}
    assert report.logits_note() == "", report.logits_note()

    class QNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.relu(nn.Dense(32)(x)))

    qnet = QNet()
    online = qnet.init(jax.random.key(0), jnp.ones((1, 8)))["params"]

    def double_dqn(p, b, rng):
        q = jnp.take_along_axis(qnet.apply({"params": p["online"]}, b["obs"]), b["act"][:, None], 1)[:, 0]
        a_next = jnp.argmax(qnet.apply({"params": p["online"]}, b["next_obs"]), 1)
        q_next = jnp.take_along_axis(qnet.apply({"params": jax.lax.stop_gradient(p["target"])}, b["next_obs"]),
                                     a_next[:, None], 1)[:, 0]
        return optax.huber_loss(q, jax.lax.stop_gradient(b["rew"] + 0.99 * q_next)).mean()

    batch = {"obs": jnp.ones((16, 8)), "next_obs": jnp.ones((16, 8)) / 2, "act": jnp.arange(16) % 4,
             "rew": jnp.ones((16,))}
    state = TrainState.create(params={"online": online, "target": jax.tree.map(jnp.copy, online)},
                              tx=optax.sgd(0.1), policy="fp8-current", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(3), trainable=lambda path, x: path[0].key == "online")
    note = precision_audit(state, batch, double_dqn).logits_note()
    assert (r"fp8_exclude+=^online\.Dense_0\.kernel$,^target\.Dense_0\.kernel$;"
            r"float32_results+=^online\.Dense_0\.kernel$,^target\.Dense_0\.kernel$' keeps them out") in note, note


def test_a_head_whose_weights_come_in_the_batch_is_found_and_frozen_params_name_it():
    """A GAN's generator step that takes the discriminator's weights in its batch: the discriminator's head writes
    bf16 logits into a log-sigmoid. The audit said no half-precision result reached one ("right for a regression")
    and train_step did not warn; it now finds the head and says how to name it: the discriminator in the params,
    frozen, where the suggested policy keeps its logits float32 and trains the generator alone."""
    def mlp(key, sizes):
        keys = jax.random.split(key, len(sizes) - 1)
        return [{"w": jax.random.normal(k, (a, b)) / a ** 0.5} for k, a, b in zip(keys, sizes[:-1], sizes[1:])]

    def run(layers, x):
        for i, layer in enumerate(layers):
            x = x @ layer["w"]
            x = jnp.tanh(x) if i < len(layers) - 1 else x
        return x

    gen, disc = mlp(jax.random.key(0), (4, 32, 16)), mlp(jax.random.key(1), (16, 32, 1))

    def gan_loss(g, d, z):
        logits = run(d, run(g, z))[:, 0]
        return optax.sigmoid_binary_cross_entropy(logits, jnp.ones_like(logits)).mean()

    z = jax.random.normal(jax.random.key(2), (8, 4))
    in_batch = TrainState.create(params=gen, tx=optax.adam(1e-3), policy="bf16;autocast", loss_scale=NoOpLossScale(),
                                 rng=jax.random.key(3))
    report = precision_audit(in_batch, {"z": z, "d": disc}, lambda p, b, rng: gan_loss(p, b["d"], b["z"]))
    assert [(r["weight"], r["into"]) for r in report.half_logits] == [("", "log-sigmoid")], report.half_logits
    assert "an operand is an input of the step outside the params" in report.summary()
    assert "right for a regression" not in report.summary()

    frozen = TrainState.create(params={"g": gen, "d": disc}, tx=optax.adam(1e-3), policy="bf16;autocast",
                               loss_scale=NoOpLossScale(), rng=jax.random.key(3),
                               trainable=lambda path, x: path[0].key == "g")
    loss = lambda p, b, rng: gan_loss(p["g"], p["d"], b["z"])
    note = precision_audit(frozen, {"z": z}, loss).summary()
    policy = re.search(r"policy '([^']*)'", note).group(1)
    assert policy == r"bf16;autocast;float32_results+=^d\.1\.w$", note
    memory = jax.random.normal(jax.random.key(4), (12, 16))  # attention over a memory in the batch: not a head

    def attend(p, b, rng):
        q = b["x"] @ p["wq"]
        return jnp.mean((jax.nn.softmax(q @ b["memory"].T) @ b["memory"] - b["y"]) ** 2)

    attention = TrainState.create(params={"wq": jnp.ones((8, 16)) / 8}, tx=optax.sgd(0.1), policy="bf16;autocast",
                                  loss_scale=NoOpLossScale(), rng=jax.random.key(3))
    batch = {"x": jax.random.normal(jax.random.key(5), (4, 8)), "memory": memory, "y": jnp.zeros((4, 16))}
    assert precision_audit(attention, batch, attend).half_logits == ()
    fixed = precision_audit(frozen.with_policy(policy, NoOpLossScale()), {"z": z}, loss)
    assert fixed.half_logits == () and [r["out"] for r in fixed.rows if r["pass"] == "forward"] == [
        "bfloat16", "bfloat16", "bfloat16", "float32"]


class RaggedMoE(nn.Module):
    """Mixtral's top-2 routing over experts run as grouped matmuls (`lax.ragged_dot` over tokens sorted by expert,
    MaxText's GPU path), its router named `gate` (no default pattern names it)."""

    @nn.compact
    def __call__(self, x):  # f32[tokens, 16]
        weights, chosen = jax.lax.top_k(nn.Dense(4, use_bias=False, name="gate")(x), 2)  # [t, 2]: the experts' picks
        weights = jax.nn.softmax(weights, axis=-1)
        order = jnp.argsort(chosen.reshape(-1))  # the t * 2 picks grouped by expert
        token = jnp.repeat(jnp.arange(x.shape[0]), 2)[order]
        sizes = jnp.bincount(chosen.reshape(-1), length=4).astype(jnp.int32)
        w_in = self.param("w_in", nn.initializers.lecun_normal(), (4, 16, 32))
        w_out = self.param("w_out", nn.initializers.lecun_normal(), (4, 32, 16))
        y = jax.lax.ragged_dot(nn.silu(jax.lax.ragged_dot(x[token], w_in, sizes)), w_out, sizes)  # [t * 2, 16]
        y = y * weights.reshape(-1)[order][:, None]
        return nn.Dense(8, name="head")(x + jnp.zeros_like(x).at[token].add(y))


def test_a_router_found_by_its_top_k_and_grouped_matmuls_in_fp8_or_named():
    """A router whose logits go to `top_k` (no softmax right after it) is named with the policy that keeps them
    float32, and out of FP8; the experts' `ragged_dot`s run in FP8 under `fp8-current`, and under a tiled recipe the
    summary says they keep the compute dtype, rather than leaving 80% of the FLOPs in bf16 without a word. A
    ragged_dot's weight gradient (each group over its own rows) counts the FLOPs of one forward, not groups times
    more."""
    batch = {"x": jax.random.normal(jax.random.key(1), (32, 16)), "y": jnp.arange(32) % 8}
    audit = functools.partial(classifier_audit, RaggedMoE(), batch)

    line = inspect.getsourcelines(RaggedMoE.__call__)[1] + 2
    bf16 = audit("bf16;autocast")
    assert [(r["weight"], r["into"]) for r in bf16.half_logits] == [("gate.kernel", "top_k")]
    assert (f"the router gate.kernel at test_audit.py:{line} writes bfloat16 logits into a top_k (a head, or a "
            "router, no pattern names): policy 'bf16;autocast;float32_results+=^gate\\.kernel$' keeps them "
            "float32") in bf16.summary()
    assert audit("bf16;autocast;float32_results+=^gate\\.kernel$").half_logits == ()
    for w, gemms in (("w_in", 1), ("w_out", 2)):  # (w_in's input is the batch's: no dgrad)
        flops = {p: sum(r["flops"] for r in bf16.rows if r["weight"] == w and r["pass"] == p)
                 for p in ("forward", "backward")}
        assert flops["backward"] == gemms * flops["forward"] > 0, (w, flops)
    fp8 = audit("fp8-current")
    ragged = [(r["pass"], r["lhs"], r["rhs"]) for r in fp8.rows if r["primitive"] == "ragged_dot_general"]
    assert sorted(ragged) == sorted([("forward", "float8_e4m3fn", "float8_e4m3fn"),  # x . w
                                     ("backward", "float8_e4m3fn", "float8_e5m2")] * 2  # wgrad x^T . g
                                    + [("backward", "float8_e5m2", "float8_e4m3fn")]), ragged  # w_out's dgrad
    assert "grouped matmuls" not in fp8.summary() and fp8.fp8_fraction > 0.6, fp8.summary()
    assert ("the router gate.kernel at" in fp8.summary() and "runs in FP8 into a top_k" in fp8.summary()
            and "fp8_exclude+=^gate\\.kernel$" in fp8.summary()), fp8.summary()
    block = audit("fp8-block")
    grouped = sum(r["flops"] for r in block.rows if r["primitive"] == "ragged_dot_general")
    assert {r["lhs"] for r in block.rows if r["primitive"] == "ragged_dot_general"} == {"bfloat16"}
    assert grouped > 0.6 * sum(r["flops"] for r in block.rows)
    assert (f"; {grouped / 1e6:.1f} MFLOP of grouped matmuls (lax.ragged_dot) in the compute dtype: FP8 takes them "
            "in ragged_dot's own form (lhs [m, k], rhs [groups, k, n]) under per-tensor scaling (fp8-current) "
            "only") in block.summary(), block.summary()
    assert "grouped matmuls" not in bf16.summary()  # said only where FP8 was asked for
    excluded = audit("fp8-current;fp8_exclude+=^w_(in|out)$")
    assert {r["fp8_excluded_by"] for r in excluded.rows if r["primitive"] == "ragged_dot_general"} == {
        "^w_(in|out)$"}
    assert "grouped matmuls" not in excluded.summary() and "match no matmul" not in excluded.summary()


def test_a_dot_general_that_contracts_nothing_is_no_matmul_and_a_mask_matmul_is_one_under_every_policy():
    """Flaxformer's MoE router writes its combine weights as `einsum("te,tec->tec", probs, mask)`: a dot_general
    with no contracting dims, an elementwise product. Autocast ran it as a bf16 matmul (float32 probabilities rounded:
    1.8e-3 off) and the audit counted it; now it keeps its operands' widest type, exact, and is no row. Its dispatch
    einsum contracts the tokens of a float32 input with a boolean mask: a GEMM, a row under fp32 (it was dropped as
    an integer matmul there, so the two audits counted different FLOPs) as under autocast, and under the bf16 cast
    policy a half-precision one (its floating operand bf16), not a float32 fall-back."""
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (8, 4)) * 3, axis=-1)  # f32[t, e]
    mask = jax.nn.one_hot(jnp.arange(8) % 4, 4, dtype=jnp.bool_)[:, :, None] & (jnp.arange(3) == 0)  # bool[t, e, c]

    def combine(p, m):  # user code: JAX's standard promotion of bool and float32
        with jax.numpy_dtype_promotion("standard"):
            return jnp.einsum("te,tec->tec", p, m)

    got = jax.jit(jaxamp.autocast(combine, jnp.bfloat16))(probs, mask)
    assert got.dtype == jnp.float32 and jnp.array_equal(got, combine(probs, mask))
    outer = jax.jit(jaxamp.autocast(lambda a, b: jnp.einsum("t,f->tf", a, b), jnp.bfloat16))
    assert outer(probs[:, 0], probs[0]).dtype == jnp.float32  # an outer product of float32 stays float32

    params = {"w": jax.random.normal(jax.random.key(1), (16, 16)) * 0.1}

    def loss(p, batch, rng):
        x = batch["x"].astype(p["w"].dtype) @ p["w"]  # f32[t, 16] (bf16 under the cast policy)
        with jax.numpy_dtype_promotion("standard"):
            weights = jnp.einsum("te,tec->tec", jax.nn.softmax(x[:, :4], axis=-1), batch["mask"])  # no contraction
            routed = jnp.einsum("tec,td->ecd", batch["mask"], x)  # contracts t: a GEMM with a boolean operand
        return jnp.mean(jnp.square(routed)) + jnp.mean(weights)

    batch = {"x": jax.random.normal(jax.random.key(2), (8, 16)), "mask": mask}
    counts = {}
    for policy in ("fp32", "bf16;autocast", "bf16"):
        state = TrainState.create(params=params, tx=optax.sgd(0.1), policy=policy, loss_scale=NoOpLossScale(),
                                  rng=jax.random.key(3))
        report = precision_audit(state, batch, loss)
        counts[policy] = sorted((r["source"].rsplit(":", 1)[1], r["pass"]) for r in report.rows)
        assert all(r["primitive"] == "dot_general" for r in report.rows)
        if policy != "fp32":  # a bf16 activation beside a boolean mask runs in bf16: no float32 fall-back
            assert report.half_fraction == 1.0 and not report.fallbacks, report.summary()
    line = inspect.getsourcelines(loss)[1]
    rows = [(str(line + 1), "forward"), (str(line + 1), "backward"),  # (its input is the batch: wgrad only)
            (str(line + 4), "forward"), (str(line + 4), "backward")]
    product = [(str(line + 3), "backward")]  # where the product is a dot_general, its transpose contracts c
    assert counts["fp32"] == counts["bf16"] == sorted(rows + product), counts
    assert counts["bf16;autocast"] == sorted(rows), counts  # autocast's product is a multiply: a sum backward
    assert "kFLOP of matmuls" in report.summary(), report.summary()  # a toy's FLOPs, not "0.0 MFLOP"


def test_every_layers_router_is_named_by_one_pattern_and_the_mlp_gate_of_an_moe_is_a_default_name():
    """A stack's routers on one source line (no default name: `select`) are suggested as one pattern with the layer
    number as `[0-9]+` (a 48-layer MoE gave 48 anchored paths, each twice under FP8), which keeps them all float32;
    DeepSeek's, Qwen-MoE's and Mixtral's `mlp.gate` / `block_sparse_moe.gate` are default names."""
    class Layer(nn.Module):
        router: str

        @nn.compact
        def __call__(self, x):  # f32[tokens, 16]
            weights, chosen = jax.lax.top_k(nn.Dense(4, use_bias=False, name=self.router)(x), 1)  # the router
            return x + jax.nn.sigmoid(weights) * nn.Dense(16)(x) * (chosen > 1).astype(x.dtype)

    class Stack(nn.Module):
        router: str

        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = Layer(self.router, name=f"layers_{i}")(x)
            return nn.Dense(8, name="head")(x)

    batch = {"x": jax.random.normal(jax.random.key(1), (32, 16)), "y": jnp.arange(32) % 8}

    def audit(net, policy):
        return classifier_audit(net, batch, policy)

    pattern = r"^layers_[0-9]+\.select\.kernel$"
    note = audit(Stack("select"), "bf16;autocast").logits_note()
    assert note.startswith("the routers layers_*.select.kernel (3 layers) at test_audit.py:"), note
    assert f"policy 'bf16;autocast;float32_results+={pattern}' keeps them float32" in note, note
    assert audit(Stack("select"), f"bf16;autocast;float32_results+={pattern}").half_logits == ()
    fp8 = audit(Stack("select"), "fp8-current").logits_note()
    assert f"policy 'fp8-current;fp8_exclude+={pattern};float32_results+={pattern}' keeps them out" in fp8, fp8
    unnamed = audit(Stack(None), "bf16;autocast").logits_note()  # Dense_0 in each layer, its FFN Dense_1 beside it
    assert r"policy 'bf16;autocast;float32_results+=^layers_[0-9]+\.Dense_0\.kernel$' keeps" in unnamed, unnamed
    sae = {"enc": jax.random.normal(jax.random.key(4), (16, 128)) * 0.1, "dec": jnp.zeros((128, 16))}

    def sae_loss(p, b, rng):  # a TopK sparse autoencoder: its encoder's top_k picks features, it is no router
        values, chosen = jax.lax.top_k(b["x"] @ p["enc"], 8)
        code = jnp.zeros((32, 128)).at[jnp.arange(32)[:, None], chosen].set(jax.nn.relu(values))
        return jnp.mean(jnp.square(code @ p["dec"] - b["x"]))

    sae_report = precision_audit(TrainState.create(params=sae, tx=optax.sgd(0.1), policy="bf16;autocast",
                                                   loss_scale=NoOpLossScale(), rng=jax.random.key(2)), batch, sae_loss)
    assert [r["into"] for r in sae_report.half_logits if r["weight"] == "enc"] == [], sae_report.half_logits
    for name in ("mlp.gate", "block_sparse_moe.gate"):  # linen names nest: a module `mlp` holding `gate`
        class Named(nn.Module):
            @nn.compact
            def __call__(self, x, name=name):
                outer, inner = name.split(".")
                return Layer(inner, name=outer)(x)

        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(8, name="head")(Named(name="layers_0")(x))

        report = audit(Net(), "fp8-current")
        assert report.half_logits == (), report.summary()
        router = [r for r in report.rows if r["weight"].endswith("gate.kernel") and r["pass"] == "forward"]
        assert [(r["lhs"], r["out"], r["fp8_excluded_by"]) for r in router] == [
            ("bfloat16", "float32", r"(^|\.)(mlp|moe|block_sparse_moe)\.gate$")], router


def vq_loss(p, b, rng, search=lambda d: jnp.argmax(-d, 1)):
    """A VQ-VAE's loss as Haiku's `hk.nets.VectorQuantizer` computes it: distances to every code
    `|x|^2 - 2 x.E + |E|^2`, the nearest code by `argmax(-distances)` (MaskGIT's VQGAN: `argmin(distances)`), a
    straight-through estimator and the codebook loss."""
    x = b["x"] @ p["enc"]  # f32[n, 64]
    distances = (jnp.sum(x ** 2, 1, keepdims=True) - 2 * x @ p["codebook"]
                 + jnp.sum(p["codebook"] ** 2, 0, keepdims=True))  # f32[n, codes]
    q = p["codebook"].T[search(distances)]  # f32[n, 64]: the nearest codes
    decoded = (x + jax.lax.stop_gradient(q - x)) @ p["dec"]
    return jnp.mean((decoded - b["x"]) ** 2) + jnp.mean((q - jax.lax.stop_gradient(x)) ** 2)


def test_a_codebook_search_into_an_argmax_or_argmin_is_named_and_the_policy_it_gives_keeps_the_codes():
    """A VQ codebook's distance matmul feeds only an argmax (argmin): no softmax or loss finds it, and under
    `fp8-current` its e4m3 distances pick another code for 6.0% of 4,096 inputs (bf16 results: 0.9%). The audit
    names it with the policy that keeps it out of FP8 and its result float32; under that policy 0.4% of the codes
    differ from float32's (bf16 operands: near-ties). A classifier's accuracy argmax leaves its head a softmax's."""
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"enc": jax.random.normal(keys[0], (32, 64)) / 6, "codebook": jax.random.normal(keys[1], (64, 1024)),
              "dec": jax.random.normal(keys[2], (64, 32)) / 8}
    batch = {"x": jax.random.normal(keys[3], (4096, 32))}

    def audit(policy, loss=vq_loss):
        return precision_audit(TrainState.create(params=params, tx=optax.sgd(0.1), policy=policy,
                                                 loss_scale=NoOpLossScale(), rng=jax.random.key(1)), batch, loss)

    line = inspect.getsourcelines(vq_loss)[1] + 5
    bf16 = audit("bf16;autocast")
    assert [(r["weight"], r["into"]) for r in bf16.half_logits] == [("codebook", "argmax")], bf16.half_logits
    assert (f"the search over codebook at test_audit.py:{line} writes bfloat16 scores into an argmax (a "
            "nearest-neighbour search, such as a VQ codebook's, no pattern names: its pick changes where two entries "
            "score within the format's rounding): policy 'bf16;autocast;float32_results+=^codebook$' keeps them "
            "float32") in bf16.summary(), bf16.summary()
    kept = audit("bf16;autocast;float32_results+=^codebook$")
    assert kept.half_logits == () and [(r["lhs"], r["out"]) for r in kept.rows if r["weight"] == "codebook"] == [
        ("bfloat16", "float32")]  # (the search has no gradient: no backward row)
    argmin = audit("bf16;autocast", functools.partial(vq_loss, search=lambda d: jnp.argmin(d, -1)))
    assert "the search over codebook at" in argmin.summary() and "bfloat16 distances into an argmin" in \
        argmin.summary(), argmin.summary()
    assert [(r["weight"], r["into"]) for r in audit("fp8-current").half_logits] == [
        ("dec", "the loss through no other matmul"), ("codebook", "argmax")]  # (the output layer named first)
    fp8 = audit("fp8-current;fp8_exclude+=^dec$;float32_results+=^dec$")
    assert "the search over codebook at" in fp8.summary() and "runs in FP8 into an argmax" in fp8.summary()
    suggested = "fp8-current;fp8_exclude+=^dec$,^codebook$;float32_results+=^dec$,^codebook$"
    assert f"policy '{suggested}' keeps it out" in fp8.summary(), fp8.summary()
    assert [(r["lhs"], r["out"], r["fp8_excluded_by"]) for r in audit(suggested).rows if r["weight"] == "codebook"
            ] == [("bfloat16", "float32", "^codebook$")]

    def codes(p, x):
        return jnp.argmax(-(jnp.sum(x ** 2, 1, keepdims=True) - 2 * x @ p["codebook"]
                            + jnp.sum(p["codebook"] ** 2, 0, keepdims=True)), 1)

    x = batch["x"] @ params["enc"]
    exact = codes(params, x)
    with jax.numpy_dtype_promotion("standard"):
        flipped = {name: float(jnp.mean(jaxamp.autocast(codes, "bf16", **kw)(params, x) != exact))
                   for name, kw in [("fp8", {"fp8": "current"}), ("bf16", {}),
                                    ("kept", {"fp8": "current", "fp8_exclude": ["^codebook$"],
                                              "float32_results": ["^codebook$"]})]}
    assert flipped["fp8"] > 0.05 and flipped["kept"] < 0.01 and flipped["kept"] < flipped["bf16"], flipped

    net = nn.Dense(10)
    head = {"params": net.init(jax.random.key(2), jnp.ones((1, 32)))["params"]}

    def classify(p, b, rng):  # the loss's softmax and an accuracy's argmax take the same logits
        logits = net.apply(p, b["x"])
        labels = jnp.arange(b["x"].shape[0]) % 10
        accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean() + 0 * accuracy

    report = precision_audit(TrainState.create(params=head, tx=optax.sgd(0.1), policy="bf16;autocast;"
                             "float32_results=", loss_scale=NoOpLossScale(), rng=jax.random.key(1)), batch, classify)
    assert [r["into"] for r in report.half_logits] == ["softmax"], report.half_logits  # (bf16 logits asked for)


def test_a_search_is_a_matmul_whose_result_goes_only_into_an_argmax_and_is_named_last():
    """A hidden layer whose activations an argmax also reads (a diagnostic), or a classifier trained by MSE with an
    accuracy argmax, is no search: the audit called the hidden layer one under fp8-current, and its policy took the
    FP8 share from 100% to 2.3%. A classifier's head and an FP8 output layer are named before a search, whatever
    their FLOPs; a search whose codebook is no param (in the batch, a model's state) gets advice that fits."""
    keys = jax.random.split(jax.random.key(0), 4)
    batch = {"x": jax.random.normal(keys[0], (128, 64)), "y": jnp.arange(128) % 10}

    def audit(params, loss, policy="fp8-current", b=batch):
        return precision_audit(TrainState.create(params=params, tx=optax.sgd(0.1), policy=policy,
                                                 loss_scale=NoOpLossScale(), rng=jax.random.key(1)), b, loss)

    def hidden(p, b, rng):
        h = b["x"] @ p["w1"]  # f32[128, 256]
        winners = jnp.argmax(h, -1)  # a diagnostic of the hidden units
        return jnp.mean((jax.nn.relu(h) @ p["w2"])[:, 0] - winners.astype(jnp.float32) * 0.0) ** 2

    mlp = {"w1": jax.random.normal(keys[1], (64, 256)) / 8, "w2": jax.random.normal(keys[2], (256, 1)) / 16}
    assert [(r["weight"], r["into"]) for r in audit(mlp, hidden).half_logits] == [
        ("w2", "the loss through no other matmul")]

    def mse_classifier(p, b, rng):  # one-hot targets by MSE, and an accuracy
        logits = b["x"] @ p["w"]
        accuracy = jnp.mean(jnp.argmax(logits, -1) == b["y"])
        return jnp.mean((logits - jax.nn.one_hot(b["y"], 10)) ** 2) + 0 * accuracy

    linear = {"w": jax.random.normal(keys[3], (64, 10)) / 8}
    assert audit(linear, mse_classifier, "bf16;autocast").half_logits == ()

    def vq_classifier(p, b, rng):  # a VQ's search (the larger matmul) and a classifier on its codes
        x = b["x"]
        d = jnp.sum(x ** 2, 1, keepdims=True) - 2 * x @ p["codebook"] + jnp.sum(p["codebook"] ** 2, 0, keepdims=True)
        q = p["codebook"].T[jnp.argmin(d, -1)]  # f32[128, 64]
        logits = (x + jax.lax.stop_gradient(q - x)) @ p["cls"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    both = {"codebook": jax.random.normal(keys[1], (64, 512)), "cls": linear["w"]}
    report = audit(both, vq_classifier, "bf16;autocast")
    assert [(r["weight"], r["into"]) for r in report.half_logits] == [("cls", "softmax"), ("codebook", "argmin")]
    assert report.logits_note().startswith("the output head cls at"), report.logits_note()

    def vq_batch(p, b, rng):  # the codebook comes in the batch
        x, c = b["x"] @ p["enc"], b["codebook"]
        q = c.T[jnp.argmin(jnp.sum(x ** 2, 1, keepdims=True) - 2 * x @ c + jnp.sum(c ** 2, 0, keepdims=True), -1)]
        return jnp.mean((x + jax.lax.stop_gradient(q - x) - b["x"]) ** 2)

    note = audit({"enc": jnp.eye(64)}, vq_batch, "bf16;autocast", {**batch, "codebook": both["codebook"]}
                 ).logits_note()
    assert note.startswith("the search at test_audit.py:") and "(its codebook is no param" in note, note
    assert "bfloat16 distances into an argmin" in note and "jax.named_scope('head')" in note, note


def test_a_while_loops_cond_takes_its_own_consts_not_the_bodys():
    """A `while_loop` takes its cond's consts, then its body's, then the carry: the cond's inputs are the first and
    the last of those. The audit linked the cond's inputs to the operands' tail, so the body's last const `h`
    stood for the cond's const `t` and `h` was called an output head writing logits into the cond's softmax."""
    def loss(p, b, rng):
        h = b["x"] @ b["m"]  # f32[8, 16], an input of the step x another: a candidate head, not one
        g = b["x"] @ b["n"]  # f32[8, 16]: into a softmax inside the body

        def cond(c):
            return (jax.nn.softmax(b["t"])[0] < 0.9) & (c[0] < 3)  # the cond's const: t

        def body(c):  # the body's consts: g, h
            return c[0] + 1, c[1] + jax.nn.softmax(g) + jnp.tanh(h)

        _, acc = jax.lax.while_loop(cond, body, (0, jnp.zeros((8, 16))))  # (no gradient through it)
        return jnp.mean(acc * (b["x"] @ p["u"]))

    keys = jax.random.split(jax.random.key(0), 4)
    batch = {"x": jax.random.normal(keys[0], (8, 32)), "m": jax.random.normal(keys[1], (32, 16)),
             "n": jax.random.normal(keys[2], (32, 16)), "t": jnp.arange(16.0)}
    state = TrainState.create(params={"u": jax.random.normal(keys[3], (32, 16))}, tx=optax.sgd(0.1),
                              policy="bf16;autocast", loss_scale=NoOpLossScale(), rng=jax.random.key(1))
    report = precision_audit(state, batch, loss)
    line = inspect.getsourcelines(loss)[1] + 2  # g's
    assert [(r["source"], r["into"]) for r in report.half_logits] == [(f"test_audit.py:{line}", "softmax")], \
        report.half_logits


def test_a_matmul_in_a_while_loops_cond_names_its_param():
    """A matmul against a param inside a `while_loop`'s cond (an early-exit test) is a weight matmul as one in the
    body is: its row names the param (autocast carried param paths into the body's consts only; the cond's row
    read an empty `weight`), so FP8 recipes take it as a weight matmul and `fp8_exclude` can name it."""
    def loss(p, b, rng):
        def cond(c):
            return (jnp.sum(c[0] @ jax.lax.stop_gradient(p["v"])) < 10.0) & (c[1] < 5)

        x, _ = jax.lax.while_loop(cond, lambda c: (c[0] * 1.1, c[1] + 1),
                                  (jax.lax.stop_gradient(b["x"] @ p["w"]), 0))
        return jnp.mean((x + b["x"] @ p["w"]) ** 2)

    params = {"w": jnp.full((4, 4), 0.1), "v": jnp.full((4, 4), 0.1)}
    line = inspect.getsourcelines(loss)[1] + 2  # the cond's matmul
    for policy, dtype, fp8 in [("bf16;autocast", "bfloat16", None), ("fp8-current", "float8_e4m3fn", None),
                               ("fp8-current;fp8_exclude+=^v$", "bfloat16", "^v$")]:
        state = TrainState.create(params=params, tx=optax.sgd(0.1), policy=policy, loss_scale=NoOpLossScale(),
                                  rng=jax.random.key(1))
        rows = [r for r in precision_audit(state, {"x": jnp.ones((2, 4))}, loss).rows
                if r["source"] == f"test_audit.py:{line}"]
        assert [(r["weight"], r["pass"], r["lhs"], r["rhs"]) for r in rows] == [("v", "forward", dtype, dtype)], \
            (policy, rows)
        assert (rows[0].get("fp8_excluded_by") or None) == fp8, (policy, rows[0])


def test_a_scanned_stack_without_a_head_is_no_output_layer():
    """`nn.scan` over residual MLP blocks, the loss on the stack's output: each block's output matmul feeds the next
    trip's. The audit called it an output layer (the carry's way back into the body was not followed) and its policy
    kept half the stack's matmuls out of FP8; a head after the stack is still found."""
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.Dense(64)(nn.gelu(nn.Dense(64)(x))), None

    class Net(nn.Module):
        head: bool

        @nn.compact
        def __call__(self, x):  # f32[16, 64]
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)()(x, None)
            return nn.Dense(1)(x) if self.head else x

    x = jax.random.normal(jax.random.key(0), (16, 64))
    for head, found in ((False, []), (True, [("Dense_0.kernel", "the loss through no other matmul")])):
        net = Net(head)
        state = TrainState.create(params=net.init(jax.random.key(1), x)["params"], tx=optax.sgd(0.1),
                                  policy="fp8-current", loss_scale=NoOpLossScale(), rng=jax.random.key(2))
        report = precision_audit(state, {"x": x},
                                 lambda p, b, r, net=net: jnp.mean(net.apply({"params": p}, b["x"]) ** 2))
        assert [(r["weight"], r["into"]) for r in report.half_logits] == found, report.summary()
        assert report.fp8_fraction == 1.0

    def rollout(p, b, rng):  # an autoregressive rollout: one loop-invariant output layer, its prediction fed back
        def step(h, _):
            y = jnp.tanh(h @ p["w_in"]) @ p["w_out"]  # f32[16, 64]: the prediction, the next input
            return y, y

        _, ys = jax.lax.scan(step, b["x"], None, length=5)
        return jnp.mean(ys ** 2)

    weights = {"w_in": jnp.eye(64), "w_out": jnp.eye(64) / 2}
    state = TrainState.create(params=weights, tx=optax.sgd(0.1), policy="fp8-current", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(3))
    assert [(r["weight"], r["into"]) for r in precision_audit(state, {"x": x}, rollout).half_logits] == [
        ("w_out", "the loss through no other matmul")]


def test_a_one_hot_segment_sum_is_a_matmul_in_every_policy_and_a_selection_is_not():
    """`x.T @ one_hot(ids)` (VectorQuantizerEMA's per-code sums) contracts the one-hot's rows: autocast runs it as any
    matmul, in bf16. The fp32 audit called it a selection (left out of the FLOPs: 59.2 against autocast's 59.5
    MFLOP on a Haiku VQ-VAE), and the cast policy's float32 one hid as one. A lookup `one_hot(ids) @ table`, and its
    gradient, stay selections."""
    def loss(p, b, rng):
        with jax.numpy_dtype_promotion("standard"):  # (user code: the cast policy mixes bf16 params and f32 inputs)
            hot = jax.nn.one_hot(jnp.argmax(b["x"] @ p["codes"], -1), 64)  # f32[128, 64]
            sums = b["x"].T @ hot  # f32[16, 64]: each code's inputs summed
            picked = hot @ p["codes"].T  # f32[128, 16]: each input's code
            return jnp.mean((picked - b["x"]) ** 2) + jnp.mean(jax.lax.stop_gradient(sums) * p["codes"])

    params = {"codes": jax.random.normal(jax.random.key(0), (16, 64))}
    batch = {"x": jax.random.normal(jax.random.key(1), (128, 16))}
    reports = {policy: precision_audit(TrainState.create(params=params, tx=optax.sgd(0.1), policy=policy,
                                                         loss_scale=NoOpLossScale(), rng=jax.random.key(2)),
                                       batch, loss) for policy in ("fp32", "bf16", "bf16;autocast")}
    for policy, report in reports.items():
        kinds = {(r["pass"], r["shape"]): r["selection"] for r in report.rows}
        assert kinds == {("forward", "[128, 16] x [16, 64]"): False, ("forward", "[16, 128] x [128, 64]"): False,
                         ("forward", "[128, 64] x [64, 16]"): True, ("backward", "[128, 16] x [128, 64]"): True}, \
            (policy, kinds)
    counted = {p: sum(r["flops"] for r in rep.rows if not r["selection"]) for p, rep in reports.items()}
    assert counted["fp32"] == counted["bf16;autocast"] == 2 * 128 * 16 * 64 * 2, counted
    assert "[16, 128] x [128, 64]" in [r["shape"] for r in reports["bf16"].fallbacks]  # (float32 inputs: no selection)


def test_a_remat_layers_forward_row_names_the_users_line():
    """Under a gradient, `nn.remat(nn.Dense)`'s forward matmul is moved out of the remat with the body's traceback,
    which holds no user frame: its row's source read `flax/linen/linear.py:Dense.__call__` where its backward rows
    read the user's line."""
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.remat(nn.Dense)(16)(x)  # f32[8, 16]
            return nn.Dense(1)(h)

    net, x = Net(), jnp.ones((8, 4))
    state = TrainState.create(params=net.init(jax.random.key(0), x)["params"], tx=optax.sgd(0.1),
                              policy="bf16;autocast", loss_scale=NoOpLossScale(), rng=jax.random.key(1))
    report = precision_audit(state, {"x": x}, lambda p, b, rng: jnp.mean(net.apply({"params": p}, b["x"]) ** 2))
    line = inspect.getsourcelines(Net.__call__)[1] + 2
    sources = {(r["weight"], r["pass"]): r["source"] for r in report.rows}
    assert sources[("CheckpointDense_0.kernel", "forward")] == f"test_audit.py:{line}", sources
    assert sources[("CheckpointDense_0.kernel", "backward")] == f"test_audit.py:{line}", sources
