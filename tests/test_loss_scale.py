import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp import DynamicLossScale, NoOpLossScale, StaticLossScale, all_finite, finite_leaves

adjust = jax.jit(lambda s, finite: s.adjust(finite))


def run(scale, flags):
    """Steps the scale through `flags`; returns the list of (loss_scale, growth_counter, overflow_counter)."""
    out = []
    for flag in flags:
        scale = adjust(scale, jnp.asarray(flag))
        out.append((float(scale.loss_scale), int(scale.growth_counter), int(scale.overflow_counter)))
    return scale, out


def test_growth_exactly_on_interval_th_finite_step():
    scale, trace = run(DynamicLossScale(4.0, growth_interval=5), [True] * 15)
    assert [t[0] for t in trace] == [4.0] * 4 + [8.0] * 5 + [16.0] * 5 + [32.0]
    assert [t[1] for t in trace] == [1, 2, 3, 4, 0] * 3
    assert scale.loss_scale.dtype == jnp.float32 and scale.growth_counter.dtype == jnp.int32


def test_overflow_resets_growth_counter_and_backs_off():
    _, trace = run(DynamicLossScale(64.0, growth_interval=3), [True, True, False, True, True, True])
    assert [t[0] for t in trace] == [64.0, 64.0, 32.0, 32.0, 32.0, 64.0]
    assert [t[1] for t in trace] == [1, 2, 0, 1, 2, 0]


def test_backoff_factor():
    _, trace = run(DynamicLossScale(1024.0, backoff_factor=0.25), [False, False])
    assert [t[0] for t in trace] == [256.0, 64.0]


def test_hysteresis_needs_consecutive_overflows():
    flags = [False, False, True, False, False, False, False, True, False]
    _, trace = run(DynamicLossScale(1024.0, hysteresis=3), flags)
    # two overflows: no change; a finite step resets the streak; the third consecutive backs off, and each after it
    assert [t[0] for t in trace] == [1024.0, 1024.0, 1024.0, 1024.0, 1024.0, 512.0, 256.0, 256.0, 256.0]
    assert [t[2] for t in trace] == [1, 2, 0, 1, 2, 3, 3, 0, 1]


def test_bounds_floor_and_ceiling():
    _, down = run(DynamicLossScale(8.0, min_loss_scale=2.0), [False] * 5)
    assert [t[0] for t in down] == [4.0, 2.0, 2.0, 2.0, 2.0]
    _, up = run(DynamicLossScale(2.0**23, growth_interval=1, max_loss_scale=2.0**24), [True] * 3)
    assert [t[0] for t in up] == [2.0**24] * 3


def test_never_inf_nan_zero_or_subnormal_under_random_flags():
    tiny = float(np.finfo(np.float32).tiny)
    scale = DynamicLossScale(1.0, growth_interval=1, growth_factor=1e10, backoff_factor=1e-10,
                             min_loss_scale=tiny, max_loss_scale=float(np.finfo(np.float32).max))
    flags = jax.random.bernoulli(jax.random.key(0), 0.5, (5000,))

    def body(s, f):
        s = s.adjust(f)
        return s, s.loss_scale

    _, values = jax.lax.scan(body, scale, flags)
    values = np.asarray(values)
    assert np.all(np.isfinite(values)) and np.all(values >= tiny) and np.all(values > 0)
    assert values.max() == np.finfo(np.float32).max and values.min() == np.float32(tiny)  # both bounds were hit


