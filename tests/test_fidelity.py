"""Mixed precision that stays exact at realistic batch sizes: each input of the fidelity issue, with its right value.

float32 lookups and float32 bias/position sums (`jaxamp.layers`), the per-leaf `keep_float32` rule, frozen leaves
(`trainable`), retry on a NaN that no scale fixes, and the gradient-fidelity check (`jaxamp.fidelity`).
"""

import collections

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxamp import DynamicLossScale, NoOpLossScale, TrainState, get_policy, train_step
from jaxamp.fidelity import grad_fidelity, worst
from jaxamp.layers import Embed, embed_lookup
from jaxamp.lm.data import CharDataset, batch_at, default_corpus_text
from jaxamp.lm.model import LM_KEEP_FLOAT32, TransformerConfig, TransformerLM, cross_entropy_loss

T = jnp.asarray([0.5, -1.0, 2.0, 0.25, -3.0, 1.5, 0.75, -0.125], jnp.float32)  # the fixed float32 8-vector t
IDS = jnp.zeros((4096,), jnp.int32)  # 4096 lookups of row 0
STEP = jax.jit(train_step, static_argnames=("loss_fn", "on_overflow"))


def scale_for(policy: str):
    return DynamicLossScale(2.0**15) if policy == "fp16" else NoOpLossScale()


def row0_gradient(policy, lookup) -> np.ndarray:
    """params - new_params under sgd(1.0) = the gradient; returns row 0 as float64."""
    params = {"e": jnp.ones((4, 8), jnp.float32)}

    def loss_fn(p, ids, rng):
        del rng
        rows = lookup(p["e"], ids)  # [4096, 8] in the compute dtype
        return jnp.mean(jnp.sum(rows.astype(jnp.float32) * T, axis=-1))

    state = TrainState.create(params=params, tx=optax.sgd(1.0), policy=policy, loss_scale=scale_for(_name(policy)),
                              rng=jax.random.key(0))
    for _ in range(3):  # a float16 table's summed gradient (2^15 * 3) overflows once; the scale backs off
        state, metrics = STEP(state, IDS, loss_fn)
        if bool(metrics["grads_finite"]):
            break
    assert bool(metrics["grads_finite"])
    return np.asarray(params["e"] - state.params["e"], np.float64)[0]


def _name(policy) -> str:
    return {jnp.dtype(jnp.float16): "fp16", jnp.dtype(jnp.bfloat16): "bf16"}.get(jnp.dtype(policy.compute_dtype),
                                                                              "fp32")


# 1. Gathered rows ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bf16", "fp16"])
@pytest.mark.parametrize("keep", [("e",), ()], ids=["table kept float32", "table in the compute dtype"])
def test_lookup_gradient_is_t_the_documented_way(name, keep):
    policy = get_policy(name, keep_float32=keep)
    grad = row0_gradient(policy, lambda table, ids: embed_lookup(table, ids, policy.compute_dtype))
    np.testing.assert_allclose(grad, np.asarray(T), rtol=0.02)
    if keep:  # the table stays float32: the float32 scatter-add is exact
        np.testing.assert_allclose(grad, np.asarray(T), rtol=1e-6)


@pytest.mark.parametrize("name, kept_fraction", [("bf16", 1 / 16), ("fp16", 1 / 2)])
def test_a_lookup_into_a_half_precision_table_loses_most_of_the_gradient(name, kept_fraction):
    """The fault the rule exists for: `table[ids]` of a cast table is a half-precision scatter-add."""
    grad = row0_gradient(get_policy(name), lambda table, ids: table[ids])
    ratio = grad / np.asarray(T)
    assert np.all(ratio < 2 * kept_fraction) and np.all(ratio > kept_fraction / 2), ratio


def test_embed_module_matches_the_function_and_keeps_its_param_name():
    module = Embed(4, 8, dtype=jnp.bfloat16)
    params = module.init(jax.random.key(0), IDS[:3])["params"]
    assert set(params) == {"embedding"} and params["embedding"].dtype == jnp.float32
    out = module.apply({"params": params}, jnp.asarray([0, 3, -1]))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out[:2], np.float32),
                                  np.asarray(params["embedding"][jnp.asarray([0, 3])].astype(jnp.bfloat16), np.float32))
    assert np.all(np.isnan(np.asarray(out[2], np.float32)))  # a negative id gives NaN, never another row


