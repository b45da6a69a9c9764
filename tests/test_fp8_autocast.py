"""Stateless FP8 recipes as policies: `fp8-current`, `fp8-block`, `mxfp8` run the weight matmuls of unchanged model
code through `jaxamp.fp8_recipes` under `jaxamp.autocast`, with the output head excluded by name."""

import collections
import inspect
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from asserts import assert_trees_equal

from jaxamp import (
    DynamicLossScale,
    NoOpLossScale,
    PrecisionWarning,
    StaticLossScale,
    TrainState,
    autocast,
    get_policy,
    precision_audit,
    train_step,
)
from jaxamp.fp8_recipes import FP8_EXCLUDE
from jaxamp.precision import fp8_recipe, policy_name

STEP = jax.jit(train_step, static_argnames=("loss_fn", "accum_steps"))


class MLP(nn.Module):
    """Two hidden Dense layers and a `head`, float32 code with no dtype anywhere."""

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(64, name="up")(x))
        x = nn.gelu(nn.Dense(64, name="mid")(x))
        return nn.Dense(4, name="head")(x)


NET = MLP()
PARAMS = NET.init(jax.random.key(0), jnp.ones((2, 32)))["params"]


def loss_fn(params, batch, rng):
    logits = NET.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_batch(i: int, poison: float = 1.0):
    kx, ky = jax.random.split(jax.random.key(10 + i))
    return {"x": jax.random.normal(kx, (64, 32)) * poison, "y": jax.random.randint(ky, (64,), 0, 4)}


def make_state(policy="fp8-current", loss_scale=None):
    return TrainState.create(params=jax.tree.map(jnp.copy, PARAMS), tx=optax.adam(1e-2), policy=policy,
                             loss_scale=loss_scale or NoOpLossScale(), rng=jax.random.key(1))


def precision_warnings(state, batches, loss):
    """`(state, messages)`: `STEP` over `batches`, and the `PrecisionWarning`s it raised (every one recorded)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches:
            state, _ = STEP(state, batch, loss)
    return state, [str(w.message) for w in caught if issubclass(w.category, PrecisionWarning)]


def fp8_rows(report) -> collections.Counter:
    return collections.Counter((r["pass"], r["lhs"], r["rhs"]) for r in report.rows)


@pytest.mark.parametrize("spec, recipe", [("fp8-current", "current"), ("fp8-block", "block"), ("mxfp8", "mxfp8"),
                                          ("fp16;autocast;fp8=current", "current")])
def test_recipe_specs_are_autocast_policies_that_round_trip(spec, recipe):
    policy = get_policy(spec)
    assert fp8_recipe(policy) == recipe and policy.autocast and not policy.fp8  # no FP8 collection: stateless
    assert policy_name(policy) == spec and get_policy(policy_name(policy)) == policy
    assert get_policy(spec, autocast=True) == policy
    custom = get_policy(f"{spec};fp8_exclude=head,up")
    assert custom.fp8_exclude == ("head", "up") and get_policy(policy_name(custom)) == custom
    added = get_policy(f"{spec};fp8_exclude+=^blocks\\.0$")  # named by what was added, not the whole list
    assert policy_name(added) == f"{spec};fp8_exclude+=^blocks\\.0$" and get_policy(policy_name(added)) == added


@pytest.mark.parametrize("spec, message", [
    ("fp8;fp8=current", "two FP8 schemes"),
    ("fp8-current;fp8_exclude=a;fp8_exclude+=b", r"';fp8_exclude' is given twice: give it once"),
    ("bf16;fp8_exclude=head", "add ';fp8=current'"),
    ("bf16;fp8=delayed", "unknown FP8 recipe 'delayed'"),
    ("bf16;fp8=curent-pow2", r"recipe 'curent-pow2' in ';fp8=curent-pow2' \(did you mean 'current-pow2'\?\)"),
    ("fp32;fp8=current", "half-precision dtype"),
])
def test_bad_recipe_specs_are_refused_naming_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        get_policy(spec)


def test_fp8_current_quantizes_every_weight_matmul_but_the_head_and_holds_no_state():
    state = make_state()
    assert jax.tree.structure(state.params) == jax.tree.structure(PARAMS)  # no FP8 collection, no amax history
    report = precision_audit(state, make_batch(0), loss_fn)
    rows = fp8_rows(report)
    assert rows[("forward", "float8_e4m3fn", "float8_e4m3fn")] == 2  # up and mid
    assert rows[("forward", "bfloat16", "bfloat16")] == 1  # the head, excluded by name
    # e5m2 gradients: wgrad of up and mid, dgrad of mid (up's input is the batch: no gradient, no GEMM)
    assert rows[("backward", "float8_e5m2", "float8_e4m3fn")] == 3
    assert report.half_fraction == 1.0 and 0.5 < report.fp8_fraction < 1.0
    assert "% in FP8)" in report.summary()
    everything = precision_audit(make_state("fp8-current;fp8_exclude=^$"), make_batch(0), loss_fn)
    assert fp8_rows(everything)[("forward", "float8_e4m3fn", "float8_e4m3fn")] == 3  # nothing excluded
    block = fp8_rows(precision_audit(make_state("fp8-block"), make_batch(0), loss_fn))
    assert block[("forward", "float8_e4m3fn", "float8_e4m3fn")] == 2 and block[("backward", "float8_e4m3fn",
                                                                                   "float8_e4m3fn")] == 3


class Named(nn.Module):
    """Dense layers whose names hold "head" or "logit" without being the head, and an Equinox-style name."""

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(64, name="multihead_proj")(x))
        x = nn.gelu(nn.Dense(64, name="logit_scale_mlp")(x))
        x = nn.gelu(nn.Dense(64, name="block_0")(x))
        return nn.Dense(4, name="lm_head")(x)


def audit_classifier(net: nn.Module, policy: str):
    """The precision audit of one step of `net` (a linen classifier on `make_batch`'s x: f32[.., 32]) under `policy`."""
    params = net.init(jax.random.key(0), jnp.ones((2, 32)))["params"]

    def loss(p, batch, rng):
        return optax.softmax_cross_entropy_with_integer_labels(net.apply({"params": p}, batch["x"]), batch["y"]).mean()

    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy=policy, loss_scale=NoOpLossScale(),
                              rng=jax.random.key(1))
    return precision_audit(state, make_batch(0), loss)


