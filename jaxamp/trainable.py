"""Which params train: `TrainState.create`'s `trainable` rule as one bool per params leaf, and the split of a tree
into its trainable and frozen leaves (frozen leaves are not differentiated, hold no optimizer state and come back
bitwise unchanged).
"""

from __future__ import annotations

from typing import Any

import flax.core
import jax
import numpy as np

from jaxamp.fp8_collection import FP8_COLLECTION

PyTree = Any

__all__ = ["merge_frozen", "split_frozen", "trainable_mask"]


def trainable_mask(trainable, params: PyTree) -> tuple[bool, ...] | None:
    """`TrainState.create`'s `trainable` as one bool per params leaf (None when every leaf trains).

    Raises:
      ValueError: a bool tree that is not a prefix of `params`, a non-boolean value, or every leaf frozen.
    """
    if trainable is None:
        return None
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    if callable(trainable):
        values = [trainable(path, leaf) for path, leaf in flat]
    else:
        # As plain dicts: a dict prefix fits FrozenDict params and vice versa (both flatten in sorted key order).
        plain, rule = _unfrozen(params), _unfrozen(trainable)
        try:
            values = jax.tree.structure(plain).flatten_up_to(
                jax.tree.map(lambda t, sub: jax.tree.map(lambda _: t, sub), rule, plain))
        except (ValueError, TypeError) as err:
            where = _prefix_mismatch(rule, plain) or " ".join(line.strip() for line in str(err).splitlines()[:2])
            raise ValueError(f"trainable must be a tree of bools shaped like params or a prefix of it, or a "
                             f"callable (path, leaf) -> bool; it does not fit params: {where}") from None
    bad = [(path, v) for (path, _), v in zip(flat, values) if not isinstance(v, (bool, np.bool_))]
    if bad:
        path, v = bad[0]
        raise ValueError(f"trainable must give a bool per params leaf, got {v!r} for params"
                         f"{jax.tree_util.keystr(path)}")
    mask = tuple(bool(v) for v in values)
    if mask and not any(mask):
        raise ValueError("trainable freezes every params leaf: nothing would train; mark at least one leaf True")
    return None if all(mask) else mask


def _unfrozen(tree):
    """`tree` with every FrozenDict, at any depth (inside lists and tuples too), a plain dict."""
    if isinstance(tree, (dict, flax.core.FrozenDict)):
        return {k: _unfrozen(v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
        return type(tree)(*(_unfrozen(v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_unfrozen(v) for v in tree)
    return tree


def _prefix_mismatch(tree, params, path: str = "") -> str | None:
    """Where a `trainable` tree first stops fitting `params` (dicts and lists), in one line; None if found nowhere."""
    where = path or "the top"
    if tree is None:
        return None if params is None else f"at {where} trainable has None; write True or False"
    if isinstance(tree, dict):
        if not isinstance(params, dict):
            return f"at {path or 'the top'} trainable has a dict where params have {type(params).__name__}"
        for key in tree:
            if key == FP8_COLLECTION and not path:
                return (f"trainable names the FP8 collection {FP8_COLLECTION!r}: it is not a trainable param (its "
                        "scales and histories always update); leave it out of trainable")
            if key not in params:
                hint = (f"; NNX lists (nnx.List, nn.Sequential layers) are keyed by int: write {int(key)}"
                        if isinstance(key, str) and key.isdigit() and int(key) in params else "")
                return f"at {path or 'the top'} trainable has key {key!r}, params have {list(params)[:8]}{hint}"
        missing = [key for key in params if key not in tree]
        if missing:
            return (f"at {path or 'the top'} trainable lacks the keys {missing[:8]} of params (a dict prefix names "
                    "every key at its level; True or False covers a whole subtree)")
        for key in tree:
            found = _prefix_mismatch(tree[key], params[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(tree, (list, tuple)):
        keys = list(params) if isinstance(params, dict) else None
        if keys is not None and keys == list(range(len(keys))):
            return (f"at {where} trainable has a {type(tree).__name__} where params have a dict keyed "
                    f"{keys[:8]}; write {{0: ..., 1: ...}}")
        if type(params) is not type(tree):
            return f"at {where} trainable has a {type(tree).__name__} where params have {type(params).__name__}"
        if len(tree) != len(params):
            return f"at {where} trainable has {len(tree)} entries where params have {len(params)}"
        for i, (t, p) in enumerate(zip(tree, params)):
            found = _prefix_mismatch(t, p, f"{path}[{i}]")
            if found:
                return found
    return None


def split_frozen(params: PyTree, mask: tuple[bool, ...] | None) -> tuple[PyTree, PyTree]:
    """`(trainable, frozen)`: two trees shaped like `params`, holding None where the other holds the leaf."""
    if mask is None:
        return params, None
    leaves, treedef = jax.tree.flatten(params)
    if len(leaves) != len(mask):
        raise ValueError(f"the trainable mask has {len(mask)} entries but params have {len(leaves)} leaves")
    return (treedef.unflatten([x if m else None for x, m in zip(leaves, mask)]),
            treedef.unflatten([None if m else x for x, m in zip(leaves, mask)]))


def merge_frozen(trainable: PyTree, frozen: PyTree) -> PyTree:
    """The inverse of `split_frozen`: every leaf from whichever tree holds it."""
    if frozen is None:
        return trainable
    return jax.tree.map(lambda a, b: b if a is None else a, trainable, frozen, is_leaf=lambda x: x is None)