def test_policy_keep_float32_rule_round_trips_and_casts_only_the_named_leaves():
    policy = get_policy("fp16", keep_float32=LM_KEEP_FLOAT32)
    assert get_policy(str(policy)) == policy and str(policy).startswith("fp16;keep_float32=")
    tree = {"wte": {"embedding": jnp.ones(2)}, "wpe": {"embedding": jnp.ones(2)}, "h_0": {"kernel": jnp.ones(2)},
            "count": jnp.ones(2, jnp.int32)}
    cast = policy.cast_to_compute(tree)
    assert cast["wte"]["embedding"].dtype == cast["wpe"]["embedding"].dtype == jnp.float32
    assert cast["h_0"]["kernel"].dtype == jnp.float16 and cast["count"].dtype == jnp.int32
    assert policy.cast_to_param(tree)["h_0"]["kernel"].dtype == jnp.float32
    with pytest.raises(ValueError, match="keep_float32"):
        get_policy("fp16", keep_float32="wte")
    with pytest.raises(ValueError, match="keep_float32"):
        get_policy("fp16;keep=wte")
    from jaxamp.precision import Policy

    with pytest.raises(ValueError, match="keep_float32"):  # read per character, "*" would keep every leaf
        Policy(jnp.float32, jnp.float16, jnp.float32, keep_float32="*embedding")
    listed = Policy(jnp.float32, jnp.float16, jnp.float32, keep_float32=["wte/embedding"])
    assert listed.keep_float32 == ("wte/embedding",)
    assert hash(listed) == hash(get_policy("fp16;keep_float32=wte/embedding"))


def test_keep_float32_pattern_that_matches_no_leaf_is_refused():
    """A typo, or a pattern written for `params` used on a variables dict (FP8), names the paths instead of
    leaving the table in the compute dtype."""
    variables = {"params": {"wte": {"embedding": jnp.ones((4, 2))}, "h_0": {"kernel": jnp.ones((2, 2))}}}
    for keep in (LM_KEEP_FLOAT32[:1], ("*/embeding",)):
        with pytest.raises(ValueError, match="matches no params leaf.*params/wte/embedding"):
            TrainState.create(params=variables, tx=optax.sgd(0.1), policy=get_policy("bf16", keep_float32=keep),
                              loss_scale=NoOpLossScale(), rng=jax.random.key(0))
    state = TrainState.create(params=variables["params"], tx=optax.sgd(0.1), policy="bf16",
                              loss_scale=NoOpLossScale(), rng=jax.random.key(0))
    with pytest.raises(ValueError, match="matches no params leaf"):
        state.with_policy(get_policy("bf16", keep_float32=("wte/embeding",)), NoOpLossScale())
    state = state.with_policy(get_policy("bf16", keep_float32=LM_KEEP_FLOAT32[:1]), NoOpLossScale())
    assert state.compute_params()["wte"]["embedding"].dtype == jnp.float32


