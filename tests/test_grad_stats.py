import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp.grad_stats import nonfinite_paths, underflow_stats, worst_leaves


def test_underflow_stats_on_constructed_gradient():
    a = jnp.array([0.0, 1.0, 0.0, 2.0, 0.5, 0.0, 0.0, 0.25], jnp.float16)  # 4 of 8 zeros, max |g| = 2
    b = jnp.array([[1e-3, 0.0], [4.0, 1.0]], jnp.float16)  # 1 of 4 zeros, max |g| = 4
    stats = jax.jit(underflow_stats)({"a": a, "b": b})
    np.testing.assert_allclose(float(stats["zero_fraction"]), 5 / 12, rtol=1e-6)
    np.testing.assert_allclose(float(stats["leaf_zero_fraction"]["a"]), 0.5)
    np.testing.assert_allclose(float(stats["leaf_zero_fraction"]["b"]), 0.25)
    np.testing.assert_allclose(float(stats["leaf_headroom_log2"]["a"]), np.log2(65504 / 2), rtol=1e-6)
    np.testing.assert_allclose(float(stats["headroom_log2"]), np.log2(65504 / 4), rtol=1e-6)
    inf = underflow_stats({"x": jnp.array([jnp.inf], jnp.float16)})
    assert float(inf["headroom_log2"]) == -np.inf


def test_underflow_stats_against_another_dtype():
    """`dtype=`: float32 gradients (autocast's) measured against float16's range."""
    g = {"w": jnp.array([0.0, 4.0, -1.0], jnp.float32)}
    np.testing.assert_allclose(float(underflow_stats(g)["headroom_log2"]), np.log2(3.4028235e38 / 4), rtol=1e-6)
    np.testing.assert_allclose(float(underflow_stats(g, dtype=jnp.float16)["headroom_log2"]), np.log2(65504 / 4),
                               rtol=1e-6)
    assert float(underflow_stats(g, dtype=jnp.float16)["zero_fraction"]) == float(underflow_stats(g)["zero_fraction"])


def test_underflow_stats_edge_trees():
    stats = underflow_stats({"empty": jnp.zeros((0, 4), jnp.float16), "b": jnp.array([0.0, 1.0], jnp.float16)})
    assert float(stats["zero_fraction"]) == 0.5  # the zero-size leaf adds no elements
    assert float(stats["leaf_zero_fraction"]["empty"]) == 0.0 and float(stats["leaf_headroom_log2"]["empty"]) == np.inf
    np.testing.assert_allclose(float(stats["headroom_log2"]), np.log2(65504), rtol=1e-6)
    with pytest.raises(ValueError, match="no array leaves"):
        underflow_stats({"a": {}, "b": None})


def test_nonfinite_paths_and_worst_leaves():
    flags = {"l1": {"w": np.bool_(True), "b": np.bool_(False)}, "l2": [np.bool_(False)]}
    assert nonfinite_paths(flags) == ["l1/b", "l2/0"]
    values = {"a": 0.1, "b": 0.9, "c": 0.5}
    assert worst_leaves(values, 2) == [("b", 0.9), ("c", 0.5)]
    assert worst_leaves(values, 1, largest=False) == [("a", 0.1)]
    with_nan = {**values, "n": float("nan")}  # a NaN headroom (a NaN gradient) is the worst either way
    assert [p for p, _ in worst_leaves(with_nan, 2)] == ["n", "b"]
    assert [p for p, _ in worst_leaves(with_nan, 2, largest=False)] == ["n", "a"]