def test_the_default_exclusions_match_whole_head_names_and_the_audit_says_which_pattern_kept_a_matmul_out():
    def forward(policy):
        report = audit_classifier(Named(), policy)
        return report, {r["scope"]: (r["lhs"], r.get("fp8_excluded_by", "absent"))
                        for r in report.rows if r["pass"] == "forward"}

    report, rows = forward("fp8-current")
    fp8 = ("float8_e4m3fn", None)
    assert rows == {"Named/multihead_proj": fp8, "Named/logit_scale_mlp": fp8, "Named/block_0": fp8,
                    "Named/lm_head": ("bfloat16", r"(^|\.)(lm_)?head$")}
    assert report.fp8_exclude == FP8_EXCLUDE and report.fp8_unused_exclusions == FP8_EXCLUDE[1:]
    assert report.fp8_unused_added == ()  # the defaults need not match: no complaint
    assert report.summary().endswith("; 1 weight matmul kept out of FP8 by fp8_exclude (lm_head)")
    report, rows = forward("fp8-current;fp8_exclude=^(lm_)?head$,^block_0$,^blokc_1$")
    assert rows["Named/block_0"] == ("bfloat16", "^block_0$") and rows["Named/multihead_proj"] == fp8
    assert report.summary().endswith("; 2 weight matmuls kept out of FP8 by fp8_exclude (block_0, "
                                     "lm_head); fp8_exclude patterns that "
                                     "match no matmul: ^blokc_1$")
    report, rows = forward("fp8-current;fp8_exclude+=^block_[0-9]{1,2}$")  # added to the defaults; its comma kept
    assert rows["Named/block_0"] == ("bfloat16", "^block_[0-9]{1,2}$") and rows["Named/lm_head"][0] == "bfloat16"
    assert report.fp8_unused_added == ()
    report, rows = forward("fp8-current;fp8_exclude=^(lm_)?haed$")  # a typo replacing the defaults
    assert rows["Named/lm_head"] == fp8 and report.fp8_unused_added == ("^(lm_)?haed$",)
    assert report.summary().endswith(  # the head found by the softmax it feeds, and the pattern that names it
        "; fp8_exclude patterns that match no matmul: ^(lm_)?haed$; the output head lm_head.kernel at "
        f"test_fp8_autocast.py:{inspect.getsourcelines(Named.__call__)[1] + 5} runs in FP8 into a softmax (a head, "
        "or a router, no pattern names): policy "  # (its result is float32 already: the default float32_results)
        r"'fp8-current;fp8_exclude=^(lm_)?haed$,^lm_head\.kernel$' keeps it out")
    report, rows = forward("bf16;autocast")  # no FP8 recipe: no exclusions to report
    assert report.fp8_exclude == () and all(excluded == "absent" for _, excluded in rows.values())


class Classify(nn.Module):
    """Hugging Face's classification models name their head `classifier` (FlaxViTForImageClassification)."""

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(64, name="classifier_proj")(x))  # not the head: the whole name does not match
        return nn.Dense(4, name="classifier")(x)


def test_a_classifier_head_is_kept_out_of_fp8_and_writes_float32_logits_by_default():
    def forward(policy):
        return {r["scope"]: (r["lhs"], r["out"], r.get("fp8_excluded_by"))
                for r in audit_classifier(Classify(), policy).rows if r["pass"] == "forward"}

    assert forward("fp8-current") == {"Classify/classifier_proj": ("float8_e4m3fn", "float32", None),  # then scaled
                                      "Classify/classifier": ("bfloat16", "float32", r"(^|\.)classifier$")}
    assert forward("bf16;autocast") == {"Classify/classifier_proj": ("bfloat16", "bfloat16", None),
                                        "Classify/classifier": ("bfloat16", "float32", None)}


def test_nnx_layers_are_excluded_by_the_methods_that_call_them_and_a_tied_head_by_default():
    """NNX puts no names on the name stack: the call stack's functions name its layers (`Embed.attend`, the tied
    head, by default; `Block.__call__` by a pattern)."""
    from flax import nnx

    import jaxamp.nnx as jnnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 32, rngs=rngs)

        def __call__(self, x):
            return x + self.down(nnx.gelu(self.up(x)))

    class TiedLM(nnx.Module):
        def __init__(self, rngs):
            self.embed, self.block = nnx.Embed(16, 32, rngs=rngs), Block(rngs)

        def __call__(self, ids):
            return self.embed.attend(self.block(self.embed(ids)))  # f32[batch, seq, vocab]

    def lm_loss(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["ids"]), batch["ids"]).mean()

    batch = {"ids": jax.random.randint(jax.random.key(3), (4, 8), 0, 16)}

    def forward(policy):
        model = TiedLM(nnx.Rngs(0))
        opt = jnnx.Optimizer(model, optax.sgd(0.1), policy=policy, loss_scale=NoOpLossScale())
        rows = jnnx.precision_audit(model, opt, batch, lm_loss).rows
        return [(r["lhs"], r["fp8_excluded_by"]) for r in rows if r["pass"] == "forward"]

    fp8 = ("float8_e4m3fn", None)
    assert forward("fp8-current") == [fp8, fp8, ("bfloat16", r"(^|\.)Embed\.attend$")]  # up, down, the tied head
    # (Python's qualified name of a class defined in this test: "test_....<locals>.Block.__call__")
    assert forward(r"fp8-current;fp8_exclude=\.Block\.__call__$") == [
        ("bfloat16", r"\.Block\.__call__$"), ("bfloat16", r"\.Block\.__call__$"), fp8]