def _dots(jaxpr) -> list:
    """Every dot_general equation of a jaxpr, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _dots(inner)
    return found


@pytest.mark.slow
def test_lm_matmuls_run_in_the_compute_dtype_and_lookups_in_float32():
    cfg = TransformerConfig(vocab_size=50, seq_len=16, num_layers=2, num_heads=2, width=32)
    model = TransformerLM(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]
    params_c = get_policy("bf16", keep_float32=LM_KEEP_FLOAT32).cast_to_compute(params)
    assert params_c["wte"]["embedding"].dtype == jnp.float32
    tokens = jnp.zeros((4, 16), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: cross_entropy_loss(model.apply({"params": p}, tokens), tokens)))(
        params_c).jaxpr
    dots = _dots(jaxpr)
    # Dense layers and the tied head (operands of rank <= 3): bfloat16 x bfloat16, forward and both backward dots.
    dense = [[v.aval.dtype for v in eqn.invars] for eqn in dots if max(v.aval.ndim for v in eqn.invars) <= 3]
    assert len(dense) == 3 * (4 * cfg.num_layers + 1), len(dense)
    assert all(a == b == jnp.bfloat16 for a, b in dense), dense
    # The rest are the attention core's (rank >= 4 operands), the documented float32 island (on CPU).
    island = [[v.aval.dtype for v in eqn.invars] for eqn in dots if max(v.aval.ndim for v in eqn.invars) >= 4]
    assert len(island) + len(dense) == len(dots) and all(a == b == jnp.float32 for a, b in island)
    # The lookups' transposes are float32 scatter-adds into the float32 tables.
    scatters = [e for e in jaxpr.eqns if e.primitive.name.startswith("scatter")]
    assert scatters and all(e.invars[0].aval.dtype == jnp.float32 for e in scatters)


# 2. Frozen leaves ----------------------------------------------------------------------------------------------------


def frozen_sqrt_setup():
    params = {"frozen": jnp.asarray([1.0, 0.0]), "head": jnp.asarray([0.5, 0.5])}
    tx = optax.multi_transform({"head": optax.adam(0.1), "frozen": optax.set_to_zero()},
                               {"frozen": "frozen", "head": "head"})

    def loss_fn(p, x, rng):
        del rng
        y = x.astype(p["head"].dtype) * jnp.sqrt(p["frozen"]) * p["head"]  # d/d frozen at 0: inf * 0 = NaN
        return jnp.sum(y.astype(jnp.float32))

    return params, tx, loss_fn


@pytest.mark.parametrize("policy", ["fp16", "fp32"])
@pytest.mark.parametrize("trainable", [{"frozen": False, "head": True},
                                       lambda path, leaf: path[0].key == "head"], ids=["bool tree", "callable"])
def test_a_frozen_leaf_with_a_bad_gradient_does_not_stop_training(policy, trainable):
    params, tx, loss_fn = frozen_sqrt_setup()
    state = TrainState.create(params=params, tx=tx, policy=policy, loss_scale=scale_for(policy),
                              rng=jax.random.key(0), trainable=trainable)
    before = np.asarray(state.params["frozen"]).tobytes()
    for _ in range(3):
        state, metrics = STEP(state, jnp.asarray([1.0, 2.0]), loss_fn)
        assert bool(metrics["grads_finite"]) and np.isfinite(float(metrics["grad_norm"]))
    assert float(state.loss_scale.loss_scale) == float(scale_for(policy).loss_scale)  # no backoff
    assert float(state.params["head"][0]) < 0.5  # head trained (its second entry has zero gradient)
    assert np.asarray(state.params["frozen"]).tobytes() == before
    assert metrics["grads_finite_leaves"]["frozen"] is None


@pytest.mark.parametrize("policy", ["fp16", "fp32"])
def test_multi_transform_alone_skips_every_step(policy):
    """What the README warns about: set_to_zero still differentiates the frozen leaf, and its NaN skips the step."""
    params, tx, loss_fn = frozen_sqrt_setup()
    state = TrainState.create(params=params, tx=tx, policy=policy, loss_scale=scale_for(policy),
                              rng=jax.random.key(0))
    for _ in range(3):
        state, metrics = STEP(state, jnp.asarray([1.0, 2.0]), loss_fn)
        assert not bool(metrics["grads_finite"])
    assert float(state.params["head"][0]) == 0.5


def projection_setup():
    k1, k2 = jax.random.split(jax.random.key(3))
    params = {"proj": jax.random.normal(k1, (16, 64)) * 1e-3, "head": jax.random.normal(k2, (64, 1)) * 0.1}
    x = 300.0 + jax.random.uniform(jax.random.key(4), (512, 16))  # raw inputs around 300

    def loss_fn(p, x, rng):
        del rng
        h = jnp.tanh(x.astype(p["proj"].dtype) @ p["proj"])  # [512, 64]
        return jnp.mean(jnp.square((h @ p["head"]).astype(jnp.float32) - 1.0))

    return params, x, loss_fn


def test_a_frozen_input_projection_no_longer_drags_the_scale_down():
    params, x, loss_fn = projection_setup()
    results = {}
    for frozen in (False, True):
        state = TrainState.create(params=params, tx=optax.adam(1e-3), policy="fp16",
                                  loss_scale=DynamicLossScale(2.0**12), rng=jax.random.key(0),
                                  trainable={"proj": not frozen, "head": True})
        state, metrics = STEP(state, x, loss_fn)
        results[frozen] = (bool(metrics["grads_finite"]), float(state.loss_scale.loss_scale), state)
    # Scaled, proj's weight gradient is ~5e5 (float16 overflows at 65504), head's ~9e3.
    assert results[False][:2] == (False, 2.0**11)  # skipped, the scale backs off
    assert results[True][:2] == (True, 2.0**12)
    state = results[True][2]
    assert np.asarray(state.params["proj"]).tobytes() == np.asarray(params["proj"]).tobytes()
    assert state.opt_state[0].mu["proj"] is None and state.opt_state[0].mu["head"].shape == (64, 1)  # no state


def test_frozen_leaves_are_not_differentiated():
    """Freezing the projection removes its weight-gradient matmul, and the one feeding it, from the step."""
    params, x, loss_fn = projection_setup()

    def count(trainable):
        state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="fp16", loss_scale=NoOpLossScale(),
                                  rng=jax.random.key(0), trainable=trainable)
        return len(_dots(jax.make_jaxpr(lambda s: train_step(s, x, loss_fn))(state).jaxpr))

    assert count({"proj": False, "head": True}) == count(None) - 2  # neither dh nor dproj is computed


def test_trainable_errors_name_the_problem():
    params, tx, _ = frozen_sqrt_setup()
    make = lambda t: TrainState.create(params=params, tx=tx, policy="fp32", loss_scale=NoOpLossScale(),  # noqa: E731
                                       rng=jax.random.key(0), trainable=t)
    with pytest.raises(ValueError, match="every params leaf"):
        make({"frozen": False, "head": False})
    with pytest.raises(ValueError, match="bool per params leaf"):
        make({"frozen": 0, "head": True})
    with pytest.raises(ValueError, match=r"does not fit params: at the top trainable has key 'other', params have"):
        make({"other": True})
    with pytest.raises(ValueError, match=r"at the top trainable lacks the keys \['head'\]"):
        make({"frozen": False})
    with pytest.raises(ValueError, match=r"at \['head'\] trainable has None; write True or False"):
        make({"frozen": False, "head": None})
    a = jnp.ones(2)
    listed = lambda t, p: TrainState.create(  # noqa: E731
        params=p, tx=optax.sgd(1.0), policy="fp32", loss_scale=NoOpLossScale(), rng=jax.random.key(0), trainable=t)
    with pytest.raises(ValueError, match=r"at \['l'\] trainable has 1 entries where params have 2$"):
        listed({"l": [True]}, {"l": [a, a]})
    with pytest.raises(ValueError, match=r"at the top trainable has a tuple where params have list$"):
        listed((False, True), [a, a])
    # A dict rule fits FrozenDicts inside a list too (flax.core.unfreeze stops at the list).
    frozen = [flax.core.freeze({"w": a, "b": a}), flax.core.freeze({"w": a, "b": a})]
    assert listed([{"w": True, "b": False}, True], frozen).trainable == (False, True, True, True)
    pair = collections.namedtuple("pair", "first second")
    assert listed(pair({"w": False}, True), pair(flax.core.freeze({"w": a}), a)).trainable == (False, True)
    # None where params hold None is a fitting prefix: the message points at the real misfit.
    with pytest.raises(ValueError, match=r"at \['b'\] trainable has key 'x', params have \['y'\]$"):
        listed({"a": None, "b": {"x": True}, "c": False}, {"a": None, "b": {"y": a}, "c": a})
    assert make(True).trainable is None  # all trainable: the canonical None


def test_a_dict_prefix_fits_frozen_dict_params():
    """`{"enc": False, "head": True}` (the README's form) on FrozenDict params, and a FrozenDict rule on dicts."""
    import flax

    params = {"enc": {"w": jnp.ones(2, jnp.float32)}, "head": {"w": jnp.ones(2, jnp.float32)}}
    loss = lambda p, batch, rng: jnp.sum(p["enc"]["w"] * p["head"]["w"])  # noqa: E731
    rule = {"enc": False, "head": True}
    for p, t in ((flax.core.freeze(params), rule), (params, flax.core.freeze(rule))):
        state = TrainState.create(params=p, tx=optax.sgd(0.5), policy="fp32", loss_scale=NoOpLossScale(),
                                  rng=jax.random.key(0), trainable=t)
        assert state.trainable == (False, True)
        new, _ = train_step(state, None, loss)
        assert new.params["enc"]["w"] is state.params["enc"]["w"]  # frozen: the very array
        np.testing.assert_array_equal(np.asarray(new.params["head"]["w"]), np.full(2, 0.5, np.float32))


# 4. Retry on a NaN that no scale fixes --------------------------------------------------------------------------------


def test_retry_spends_no_more_scale_or_compute_than_skip_on_a_persistent_nan():
    params = {"w": jax.random.normal(jax.random.key(0), (4, 8)) * 0.5}
    x = jax.random.normal(jax.random.key(1), (8, 4)).at[:2].set(0.0)  # 2 of 8 rows all zero
    calls = []

    def loss_fn(p, x, rng):
        del rng
        jax.debug.callback(lambda: calls.append(1))
        h = x.astype(p["w"].dtype) @ p["w"]  # [8, 8] float16
        penalty = jnp.sqrt(jnp.sum(h**2, axis=-1) + jnp.asarray(1e-8, h.dtype))  # 1e-8 is 0 in float16
        return jnp.mean(penalty.astype(jnp.float32))

    scales = {}
    for mode in ("skip", "retry"):
        state = TrainState.create(params=params, tx=optax.adam(1e-3), policy="fp16",
                                  loss_scale=DynamicLossScale(2.0**15), rng=jax.random.key(0))
        calls.clear()
        for _ in range(3):
            state, metrics = STEP(state, x, loss_fn, on_overflow=mode)
            jax.block_until_ready(metrics)
            assert bool(metrics["loss_finite"]) and not bool(metrics["grads_finite"])
        scales[mode] = (float(state.loss_scale.loss_scale), len(calls))
    assert scales["skip"] == (2.0**12, 3)
    assert scales["retry"] == (2.0**12, 6)  # one probe at the lowest scale per step, no backoff retries
    assert int(metrics["retries"]) == 0 and bool(metrics["nonfinite_at_min_scale"])


# 5. The gradient-fidelity check --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fidelity_flags_an_embedding_written_the_wrong_way():
    ids = jnp.where(jnp.arange(4096) % 5 == 0, jnp.arange(4096) % 4, 0)  # row 0 in 80% of the positions
    params = {"e": jax.random.normal(jax.random.key(0), (4, 8)), "w": jax.random.normal(jax.random.key(1), (8, 1))}

    def make_loss(lookup):
        def loss_fn(p, ids, rng):
            del rng
            h = lookup(p["e"], ids, p["w"].dtype)  # [4096, 8]
            return jnp.mean(jnp.square((h @ p["w"]).astype(jnp.float32)))
        return loss_fn

    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(0))
    wrong = grad_fidelity(state, ids, make_loss(lambda table, ids, dtype: table[ids]))
    right = grad_fidelity(state, ids, make_loss(embed_lookup))
    assert float(wrong["e"]) > 0.1 and worst(wrong, 1)[0][0] == "e"
    assert float(right["e"]) < 0.02 and float(right["w"]) < 0.02
    assert float(wrong["w"]) == pytest.approx(float(right["w"]), rel=1e-6)  # the same dense gradient either way