@pytest.mark.parametrize("kwargs,name", [
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(growth_factor=float("inf")), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(min_loss_scale=4.0, max_loss_scale=2.0, loss_scale=3.0), "min_loss_scale"),
    (dict(min_loss_scale=0.0), "min_loss_scale"),
    (dict(min_loss_scale=1e-45, loss_scale=1.0), "min_loss_scale"),
    (dict(max_loss_scale=float("inf")), "max_loss_scale"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_interval=2.5), "growth_interval"),
    (dict(hysteresis=0), "hysteresis"),
    (dict(loss_scale=float("nan")), "loss_scale"),
    (dict(loss_scale=-1.0), "loss_scale"),
    (dict(loss_scale=0.0), "loss_scale"),
    (dict(loss_scale=2.0**30), "loss_scale"),
    (dict(growth_factor="2"), "growth_factor"),
    (dict(backoff_factor="0.5"), "backoff_factor"),
    (dict(max_loss_scale="1e4"), "max_loss_scale"),
    (dict(loss_scale="3"), "loss_scale"),
])
def test_invalid_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DynamicLossScale(**kwargs)


def test_static_loss_scale_rejects_bad_values():
    for bad in (0.0, -2.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="loss_scale"):
            StaticLossScale(bad)


def _fields(s):
    return (float(s.loss_scale), int(s.growth_counter), int(s.overflow_counter), s.config())


def test_every_field_survives_jit_tree_map_and_eval_shape():
    s = DynamicLossScale(2.0**10, growth_interval=7, growth_factor=3.0, backoff_factor=0.25,
                         min_loss_scale=2.0**-6, max_loss_scale=2.0**20, hysteresis=2)
    s = s.adjust(jnp.array(True)).adjust(jnp.array(False))  # non-zero counters
    expected = _fields(s)
    assert expected[1:3] == (0, 1)
    assert _fields(jax.jit(lambda x: x)(s)) == expected
    assert _fields(jax.tree.map(lambda x: x, s)) == expected
    assert jax.tree.map(lambda x: None, s).config() == s.config()
    shapes = jax.eval_shape(lambda x: x, s)
    assert shapes.config() == s.config()
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(shapes)] == [((), jnp.float32), ((), jnp.int32),
                                                                      ((), jnp.int32)]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(s)[0]]
    assert paths == [".loss_scale", ".growth_counter", ".overflow_counter"]


def test_scale_and_unscale():
    tree = {"a": jnp.array([1.0, -2.0], jnp.float16), "b": jnp.array(3.0, jnp.float32)}
    for ls in (StaticLossScale(1024.0), DynamicLossScale(1024.0)):
        scaled = ls.scale(tree)
        assert scaled["a"].dtype == jnp.float16
        np.testing.assert_array_equal(scaled["a"], np.array([1024.0, -2048.0], np.float16))
        back = ls.unscale(scaled)
        assert back["a"].dtype == jnp.float32 and back["b"].dtype == jnp.float32
        np.testing.assert_array_equal(back["a"], np.array([1.0, -2.0], np.float32))
    noop = NoOpLossScale()
    assert noop.scale(tree) is tree and float(noop.loss_scale) == 1.0 and noop.loss_scale.dtype == jnp.float32
    assert noop.unscale(tree)["a"].dtype == jnp.float32
    assert noop.adjust(jnp.array(False)) is noop and jax.tree.leaves(noop) == []
    static = StaticLossScale(8.0)
    assert float(static.adjust(jnp.array(False)).loss_scale) == 8.0


def test_all_finite():
    ok = {"a": jnp.ones((3,), jnp.float16), "i": jnp.ones((2,), jnp.int32)}
    assert bool(all_finite(ok))
    assert bool(all_finite({}))
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        tree = {**ok, "b": jnp.array([0.0, bad], jnp.float32)}
        assert not bool(all_finite(tree))
        assert not bool(jax.jit(all_finite)(tree))
    flags = finite_leaves({**ok, "b": jnp.array([jnp.inf], jnp.float32)})
    assert {k: bool(v) for k, v in flags.items()} == {"a": True, "i": True, "b": False}


def test_adjust_refuses_a_vector_of_flags():
    with pytest.raises(ValueError, match=r"grads_finite must be a bool\[\] scalar .* got shape \(2,\)"):
        DynamicLossScale(2.0**15).adjust(jnp.array([True, False]))