def test_untied_nnx_and_equinox_heads_are_excluded_by_their_param_paths():
    """An untied head called from the model's own `__call__` has no name on the name stack or the call stack
    (`Linear.__call__ < GPT.__call__`): its weight's param path (`head.kernel`, `lm_head.weight`) names it, in the
    forward and in the backward matmuls JAX derives from it."""
    from flax import nnx

    import jaxamp.nnx as jnnx

    eqx = pytest.importorskip("equinox")
    ids = jax.random.randint(jax.random.key(3), (4, 9), 0, 16)

    class GPT(nnx.Module):
        def __init__(self, rngs):
            self.embed, self.mlp = nnx.Embed(16, 32, rngs=rngs), nnx.Linear(32, 32, rngs=rngs)
            self.head = nnx.Linear(32, 16, rngs=rngs)

        def __call__(self, ids):
            return self.head(nnx.gelu(self.mlp(self.embed(ids))))  # f32[batch, seq, vocab]

    def nnx_loss(model, ids):
        return optax.softmax_cross_entropy_with_integer_labels(model(ids[:, :-1]), ids[:, 1:]).mean()

    model = GPT(nnx.Rngs(0))
    opt = jnnx.Optimizer(model, optax.sgd(0.1), policy="fp8-current", loss_scale=NoOpLossScale())
    report = jnnx.precision_audit(model, opt, ids, nnx_loss)
    table = str(report).splitlines()
    assert table[2].endswith("FLOPs  weight       kept out of FP8 by")  # the terminal table: the head's rows
    assert sum(line.endswith(r"(^|\.)(lm_)?head$") for line in table) == 2  # forward; backward x2
    rows = report.rows
    assert [(r["pass"], r["weight"], r["lhs"][:5], r["fp8_excluded_by"]) for r in rows] == [
        ("forward", "mlp.kernel", "float", None), ("forward", "head.kernel", "bfloa", r"(^|\.)(lm_)?head$"),
        ("backward", "head.kernel", "bfloa", r"(^|\.)(lm_)?head$"),
        ("backward", "head.kernel", "bfloa", r"(^|\.)(lm_)?head$"),
        ("backward", "mlp.kernel", "float", None), ("backward", "mlp.kernel", "float", None)]

    opt = jnnx.Optimizer(model, optax.sgd(0.1), policy="fp8-current;fp8_exclude+=^haed$", loss_scale=NoOpLossScale())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jnnx.train_step(model, opt, ids, nnx_loss)
    found = [str(w.message) for w in caught if issubclass(w.category, PrecisionWarning)]
    assert len(found) == 1 and "match no matmul" in found[0] and "jaxamp.nnx.precision_audit(...)" in found[0]

    class EqxGPT(eqx.Module):
        mlp: eqx.nn.Linear
        lm_head: eqx.nn.Linear

        def __call__(self, x):  # f32[width] -> f32[vocab]
            return self.lm_head(jax.nn.gelu(self.mlp(x)))

    net = EqxGPT(eqx.nn.Linear(32, 32, key=jax.random.key(0)), eqx.nn.Linear(32, 16, key=jax.random.key(1)))
    params, static = eqx.partition(net, eqx.is_inexact_array)

    def eqx_loss(p, batch, rng):
        logits = jax.vmap(eqx.combine(p, static))(batch["x"][:, :32])  # f32[batch, vocab]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="fp8-current", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(2))
    forward = [r for r in precision_audit(state, make_batch(0), eqx_loss).rows if r["pass"] == "forward"]
    assert [(r["weight"], r["lhs"], r["fp8_excluded_by"]) for r in forward] == [
        ("mlp.weight", "float8_e4m3fn", None), ("lm_head.weight", "bfloat16", r"(^|\.)(lm_)?head$")]


def test_param_paths_reach_matmuls_through_nested_jit_scan_and_remat_and_patterns_match_them():
    """`fp8_exclude` patterns match a weight's module path and param path: a scanned stack of layers
    (`layers.kernel`, sliced per step) and a remat'd, jitted block's weight (`block.w`)."""

    def f(p, x):  # f32[batch, 64]
        x = jax.checkpoint(jax.jit(lambda w, h: jax.nn.gelu(h @ w)))(p["block"]["w"], x)
        x, _ = jax.lax.scan(lambda h, w: (jax.nn.gelu(h @ w), None), x, p["layers"]["kernel"])  # 3 layers
        return (x @ p["out"].T).sum()

    p = {"block": {"w": jnp.ones((64, 64))}, "layers": {"kernel": jnp.ones((3, 64, 64)) / 64},
         "out": jnp.ones((32, 64))}
    x = jnp.ones((32, 64))
    from jaxamp import autocast
    from jaxamp.audit import audit_jaxpr

    def rows(exclude):
        fn = autocast(f, jnp.bfloat16, fp8="current", fp8_exclude=exclude)
        report = audit_jaxpr(jax.make_jaxpr(jax.grad(fn))(p, x), policy="test", compute_dtype=jnp.bfloat16,
                             fp8_exclude=exclude)
        return [(r["weight"], r["lhs"][:5], r["fp8_excluded_by"]) for r in report.rows if r["pass"] == "forward"]

    assert rows(()) == [("block.w", "float", None), ("layers.kernel", "float", None), ("out", "float", None)]
    assert rows((r"^block$", r"^layers\.kernel$")) == [
        ("block.w", "bfloa", "^block$"), ("layers.kernel", "bfloa", r"^layers\.kernel$"), ("out", "float", None)]

    def g(p, x):  # a cond's branches and a while loop's body see the paths of their operands and consts
        x = jax.lax.cond(x[0, 0] > 0, lambda h: jax.nn.gelu(h @ p["c"]), lambda h: h @ p["c"], x)
        _, x = jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jax.nn.gelu(c[1] @ p["w"])), (0, x))
        return x.sum()

    fn = autocast(g, jnp.bfloat16, fp8="current", fp8_exclude=())
    report = audit_jaxpr(jax.make_jaxpr(fn)({"c": jnp.ones((64, 64)), "w": jnp.ones((64, 64))}, x),
                         policy="test", compute_dtype=jnp.bfloat16, fp8_exclude=())
    assert [r["weight"] for r in report.rows] == ["c", "c", "w"]  # both branches, the loop body