@pytest.fixture(scope="module")
def lm_setup():
    ds = CharDataset.from_text(default_corpus_text(300_000), 64)
    cfg = TransformerConfig(vocab_size=ds.tokenizer.vocab_size, seq_len=64, num_layers=2, num_heads=4, width=64)
    model = TransformerLM(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 64), jnp.int32))["params"]
    inputs, targets = batch_at(ds.train, seed=0, step=0, batch_size=64, seq_len=64)  # 4,096 tokens
    space = int(ds.tokenizer.encode(" ")[0])
    skewed = np.where(np.random.default_rng(0).random(inputs.shape) < 0.8, space, inputs).astype(np.int32)

    def loss_fn(p, batch, rng):
        del rng
        return cross_entropy_loss(model.apply({"params": p}, batch[0]), batch[1])

    return params, loss_fn, {"characters": (inputs, targets), "skewed": (skewed, targets)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "fp16"])
@pytest.mark.parametrize("batch_name", ["characters", "skewed"])
def test_every_lm_leaf_is_within_the_kernel_error(lm_setup, name, batch_name):
    params, loss_fn, batches = lm_setup
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy=get_policy(name, keep_float32=LM_KEEP_FLOAT32),
                              loss_scale=scale_for(name), rng=jax.random.key(0))
    errors = {k: float(v) for k, v in jax.jit(grad_fidelity, static_argnums=2)(
        state, batches[batch_name], loss_fn).items()}
    kernels = [v for k, v in errors.items() if k.endswith("kernel")]
    bound = max(0.02, 3 * float(np.median(kernels)))
    assert len(errors) == len(jax.tree.leaves(params)) and "wte/embedding" in errors
    assert all(v <= bound for v in errors.values()), sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    assert 0 < float(np.median(kernels)) < (0.01 if name == "bf16" else 0.002)  # rounding happened, and is small


