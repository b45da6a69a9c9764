"""Tree comparisons for the tests: the structure first, then the values.

A loop such as `for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)): ...` passes when one side lost a leaf (zip
stops at the shorter list) or a key was renamed; these helpers fail instead, naming the first differing path.

    assert_same_structure(a, b)              paths, tree structure, leaf count, then each leaf's shape and dtype
    assert_trees_equal(a, b)                 the above, then each leaf's bytes (bitwise=False: np.array_equal)
    assert_trees_close(a, b, rtol=, atol=)   the above, then np.testing.assert_allclose per leaf
    leaf_pairs(a, b)                         the structure checked, [(path, a_leaf, b_leaf)] as numpy arrays, for a
                                             comparison of its own (e.g. a tolerance that depends on the leaf)

Leaves are compared as host numpy arrays; PRNG key arrays as their key data. `check_node_types=False` (every helper)
compares the leaf paths but not the containers' types: an `nnx.State` against the plain dict of the same variables.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["assert_same_structure", "assert_trees_close", "assert_trees_equal", "leaf_pairs"]


def _host(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _first_difference(pa: list[str], pb: list[str]) -> str:
    """Where the two path lists part: the first path on either side that the other lacks, or the first reordering."""
    sa, sb = set(pa), set(pb)
    only_a, only_b = [p for p in pa if p not in sb], [p for p in pb if p not in sa]
    parts = []
    if only_a:
        parts.append(f"{only_a[0]} only in the first tree ({len(only_a)} such: {', '.join(only_a[:5])})")
    if only_b:
        parts.append(f"{only_b[0]} only in the second tree ({len(only_b)} such: {', '.join(only_b[:5])})")
    if not parts:
        i = next(i for i, (x, y) in enumerate(zip(pa, pb)) if x != y)
        parts.append(f"the leaves are in another order from leaf {i}: {pa[i]} against {pb[i]}")
    return "; ".join(parts)


def _node_type_difference(ta, tb, where: str = "") -> str | None:
    """The first node (as child indices from the root) whose container type or child count differs, or None. A node's
    static data (a TrainState's tx and policy; a dict's keys, which the paths show) is not compared."""
    da, db = ta.node_data(), tb.node_data()
    if (da is None) != (db is None) or (da is not None and da[0] is not db[0]):
        name = lambda d: "a leaf" if d is None else d[0].__name__
        return f"{name(da)} against {name(db)} at node {where or '(root)'}"
    ca, cb = ([], []) if da is None else (ta.children(), tb.children())
    if len(ca) != len(cb):
        return f"{len(ca)} against {len(cb)} children of the {da[0].__name__} at node {where or '(root)'}"
    for i, (x, y) in enumerate(zip(ca, cb)):
        found = _node_type_difference(x, y, f"{where}[{i}]")
        if found:
            return found
    return None


def leaf_pairs(a: Any, b: Any, *, check_node_types: bool = True) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Checks that `a` and `b` have the same paths, tree structure, leaf count, and per leaf shape and dtype; returns
    `[(path, a_leaf, b_leaf), ...]` with the leaves as host numpy arrays. Fails naming the first differing path.
    The structure is the tree's containers (types and children, empty ones included) with their leaves' paths, not the
    containers' static data: two TrainStates built alike (their own optax chains) compare equal.
    `check_node_types=False`: the same paths suffice (the containers may be of other types)."""
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    pa = [jax.tree_util.keystr(p) for p, _ in la]
    pb = [jax.tree_util.keystr(p) for p, _ in lb]
    if pa != pb:
        raise AssertionError(f"trees differ in structure ({len(pa)} against {len(pb)} leaves): "
                             f"{_first_difference(pa, pb)}")
    if check_node_types and ta != tb:
        found = _node_type_difference(ta, tb)
        if found:
            raise AssertionError(f"trees have the same leaf paths but differ in structure: {found}")
    pairs = []
    for path, (_, x), (_, y) in zip(pa, la, lb):
        x, y = _host(x), _host(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise AssertionError(f"leaf {path or '(root)'}: {x.dtype}{list(x.shape)} against {y.dtype}{list(y.shape)}")
        pairs.append((path, x, y))
    return pairs


def assert_same_structure(a: Any, b: Any, *, check_node_types: bool = True) -> None:
    """Same paths, tree structure, leaf count, and per leaf shape and dtype; the values are not compared."""
    leaf_pairs(a, b, check_node_types=check_node_types)


def assert_trees_equal(a: Any, b: Any, *, bitwise: bool = True, check_node_types: bool = True) -> None:
    """The structure (as `leaf_pairs`), then every leaf equal: byte for byte (bitwise, the default: -0.0 differs from
    0.0, a NaN equals the same NaN), or `np.testing.assert_array_equal` (bitwise=False)."""
    for path, x, y in leaf_pairs(a, b, check_node_types=check_node_types):
        if bitwise:
            bx = np.frombuffer(np.ascontiguousarray(x).tobytes(), np.uint8)
            by = np.frombuffer(np.ascontiguousarray(y).tobytes(), np.uint8)
            if not np.array_equal(bx, by):
                flat = int(np.flatnonzero(bx != by)[0]) // max(x.itemsize, 1)
                index = np.unravel_index(flat, x.shape) if x.shape else ()
                raise AssertionError(f"leaf {path or '(root)'} differs bitwise at index {tuple(map(int, index))}: "
                                     f"{x.reshape(-1)[flat]!r} against {y.reshape(-1)[flat]!r}")
        else:
            np.testing.assert_array_equal(x, y, err_msg=f"leaf {path or '(root)'}")


def assert_trees_close(a: Any, b: Any, *, rtol: float = 1e-7, atol: float = 0.0,
                       check_node_types: bool = True) -> None:
    """The structure (as `leaf_pairs`), then `np.testing.assert_allclose(a_leaf, b_leaf, rtol, atol)` per leaf."""
    for path, x, y in leaf_pairs(a, b, check_node_types=check_node_types):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=f"leaf {path or '(root)'}")