def test_an_nnx_model_passed_whole_is_named_by_its_variables_and_a_forward_only_audit_sees_the_names():
    """`autocast(lambda model, x: ...)(model, x)`: the pytree paths of an NNX model end in `.value`, which the
    names drop; without grad the FP8 matmul sits inside a custom_vjp's program, whose name stack is relative to its
    caller's (the audit prefixes it)."""
    from flax import nnx

    from jaxamp import autocast
    from jaxamp.audit import audit_jaxpr

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.up, self.head = nnx.Linear(32, 32, rngs=rngs), nnx.Linear(32, 32, rngs=rngs)

        def __call__(self, x):
            return self.head(nnx.gelu(self.up(x)))

    forward = autocast(lambda model, x: model(x).sum(), jnp.bfloat16, fp8="current")
    closed = jax.make_jaxpr(forward)(Net(nnx.Rngs(0)), jnp.ones((32, 32)))
    report = audit_jaxpr(closed, policy="fp8-current", compute_dtype=jnp.bfloat16, fp8_exclude=FP8_EXCLUDE)
    assert [(r["weight"], r["lhs"], r["fp8_excluded_by"]) for r in report.rows] == [
        ("up.kernel", "float8_e4m3fn", None), ("head.kernel", "bfloat16", r"(^|\.)(lm_)?head$")]


def test_an_exclusion_that_matches_nothing_warns_once_per_compilation_and_rows_name_their_callers():
    net = Named()
    params = net.init(jax.random.key(0), jnp.ones((2, 32)))["params"]

    def named_loss(p, batch, rng):
        return optax.softmax_cross_entropy_with_integer_labels(net.apply({"params": p}, batch["x"]), batch["y"]).mean()

    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="fp8-current;fp8_exclude+=^blokc_0$",
                              loss_scale=NoOpLossScale(), rng=jax.random.key(1))
    state, found = precision_warnings(state, [make_batch(i) for i in range(3)], named_loss)
    assert len(found) == 1 and "the fp8_exclude patterns ^blokc_0$ match no matmul (a typo?" in found[0], found
    assert "autocast" not in found[0].split("lists every op")[1]  # no float32 advice: nothing fell back
    rows = precision_audit(state, make_batch(0), named_loss).rows
    assert {r["callers"].split(" < ")[0] for r in rows if r["pass"] == "forward"} == {"Dense.__call__"}
    assert all(r["callers"].endswith("named_loss") for r in rows if r["pass"] == "forward")


class ConvNet(nn.Module):
    """A convolution and a `classifier` head (Hugging Face's image models): nothing an FP8 recipe quantizes."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        return nn.Dense(4, name="classifier")(jnp.mean(x, axis=(1, 2)))


@pytest.mark.parametrize("spec", ["fp8-current", "fp8-block"])
def test_an_fp8_policy_that_runs_no_matmul_in_fp8_says_so_and_warns_once(spec):
    net = ConvNet()
    params = net.init(jax.random.key(0), jnp.ones((2, 8, 8, 3)))["params"]

    def conv_loss(p, batch, rng):
        logits = net.apply({"params": p}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def batch(i):
        return {"x": jax.random.normal(jax.random.key(i), (4, 8, 8, 3)), "y": jnp.arange(4) % 4}

    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy=spec, loss_scale=NoOpLossScale(),
                              rng=jax.random.key(1))
    report = precision_audit(state, batch(0), conv_loss)
    assert report.fp8 and report.half_fraction == 1.0 and report.fp8_fraction == 0.0
    assert "(0.0% in FP8); the policy asks for FP8 but no matmul ran in FP8" in report.summary()
    state, found = precision_warnings(state, [batch(i) for i in range(3)], conv_loss)
    assert len(found) == 1 and "asks for FP8 but no matmul ran in FP8 (FP8 covers weight matmuls" in found[0], found
    # the same model under bf16 autocast: no FP8 asked, none reported, no warning
    bf16 = state.replace(policy=get_policy("bf16", autocast=True))
    report = precision_audit(bf16, batch(0), conv_loss)
    assert not report.fp8 and "in FP8" not in report.summary()


def test_equinox_attention_is_not_excluded_by_the_default_head_pattern():
    """Equinox puts its classes on the name stack ("eqx.nn.MultiheadAttention"): a substring "head" matched it."""
    eqx = pytest.importorskip("equinox")

    class ClassifierHead(eqx.Module):  # a head class: its call is excluded by default ("Head.__call__$")
        linear: eqx.nn.Linear

        def __call__(self, x):
            return self.linear(x)

    mha = eqx.nn.MultiheadAttention(num_heads=2, query_size=32, key=jax.random.key(0))
    head = eqx.nn.Linear(32, 4, key=jax.random.key(1))
    cls = ClassifierHead(eqx.nn.Linear(32, 4, key=jax.random.key(3)))
    params, static = eqx.partition((mha, head, cls), eqx.is_inexact_array)

    def eqx_loss(p, batch, rng):
        attn, out, classifier = eqx.combine(p, static)
        x = batch["x"].reshape(8, 8, 32)  # f32[batch, seq, width]
        pooled = jax.vmap(lambda t: attn(t, t, t).mean(0))(x)  # f32[batch, width]
        with jax.named_scope("head"):  # or a scope named "head"
            logits = jax.vmap(out)(pooled) + jax.vmap(classifier)(pooled)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"][:8]).mean()

    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="fp8-current", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(2))
    forward = [r for r in precision_audit(state, make_batch(0), eqx_loss).rows if r["pass"] == "forward"]
    attention = [r for r in forward if "MultiheadAttention" in r["scope"] and "Linear" in r["scope"]]
    assert len(attention) == 4 and all(r["lhs"] == "float8_e4m3fn" for r in attention)  # q, k, v and out in FP8
    assert [r["fp8_excluded_by"] for r in forward if "eqx.nn.Linear" in r["scope"] and "Multihead" not in r[
        "scope"]] == [r"(^|\.)(lm_)?head$", r"(^|\.)(lm_)?head$"]  # both heads, first by the scope
    summary = precision_audit(state.replace(policy=get_policy(r"fp8-current;fp8_exclude=Head\.__call__$")),
                              make_batch(0), eqx_loss).summary()
    assert ("1 weight matmul kept out of FP8 by fp8_exclude (test_equinox_attention_is_not_excluded_by_the_default_"
            "head_pattern.<locals>.ClassifierHead.__call__)") in summary, summary
    # the other head (the tuple's item 1), left in FP8 by that policy, is found by the softmax it feeds
    assert summary.endswith(r"runs in FP8 into a softmax (a head, or a router, no pattern names): policy "
                            r"'fp8-current;fp8_exclude=Head\.__call__$,^1\.weight$' keeps it out")  # float32 already


def test_a_power_of_2_loss_scale_leaves_fp8_current_training_bitwise_unchanged():
    """Current scaling quantizes the scaled output gradient from its own amax: the scale cancels exactly."""
    states = [make_state(loss_scale=StaticLossScale(s)) for s in (1.0, 2.0**10)]
    for i in range(3):
        states = [STEP(s, make_batch(i), loss_fn)[0] for s in states]
    assert_trees_equal(states[0].params, states[1].params)
    assert_trees_equal(states[0].opt_state, states[1].opt_state)


def test_fp8_current_skips_accumulates_and_traces_once_with_no_special_rule():
    traces = []

    def counted(params, batch, rng):
        traces.append(1)
        return loss_fn(params, batch, rng)

    state = make_state(loss_scale=DynamicLossScale(2.0**10, growth_interval=1))
    for i in range(3):  # the scale grows every step: no retrace
        state, metrics = STEP(state, make_batch(i), counted)
        assert bool(metrics["grads_finite"])
    assert len(traces) == 1 and float(state.loss_scale.loss_scale) == 2.0**13
    skipped, metrics = STEP(state, make_batch(3, poison=float("inf")), counted)
    assert not bool(metrics["grads_finite"])
    assert_trees_equal(skipped.params, state.params)  # a skipped step: params bitwise unchanged
    assert_trees_equal(skipped.opt_state, state.opt_state)
    accumulated, metrics = STEP(state, make_batch(4), loss_fn, accum_steps=2)
    assert bool(metrics["grads_finite"]) and int(accumulated.step) == int(state.step) + 1


def final_loss(state, loss, steps: int = 5) -> float:
    """The loss of the last of `steps` steps on `make_batch`'s two batches in turn."""
    for i in range(steps):
        state, metrics = STEP(state, make_batch(i % 2), loss)
    return float(metrics["loss"])