def test_an_overflowed_gradient_reads_inf_with_a_warning_outside_jit():
    """d loss / d w = 3 per element, times 2^15 overflows float16: the errors read inf; outside jit a
    PrecisionWarning names the loss scale (it said nothing); at 2^14, or under jit, no warning."""
    import warnings

    from jaxamp import PrecisionWarning
    from jaxamp.fidelity import fidelity_report

    def loss_fn(params, batch, rng):
        return jnp.sum(params["w"] * batch.astype(params["w"].dtype)).astype(jnp.float32)

    batch = jnp.full((4,), 3.0)

    def state(scale):
        return TrainState.create(params={"w": jnp.ones((4,))}, tx=optax.sgd(0.1), policy="fp16",
                                 loss_scale=DynamicLossScale(scale), rng=jax.random.key(0))

    with pytest.warns(PrecisionWarning, match="not finite at loss scale 32768"):
        assert float(grad_fidelity(state(2.0**15), batch, loss_fn)["w"]) == np.inf
    with pytest.warns(PrecisionWarning, match="fidelity_report: .* not finite"):
        assert float(fidelity_report(state(2.0**15), batch, loss_fn)["rel_err"]["w"]) == np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        assert float(grad_fidelity(state(2.0**14), batch, loss_fn)["w"]) == 0.0
        jitted = jax.jit(grad_fidelity, static_argnames="loss_fn")(state(2.0**15), batch, loss_fn)
        assert float(jitted["w"]) == np.inf


