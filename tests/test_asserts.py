"""The tree-comparison helpers of tests/asserts.py fail where a zip over the leaves would pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from asserts import assert_same_structure, assert_trees_close, assert_trees_equal, leaf_pairs


def tree():
    return {"dense": {"kernel": jnp.arange(6, dtype=jnp.float32).reshape(2, 3), "bias": jnp.zeros(3, jnp.float32)},
            "step": jnp.array(3, jnp.int32), "rng": jax.random.key(0)}


def zip_compare(a, b):
    """The comparison the helpers replace: it passes on every case below but the one-ulp change."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = (jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v for v in (x, y))
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_equal_trees_pass():
    assert_same_structure(tree(), tree())
    assert_trees_equal(tree(), tree())
    assert_trees_equal(tree(), tree(), bitwise=False)
    assert_trees_close(tree(), tree(), rtol=0, atol=0)
    assert [p for p, _, _ in leaf_pairs(tree(), tree())] == ["['dense']['bias']", "['dense']['kernel']", "['rng']",
                                                            "['step']"]


def test_a_lost_leaf_fails_naming_it():
    lost = tree()
    del lost["step"]
    zip_compare(tree(), lost)  # rng against rng: the old loop never sees the missing step
    for check in (assert_same_structure, assert_trees_equal, lambda a, b: assert_trees_close(a, b, rtol=1)):
        with pytest.raises(AssertionError, match=r"\['step'\] only in the first tree"):
            check(tree(), lost)
        with pytest.raises(AssertionError, match=r"\['step'\] only in the second tree"):
            check(lost, tree())


def test_a_lost_subtree_at_the_end_fails():
    lost = tree()
    del lost["step"], lost["rng"]
    zip_compare(tree(), lost)
    only = r"4 against 2 leaves\): \['rng'\] only in the first tree \(2 such: \['rng'\], \['step'\]\)"
    with pytest.raises(AssertionError, match=only):
        assert_trees_equal(tree(), lost)


def test_a_renamed_key_fails_naming_it():
    renamed = tree()
    renamed["dense"]["weight"] = renamed["dense"].pop("kernel")
    renamed = {"dense": dict(sorted(renamed["dense"].items())), **{k: renamed[k] for k in ("rng", "step")}}
    zip_compare(tree(), renamed)  # the same leaves in the same order
    with pytest.raises(AssertionError, match=r"\['dense'\]\['kernel'\] only in the first tree.*"
                                             r"\['dense'\]\['weight'\] only in the second tree"):
        assert_trees_equal(tree(), renamed)


def test_another_container_with_the_same_paths_fails():
    a = {"x": jnp.zeros(2), "y": jnp.ones(2)}
    b = jax.tree_util.tree_unflatten(jax.tree.structure(a), jax.tree.leaves(a))
    assert_trees_equal(a, b)
    from flax.core import FrozenDict

    with pytest.raises(AssertionError, match="differ in structure: dict against FrozenDict at node"):
        assert_trees_equal(a, FrozenDict(a))
    with pytest.raises(AssertionError, match=r"differ in structure: tuple against list at node \[0\]"):
        assert_trees_equal({"x": (jnp.zeros(1),)}, {"x": [jnp.zeros(1)]})  # both paths ['x'][0]
    with pytest.raises(AssertionError, match="differ in structure: NoneType against dict at node"):
        assert_trees_equal({"x": jnp.zeros(1), "y": None}, {"x": jnp.zeros(1), "y": {}})  # no leaf either side
    assert_trees_equal(a, FrozenDict(a), check_node_types=False)  # asked for: the paths alone
    with pytest.raises(AssertionError, match=r"\['z'\] only in the second tree"):
        assert_trees_equal(a, FrozenDict({**a, "z": jnp.zeros(1)}), check_node_types=False)


def test_train_states_built_alike_compare_equal():
    """A TrainState's static fields (its optax chain, a new function object each build) are not part of the check."""
    import optax

    from jaxamp import NoOpLossScale, TrainState

    make = lambda: TrainState.create(params={"w": jnp.ones(2)}, tx=optax.adam(1e-3), policy="fp32",
                                     loss_scale=NoOpLossScale(), rng=jax.random.key(0))
    assert jax.tree.structure(make()) != jax.tree.structure(make())
    assert_trees_equal(make(), make())
    with pytest.raises(AssertionError, match=r"\.params\['b'\] only in the second tree"):
        assert_trees_equal(make(), make().replace(params={"w": jnp.ones(2), "b": jnp.ones(2)}))


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_a_shape_or_dtype_change_fails(change):
    changed = tree()
    kernel = changed["dense"]["kernel"]
    changed["dense"]["kernel"] = kernel.reshape(3, 2) if change == "shape" else jax.lax.bitcast_convert_type(
        kernel, jnp.int32)
    zip_compare(tree(), changed)  # the same bytes
    message = "float32\\[3, 2\\]" if change == "shape" else "against int32\\[2, 3\\]"
    for check in (assert_same_structure, assert_trees_equal, lambda a, b: assert_trees_close(a, b, rtol=1)):
        with pytest.raises(AssertionError, match=r"leaf \['dense'\]\['kernel'\]: float32\[2, 3\] .*" + message):
            check(tree(), changed)


def test_a_one_ulp_change_fails_bitwise_and_passes_close():
    changed = tree()
    kernel = np.asarray(changed["dense"]["kernel"]).copy()
    kernel[1, 2] = np.nextafter(kernel[1, 2], np.float32(np.inf))
    changed["dense"]["kernel"] = jnp.asarray(kernel)
    with pytest.raises(AssertionError, match=r"\['dense'\]\['kernel'\] differs bitwise at index \(1, 2\)"):
        assert_trees_equal(tree(), changed)
    with pytest.raises(AssertionError, match=r"\['dense'\]\['kernel'\]"):
        assert_trees_equal(tree(), changed, bitwise=False)
    assert_trees_close(tree(), changed, rtol=1e-6)
    with pytest.raises(AssertionError, match=r"\['dense'\]\['kernel'\]"):
        assert_trees_close(tree(), changed, rtol=1e-8)


def test_bitwise_tells_signed_zeros_apart_and_matches_nans():
    assert_trees_equal({"x": jnp.array([np.nan, 1.0])}, {"x": jnp.array([np.nan, 1.0])})
    assert_trees_equal({"x": jnp.array(0.0)}, {"x": jnp.array(-0.0)}, bitwise=False)
    with pytest.raises(AssertionError, match=r"\['x'\] differs bitwise at index \(\)"):
        assert_trees_equal({"x": jnp.array(0.0)}, {"x": jnp.array(-0.0)})


def test_prng_keys_compare_by_their_data():
    assert_trees_equal(jax.random.key(1), jax.random.key(1))
    with pytest.raises(AssertionError, match="differs bitwise"):
        assert_trees_equal(jax.random.key(1), jax.random.key(2))