def test_the_fp8_loss_tracks_bf16():
    losses = {spec: final_loss(make_state(spec), loss_fn) for spec in ("bf16;autocast", "fp8-current", "fp8-block")}
    for spec in ("fp8-current", "fp8-block"):
        assert abs(losses[spec] - losses["bf16;autocast"]) < 0.03 * losses["bf16;autocast"], losses


@pytest.mark.slow
def test_fp8_current_on_flax_lm1b_unchanged_quantizes_all_but_head_and_attention_and_tracks_bf16():
    """Flax's lm1b Transformer as published: every Dense matmul FP8, the output head (`logitdense`) and the
    attention's batched matmuls bf16; after 20 steps the loss within 1% of bf16 autocast."""
    from outside_models import TRIALS, SourceUnavailable

    try:
        trial = TRIALS["lm1b"]()
    except SourceUnavailable as err:
        pytest.skip(str(err))
    losses, reports = {}, {}
    for spec in ("bf16;autocast", "fp8-current"):
        state = TrainState.create(params=trial.params, tx=optax.adam(1e-3), policy=spec, loss_scale=NoOpLossScale(),
                                  rng=jax.random.key(0))
        with jax.numpy_dtype_promotion("standard"):  # lm1b is not strict-clean
            reports[spec] = precision_audit(state, trial.make_batch(jax.random.key(0)), trial.loss_fn)
            for i in range(20):
                state, metrics = STEP(state, trial.make_batch(jax.random.key(i % 4)), trial.loss_fn)
        losses[spec] = float(metrics["loss"])
    rows = fp8_rows(reports["fp8-current"])
    layers = 2 * 6  # two blocks: query, key, value, out, MLP in and out
    assert rows[("forward", "float8_e4m3fn", "float8_e4m3fn")] == layers, rows
    assert rows[("forward", "bfloat16", "bfloat16")] == 2 * 2 + 1, rows  # attention scores and values, the head
    assert rows[("backward", "float8_e5m2", "float8_e4m3fn")] == 2 * layers, rows
    assert reports["fp8-current"].half_fraction == 1.0 and not reports["fp8-current"].fallbacks
    assert abs(losses["fp8-current"] - losses["bf16;autocast"]) < 0.01 * losses["bf16;autocast"], losses


def test_the_lm_refuses_an_amax_history_with_a_stateless_recipe_in_one_line():
    from jaxamp.lm.config import ConfigError, TrainConfig, validate

    validate(TrainConfig(precision="fp8-current"))  # the default history is no request
    with pytest.raises(ConfigError, match="--fp8-amax-history is the history of delayed scaling") as err:
        validate(TrainConfig(precision="fp8-current", fp8_amax_history=16))
    assert "\n" not in str(err.value) and "drop --fp8-amax-history" in str(err.value)