def test_whole_error_is_the_whole_gradients_relative_error():
    """`whole_error` of `fidelity_report`'s `global_rel_err` equals `||g - g_f32|| / ||g_f32||` computed over the
    concatenated leaves of `gradient_pair`; an empty report reads 0, a non-finite leaf inf."""
    from jaxamp.fidelity import fidelity_report, gradient_pair, whole_error

    params = {"a": jax.random.normal(jax.random.key(0), (64, 32)), "b": jnp.zeros((32,)),
              "c": jax.random.normal(jax.random.key(1), (32, 8))}
    batch = jax.random.normal(jax.random.key(2), (128, 64))

    def loss(p, x, rng):
        return jnp.mean(jnp.tanh(x @ p["a"] + p["b"]) @ p["c"])

    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="bf16;autocast",
                              loss_scale=NoOpLossScale(), rng=jax.random.key(3))
    mixed, exact = gradient_pair(state, batch, loss)
    flat = lambda tree: jnp.concatenate([x.ravel() for x in jax.tree.leaves(tree)])  # noqa: E731
    expected = float(jnp.linalg.norm(flat(mixed) - flat(exact)) / jnp.linalg.norm(flat(exact)))
    got = float(whole_error(fidelity_report(state, batch, loss)["global_rel_err"]))
    assert 1e-4 < expected < 0.05 and got == pytest.approx(expected, rel=1e-5), (got, expected)
    assert float(whole_error({})) == 0.0 and float(whole_error({"a": jnp.inf, "b": jnp.float32(0.1)})) == np.inf
    for errs, total in (({"a": 3e19, "b": 4e19}, 5e19), ({"a": 3e-23, "b": 4e-23}, 5e-23)):  # no over/underflow
        assert float(whole_error(errs)) == pytest.approx(total, rel=1e-5)
        assert float(jax.jit(whole_error)(errs)) == pytest.approx(total, rel=1e-5)