def test_the_lm_under_fp8_current_keeps_its_tied_head_and_attention_in_bf16():
    """jaxamp.layers.attend names its matmuls "head" (a scope around a nested einsum jit): excluded by default."""
    from jaxamp.lm.model import TransformerConfig, TransformerLM
    from jaxamp.lm.setup import make_loss_fn, make_policy

    cfg = TransformerConfig(vocab_size=65, seq_len=16, num_layers=2, num_heads=2, width=32, dropout=0.0)
    model = TransformerLM(cfg)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
    state = TrainState.create(params=variables["params"], tx=optax.adam(1e-3), policy=make_policy("fp8-current"),
                              loss_scale=NoOpLossScale(), rng=jax.random.key(1))
    tokens = jax.ShapeDtypeStruct((4, 16), jnp.int32)
    rows = fp8_rows(precision_audit(state, (tokens, tokens), make_loss_fn(model)))
    assert rows[("forward", "float8_e4m3fn", "float8_e4m3fn")] == 2 * 4  # c_attn, c_proj, c_fc, mlp c_proj
    assert rows[("forward", "bfloat16", "bfloat16")] == 2 * 2 + 1  # attention scores and values, the tied head


def test_the_excluded_head_writes_float32_logits_and_an_fp8_head_does_not():
    """Under a stateless recipe the head, kept out of FP8 by `fp8_exclude`, is autocast's float32-result matmul
    (bf16 operands, float32 logits; `;float32_results=` makes them bf16); a head put back into FP8
    (`;fp8_exclude=`) is an FP8 matmul like the rest (whose f8 . f8 products are float32 before their scales)."""
    def forward(spec):
        report = precision_audit(make_state(spec), make_batch(0), loss_fn)
        return {(r["weight"], r["lhs"], r["out"]) for r in report.rows if r["pass"] == "forward"}

    fp8 = {("up.kernel", "float8_e4m3fn", "float32"), ("mid.kernel", "float8_e4m3fn", "float32")}
    assert forward("fp8-current") == fp8 | {("head.kernel", "bfloat16", "float32")}
    assert forward("fp8-current;float32_results=") == fp8 | {("head.kernel", "bfloat16", "bfloat16")}
    assert forward("fp8-current;fp8_exclude=") == fp8 | {("head.kernel", "float8_e4m3fn", "float32")}


class Towers(nn.Module):
    """Two projections and their product: a CLIP-style [batch, batch] similarity of two activations."""

    @nn.compact
    def __call__(self, a, b):
        ea, eb = nn.Dense(16, name="proj_a")(a), nn.Dense(16, name="proj_b")(b)
        return ea @ eb.T  # no batch dimensions, no weight


def test_a_product_of_two_activations_stays_out_of_fp8():
    """FP8 takes weight matmuls, as Transformer Engine's Linear layers: a similarity of two activations (CLIP's
    image x text logits, a dot_general without batch dimensions) kept the compute dtype only where it had batch
    dimensions; now it needs a param operand. A function whose arguments hold no params (weights closed over) keeps
    the shape rule."""
    model = Towers()
    a, b = jax.random.normal(jax.random.key(0), (8, 32)), jax.random.normal(jax.random.key(1), (8, 32))
    params = model.init(jax.random.key(2), a, b)["params"]

    def loss_fn(params, batch, rng):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": params}, *batch),
                                                               jnp.arange(8)).mean()

    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="fp8-current", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(3))
    rows = [r for r in precision_audit(state, (a, b), loss_fn).rows if r["pass"] == "forward"]
    assert sorted((r["weight"], r["lhs"][:6]) for r in rows) == [
        ("", "bfloat"), ("proj_a.kernel", "float8"), ("proj_b.kernel", "float8")], rows
    w = jax.random.normal(jax.random.key(4), (32, 16))
    closed = jax.make_jaxpr(autocast(lambda x: x @ w, jnp.bfloat16, fp8="current"))(a)
    assert "f8_e4m3" in str(closed), closed  # no params argument: every dot without batch dimensions, as before

    def stacked(params, batch, rng):  # a layer's weights sliced from a stack, weight-normalised, LoRA'd
        h = batch[0]
        for i in range(2):
            h = jnp.tanh(h @ params["w"][i])
        v = params["v"] * (params["g"] / jnp.linalg.norm(params["v"], axis=0))
        h = h @ v @ (params["out"] + params["a"] @ params["b"])
        gates = jnp.tanh(batch[0] @ jnp.concatenate([params["c1"], params["c2"]], axis=-1))  # OptimizedLSTMCell's
        mixed = batch[1] @ jnp.concatenate([params["c2"], batch[0][:4].T], axis=-1)  # a param beside an activation
        return jnp.mean(h ** 2) + jnp.mean(gates) + jnp.mean(mixed)

    params = {"w": jnp.ones((2, 32, 32)) * 0.1, "v": jnp.ones((32, 32)), "g": jnp.ones((32,)),
              "out": jnp.ones((32, 8)), "a": jnp.ones((32, 2)), "b": jnp.ones((2, 8)),
              "c1": jnp.ones((32, 4)) * 0.1, "c2": jnp.ones((32, 4))}
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="fp8-current", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(3))
    rows = [r for r in precision_audit(state, (a, b), stacked).rows if r["pass"] == "forward"]
    assert sorted((r["weight"], r["lhs"][:6]) for r in rows) == [
        ("", "bfloat"), ("b", "float8"), ("c1+c2", "float8"), ("out", "float8"), ("v", "float8"), ("w", "float8"),
        ("w", "float8")], rows
    excluded = state.replace(policy=get_policy("fp8-current;fp8_exclude+=^c2$"))  # one of the concatenated params
    rows = [r for r in precision_audit(excluded, (a, b), stacked).rows if r["pass"] == "forward"]
    assert [r["lhs"][:6] for r in rows if r["weight"] == "c1+c2"] == ["bfloat"], rows


def test_a_target_networks_stop_gradient_params_are_still_params():
    """A target network (DQN's, BYOL's) reads the params through `lax.stop_gradient`: its matmuls ran without a
    weight path, so in bf16 rather than FP8 under fp8-current, and its head wrote bf16 logits that no pattern could
    name. The path now passes through stop_gradient: the target's layer is FP8, its head is kept out by the default
    pattern and writes float32."""
    def loss_fn(params, batch, rng):
        target = jax.lax.stop_gradient(params["target"])
        q = jnp.tanh(batch @ params["online"]["w"]) @ params["online"]["head"]
        return jnp.mean((q - jax.nn.log_softmax(jnp.tanh(batch @ target["w"]) @ target["head"])) ** 2)

    keys = jax.random.split(jax.random.key(0), 5)
    params = {net: {"w": jax.random.normal(keys[i], (32, 32)), "head": jax.random.normal(keys[i + 2], (32, 8))}
              for i, net in enumerate(("online", "target"))}
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="fp8-current", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(3))
    rows = precision_audit(state, jax.random.normal(keys[4], (16, 32)), loss_fn).rows
    forward = sorted((r["weight"], r["lhs"], r["out"]) for r in rows if r["pass"] == "forward")
    assert forward == [("online.head", "bfloat16", "float32"), ("online.w", "float8_e4m3fn", "float32"),
                       ("target.head", "bfloat16", "float32"), ("target.w", "float8_e4m3fn", "float32")], forward
    assert {r["weight"] for r in rows if r["pass"] == "backward"} == {"online.head", "online.w"}, rows


def test_an_output_layer_no_softmax_finds_is_named_with_the_policy_that_keeps_it_out_of_fp8():
    """A DQN's Q head (a regression into a Huber loss, no usual name) ran in FP8 with no word from `train_step`
    (a newcomer's loss 0.755 against float32's 0.713 over 20 steps; 0.717 kept out). A weight matmul whose result
    reaches the loss through no other matmul is an output layer: the warning names it (and the target network's
    copy of it, read through stop_gradient) with the policy that keeps them out; the hidden layers, whose results
    feed the next matmul, are not named, and under that policy nothing is."""

    class QNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(32)(x))
            return nn.Dense(4)(x)  # Q-values: f32[batch, actions]

    qnet = QNet()
    online = qnet.init(jax.random.key(0), jnp.ones((1, 8)))["params"]
    params = {"online": online, "target": jax.tree.map(jnp.copy, online)}

    def loss_fn(params, batch, rng):
        q = jnp.take_along_axis(qnet.apply({"params": params["online"]}, batch["obs"]), batch["act"][:, None], 1)
        q_next = qnet.apply({"params": jax.lax.stop_gradient(params["target"])}, batch["next_obs"]).max(axis=1)
        return optax.huber_loss(q[:, 0], jax.lax.stop_gradient(batch["rew"] + 0.99 * q_next)).mean()

    keys = jax.random.split(jax.random.key(1), 3)
    batch = {"obs": jax.random.normal(keys[0], (16, 8)), "next_obs": jax.random.normal(keys[1], (16, 8)),
             "act": jnp.arange(16) % 4, "rew": jax.random.normal(keys[2], (16,))}
    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="fp8-current", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(3), trainable=lambda path, x: path[0].key == "online")
    step = jax.jit(train_step, static_argnames="loss_fn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(state, batch, loss_fn)
    messages = [str(w.message) for w in caught if issubclass(w.category, PrecisionWarning)]
    spec = (r"fp8-current;fp8_exclude+=^online\.Dense_1\.kernel$,^target\.Dense_1\.kernel$;"
            r"float32_results+=^online\.Dense_1\.kernel$,^target\.Dense_1\.kernel$")
    assert len(messages) == 1 and "the output heads online.Dense_1.kernel, target.Dense_1.kernel at " in messages[0]
    assert "feed the loss through no other matmul" in messages[0] and f"policy '{spec}' keeps them out" in messages[0]
    assert "Dense_0" not in messages[0].split("policy")[0]
    fixed = state.replace(policy=get_policy(spec))
    report = precision_audit(fixed, batch, loss_fn)
    forward = {r["weight"]: r["lhs"] for r in report.rows if r["pass"] == "forward"}
    assert forward == {"online.Dense_0.kernel": "float8_e4m3fn", "online.Dense_1.kernel": "bfloat16",
                       "target.Dense_0.kernel": "float8_e4m3fn", "target.Dense_1.kernel": "bfloat16"}, forward
    assert not report.logits_note()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(fixed, batch, loss_fn)
    assert not [w for w in caught if issubclass(w.category, PrecisionWarning)]


class SwitchMoE(nn.Module):
    """A Switch-Transformer MoE layer written in plain einsums (Flaxformer's and MaxText's dense dispatch): a `router`,
    one-hot dispatch and combine tensors, and each expert's MLP as a batched matmul over the experts."""
    experts: int = 4
    capacity: int = 32

    @nn.compact
    def __call__(self, x):  # f32[groups, tokens, d]
        probs = jax.nn.softmax(nn.Dense(self.experts, use_bias=False, name="router")(x), axis=-1)  # [g, s, e]
        mask = jax.nn.one_hot(jnp.argmax(probs, -1), self.experts)  # [g, s, e]
        position = jnp.cumsum(mask, axis=1) * mask - 1.0  # each token's slot in its expert's buffer
        mask = mask * (position < self.capacity).astype(mask.dtype)
        slot = jax.nn.one_hot(jnp.sum(position * mask, -1).astype(jnp.int32), self.capacity)  # [g, s, c]
        dispatch = mask[..., None] * slot[:, :, None, :]  # [g, s, e, c]
        combine = dispatch * jnp.sum(probs * mask, -1)[..., None, None]
        w_in = self.param("w_in", nn.initializers.lecun_normal(), (self.experts, x.shape[-1], 64))
        w_out = self.param("w_out", nn.initializers.lecun_normal(), (self.experts, 64, x.shape[-1]))
        tokens = jnp.einsum("gsec,gsd->egcd", dispatch, x)  # [e, g, c, d]
        h = nn.gelu(jnp.einsum("egcd,edf->egcf", tokens, w_in))  # batched over experts
        out = jnp.einsum("egcf,efd->egcd", h, w_out)
        return x + jnp.einsum("gsec,egcd->gsd", combine, out)


class MoENet(nn.Module):
    @nn.compact
    def __call__(self, x):  # f32[batch, 32]
        h = nn.Dense(32, name="up")(x).reshape(8, -1, 32)  # [groups, tokens, d]
        return nn.Dense(4, name="head")(SwitchMoE(name="moe")(h).reshape(x.shape[0], 32))


def test_an_moes_batched_expert_matmuls_run_in_fp8_and_its_router_does_not():
    """An MoE's experts are a `dot_general` with batch dimensions (the experts) and a param operand: FP8 under
    `fp8-current`, as Transformer Engine's grouped GEMMs and DeepSeek-V3 run them (they kept the compute dtype while
    FP8 needed no batch dimensions: 0.6% of this model's FLOPs in FP8); the router (DeepSeek-V3 keeps its gating out
    of FP8) and the head keep bf16 by default and write float32 logits, and the dispatch and combine einsums (no
    param) keep bf16. The loss tracks bf16's."""
    net = MoENet()
    params = net.init(jax.random.key(0), jnp.ones((64, 32)))["params"]

    def loss(p, batch, rng):
        return optax.softmax_cross_entropy_with_integer_labels(net.apply({"params": p}, batch["x"]), batch["y"]).mean()

    def state_for(spec):
        return TrainState.create(params=jax.tree.map(jnp.copy, params), tx=optax.adam(1e-2), policy=spec,
                                 loss_scale=NoOpLossScale(), rng=jax.random.key(1))

    report = precision_audit(state_for("fp8-current"), make_batch(0), loss)
    kinds = collections.Counter((r["weight"], r["pass"], r["lhs"], r["out"]) for r in report.rows)
    for w in ("moe.w_in", "moe.w_out"):  # the FP8 GEMMs accumulate in float32, scaled after
        assert kinds[(w, "forward", "float8_e4m3fn", "float32")] == 1, kinds
        assert kinds[(w, "backward", "float8_e5m2", "float32")] == 2, kinds  # dgrad and wgrad
    assert kinds[("moe.router.kernel", "forward", "bfloat16", "float32")] == 1, kinds  # excluded, float32 logits
    assert kinds[("head.kernel", "forward", "bfloat16", "float32")] == 1, kinds
    assert {r["lhs"] for r in report.rows if not r["weight"]} == {"bfloat16"}, kinds  # dispatch and combine
    assert 0.85 < report.fp8_fraction < 0.95, report.summary()  # the experts' FLOPs
    assert "kept out of FP8 by fp8_exclude (router, head)" in report.summary(), report.summary()
    assert "softmax" not in report.summary(), report.summary()  # no router left for the audit to warn of
    losses = {spec: final_loss(state_for(spec), loss) for spec in ("bf16;autocast", "fp8-current")}
    assert abs(losses["fp8-current"] - losses["bf16;autocast"]) < 0.03 * losses["bf16;autocast"], losses


def test_learned_queries_and_relative_position_terms_stay_out_of_fp8():
    """Batched matmuls with a param operand that are attention, not experts (they ran in FP8 once batch dims were
    allowed): a learned query broadcast onto the batch (DETR, a Perceiver; a copied param is an activation) against
    the keys, and a per-head relative-position term `"bhld,hmd->bhlm"` (Music Transformer; its batch dim is not the
    leading one on both operands, as an MoE's experts are)."""
    params = {"query": jax.random.normal(jax.random.key(0), (4, 16)) * 0.1,
              "rel": jax.random.normal(jax.random.key(1), (2, 8, 8)) * 0.1,
              "wk": jax.random.normal(jax.random.key(2), (16, 16)) * 0.1}

    def loss(p, batch, rng):
        x = batch["x"]  # f32[batch, 8, 16]
        keys = x @ p["wk"]  # a weight matmul: FP8
        query = jnp.broadcast_to(p["query"], (x.shape[0], 4, 16))
        scores = jnp.einsum("bqd,bkd->bqk", query, keys)  # learned queries x keys
        q = x.reshape(x.shape[0], 8, 2, 8).transpose(0, 2, 1, 3)  # [batch, heads, len, head_dim]
        rel = jnp.einsum("bhld,hmd->bhlm", q, p["rel"])  # per-head relative-position logits
        return jnp.mean(jax.nn.logsumexp(scores, -1)) + jnp.mean(jax.nn.logsumexp(rel, -1))

    state = TrainState.create(params=params, tx=optax.sgd(0.1), policy="fp8-current", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(3))
    rows = precision_audit(state, {"x": jax.random.normal(jax.random.key(4), (2, 8, 16))}, loss).rows
    forward = sorted((r["weight"] or "-", r["lhs"]) for r in rows if r["pass"] == "forward")
    assert forward == [("-", "bfloat16"), ("rel", "bfloat16"), ("wk", "float8_e4m3fn")], forward


def test_no_head_in_fp8_is_claimed_where_the_output_layer_is_a_convolution():
    """A denoiser whose output layer is a convolution (a diffusion UNet's `conv_out`: convolutions keep bf16 under
    the stateless recipes) with Dense layers in FP8: the summary said "an output head without a usual name runs in
    FP8". It now says the audit found none, and how to name one it missed."""
    class Denoiser(nn.Module):
        @nn.compact
        def __call__(self, x):  # f32[batch, 8, 8, 4]
            h = nn.Dense(32)(x)  # FP8 under fp8-current
            return nn.Conv(4, (3, 3), name="conv_out")(jax.nn.silu(h))  # the output layer: bf16

    x = jax.random.normal(jax.random.key(0), (4, 8, 8, 4))
    params = Denoiser().init(jax.random.key(1), x)["params"]

    def mse(p, b, rng):
        return jnp.mean((Denoiser().apply({"params": p}, b["x"]) - b["eps"]) ** 2)

    state = TrainState.create(params=params, tx=optax.adam(1e-3), policy="fp8-current", loss_scale=NoOpLossScale(),
                              rng=jax.random.key(2))
    report = precision_audit(state, {"x": x, "eps": x * 0.5}, mse)
    assert report.fp8_fraction > 0 and not report.half_logits, report.half_logits
    summary = report.summary()
    assert "the audit found no output head in FP8; one it missed, under another name: name it" in summary, summary
    assert "runs in FP8:" not in summary, summary
