"""The integrity record of a checkpoint step: per-leaf sha256 digests, dtypes and shapes, the loss scale's type
and hyperparameters, the policy name, the pytree structure and digests of the config and metrics.

`jaxamp.checkpoint.Checkpointer` writes it beside each step and checks restores against it (`mismatch`: saved
settings against this run's; `verify`: restored arrays against their digests); the design (whole-array
digests in a single-process run, per-shard digests keyed by global index across processes, a sealed record) is
described in `jaxamp.checkpoint`'s module docstring. Pure functions of their inputs, except `allgather_json`, which
gathers across the processes of a multi-process run.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxamp.loss_scale import describe
from jaxamp.precision import policy_name
from jaxamp.state import TrainState

__all__ = ["FORMAT", "NEW_IN_FORMAT_3", "READABLE_FORMATS", "allgather_json", "config_digest", "digests", "host_array",
           "index_str", "integrity_record", "leaf_dtype", "legacy_target", "loss_scale_record", "mismatch",
           "parse_index", "seal_intact", "sealed", "sha256", "structure_string", "verify", "with_counter"]

# 2 adds record_sha256, the record's own digest; 3: the TrainState holds consecutive_skips (and model_state). Records
# of formats 1 and 2 are still read: their states restore with consecutive_skips 0 (see `legacy_target`).
FORMAT = 3
READABLE_FORMATS = (1, 2, 3)
NEW_IN_FORMAT_3 = ".consecutive_skips"  # the leaf a state of format 1 or 2 lacks
_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+")

def host_array(x) -> np.ndarray:
    """Returns a C-contiguous host copy of a fully addressable array (typed PRNG keys as their raw data)."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.ascontiguousarray(np.asarray(jax.device_get(x)))


def digests(arrays: list) -> list[str]:
    """sha256 of each fully addressable array, copied to the host one leaf at a time in a few threads.

    Peak extra host memory is a few leaves, not the whole state; hashlib releases the GIL while hashing.
    """
    with concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda x: sha256(host_array(x)), arrays))


def sha256(arr: np.ndarray) -> str:
    """sha256 hex digest of the raw bytes of a C-contiguous host array (native byte order)."""
    return hashlib.sha256(arr.reshape(-1).view(np.uint8)).hexdigest()


def index_str(index: tuple, shape: tuple) -> str:
    """A shard's global index as `"start:stop,..."` (one entry per dimension; `""` for a scalar)."""
    return ",".join("{}:{}".format(*s.indices(n)[:2]) for s, n in zip(index, shape))


def parse_index(text: str) -> tuple:
    if not text:
        return ()
    return tuple(slice(int(a), int(b)) for a, b in (part.split(":") for part in text.split(",")))


def leaf_dtype(x) -> str:
    dtype = x.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return str(dtype)
    return np.dtype(dtype).name


def structure_string(tree) -> str:
    """`str(jax.tree.structure(tree))` without object addresses (`<function f at 0x...>` differs per process)."""
    return _ADDRESS_RE.sub("", str(jax.tree.structure(tree)))


def loss_scale_record(loss_scale) -> dict:
    """What the record holds of the loss scale (`jaxamp.loss_scale.describe`)."""
    return describe(loss_scale)


def allgather_json(obj) -> list:
    """Every process's `obj` (JSON-able), in process order. A no-op list of one in a single-process run."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [json.loads(bytes(rows[i, : int(sizes[i])])) for i in range(len(sizes))]


def config_digest(config) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def integrity_record(state: TrainState, config: dict, checksums: bool, metrics: list | None = None) -> dict:
    """Builds the JSON integrity record of `state` (see the module docstring). Copies every leaf to the host."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    leaves: dict[str, dict] = {}
    whole: list[tuple[str, Any]] = []
    sharded: list[tuple[str, Any]] = []
    for path, x in flat:
        key = jax.tree_util.keystr(path)
        x = x if hasattr(x, "dtype") else np.asarray(x)
        leaves[key] = {"dtype": leaf_dtype(x), "shape": list(np.shape(x))}
        if not checksums:
            continue
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            sharded.append((key, x))
        else:
            whole.append((key, x))
    if whole:
        for (key, _), digest in zip(whole, digests([x for _, x in whole])):
            leaves[key]["sha256"] = digest
    if sharded:
        mine: dict[str, dict[str, str]] = {}
        for key, x in sharded:
            for shard in x.addressable_shards:
                if shard.replica_id == 0:
                    mine.setdefault(key, {})[index_str(shard.index, x.shape)] = sha256(host_array(shard.data))
        for part in allgather_json(mine):
            for key, shards in part.items():
                leaves[key].setdefault("shards", {}).update(shards)
    ls = state.loss_scale
    return {
        "format": FORMAT,
        "step": int(jax.device_get(state.step)),
        "leaves": leaves,
        "loss_scale": loss_scale_record(ls),
        "policy": policy_name(state.policy),
        "structure": structure_string(state),
        "config_sha256": config_digest(config),
        **({} if metrics is None else {"metrics_sha256": config_digest(metrics)}),
    }


def sealed(record: dict) -> dict:
    """The record with `record_sha256`, the digest of everything else in it: a damaged record reads as unusable,
    never as a settings mismatch."""
    return {**record, "record_sha256": config_digest(record)}


def seal_intact(record: dict) -> bool:
    if record.get("format") == 1:
        return True  # written before records were sealed
    rest = {k: v for k, v in record.items() if k != "record_sha256"}
    return record.get("record_sha256") == config_digest(rest)


# -------------------------------------------------------------------------------------------------------------------
# Checks of a restore against the record.


def _json_normal(value):
    """`value` as it comes back from a JSON round trip (tuples -> lists, int keys -> str)."""
    return json.loads(json.dumps(value))


def _fmt(value) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value)


def _first_difference(a: str, b: str, context: int = 60) -> tuple[str, str]:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lo = max(0, i - context)
    return f"...{a[lo:i + context]}...", f"...{b[lo:i + context]}..."


def mismatch(n: int, directory, config: dict, record: dict, target, expected_config: dict | None,
             match_keys) -> str | None:
    """The first way a saved step differs from this run, as one line naming the field and both values, or None.

    Compared: the `match_keys` of `config` (the step's saved settings) with `expected_config`'s; the loss scale's
    type and hyperparameters, the policy name, each leaf's dtype and shape and the pytree structure in `record`
    with the restore `target`'s.
    """
    where = f"checkpoint at step {n} in {directory}"
    advice = "use another checkpoint directory (--workdir) or the same settings"
    found = (_config_mismatch(n, where, config, expected_config, match_keys)
             or _loss_scale_mismatch(where, record, target) or _policy_mismatch(where, record, target)
             or _leaves_mismatch(where, record, target) or _structure_mismatch(where, record, target))
    return None if found is None else f"{found}; {advice}"


def _config_mismatch(n: int, where: str, config: dict, expected_config: dict | None, match_keys) -> str | None:
    for key in match_keys:
        want = _json_normal(expected_config[key])
        if key not in config:
            return f"{where} was saved without {key} but this run has {key}={_fmt(want)}"
        if config[key] != want:
            return (f"checkpoint at step {n} was saved with {key}={_fmt(config[key])} but this run has "
                    f"{key}={_fmt(want)}")
    return None


def _loss_scale_mismatch(where: str, record: dict, target) -> str | None:
    saved_ls = record.get("loss_scale") or {}
    this_ls = _json_normal(loss_scale_record(target.loss_scale))
    if saved_ls.get("type") != this_ls["type"]:
        return f"{where} was saved with loss_scale={saved_ls.get('type')} but this run has loss_scale={this_ls['type']}"
    saved_cfg, this_cfg = saved_ls.get("config") or {}, this_ls["config"]
    for field in sorted(set(saved_cfg) | set(this_cfg)):
        if saved_cfg.get(field) != this_cfg.get(field):
            return (f"{where} was saved with loss_scale.{field}={_fmt(saved_cfg.get(field))} but this run has "
                    f"loss_scale.{field}={_fmt(this_cfg.get(field))}")
    return None


def _policy_mismatch(where: str, record: dict, target) -> str | None:
    this_policy = policy_name(target.policy)
    if record.get("policy") != this_policy:
        return f"{where} was saved with policy={_fmt(record.get('policy'))} but this run has policy={_fmt(this_policy)}"
    return None


def _leaves_mismatch(where: str, record: dict, target) -> str | None:
    saved_leaves = record.get("leaves") or {}
    flat, _ = jax.tree_util.tree_flatten_with_path(target)
    target_leaves = {jax.tree_util.keystr(p): x for p, x in flat}
    extra = [k for k in saved_leaves if k not in target_leaves]
    absent = [k for k in target_leaves if k not in saved_leaves]
    if extra or absent:
        return (f"{where} has leaves {extra[:5]} that the restore target lacks and lacks leaves {absent[:5]} that "
                f"the restore target has")
    for key, x in target_leaves.items():
        saved = saved_leaves[key]
        this = {"dtype": leaf_dtype(x), "shape": list(x.shape)}
        if (saved.get("dtype"), saved.get("shape")) != (this["dtype"], this["shape"]):
            return (f"{where} was saved with {key} as {saved.get('dtype')}{saved.get('shape')} but this run has "
                    f"{this['dtype']}{this['shape']}")
    return None


def _legacy_class():
    """The `TrainState` of formats 1 and 2: the same fields without `model_state` and `consecutive_skips`. Named
    `TrainState` too, so its structure string is the one those records hold; orbax restores into it by field name."""

    @flax.struct.dataclass
    class TrainState:  # noqa: D401 - the old state's shape only
        step: Any
        params: Any
        opt_state: Any
        loss_scale: Any
        rng: Any
        tx: Any = flax.struct.field(pytree_node=False)
        policy: Any = flax.struct.field(pytree_node=False)
        trainable: Any = flax.struct.field(pytree_node=False, default=None)

    return TrainState


_LEGACY_STATE = _legacy_class()


def legacy_target(record: dict, target):
    """The restore target of a record written before the state held `consecutive_skips` and `model_state` (format
    1 or 2: no such leaf): the old state's shape with `target`'s fields, whose structure string and saved tree are
    the ones that record describes; else `target` itself. `with_counter` turns what it restores into `target`'s
    type, the counter at 0."""
    if record.get("format", FORMAT) >= 3 or NEW_IN_FORMAT_3 in (record.get("leaves") or {}):
        return target
    if getattr(target, "consecutive_skips", None) is None or target.model_state is not None:
        return target  # (a target with a model state does not fit an old record: the checks say so)
    return _LEGACY_STATE(step=target.step, params=target.params, opt_state=target.opt_state,
                         loss_scale=target.loss_scale, rng=target.rng, tx=target.tx, policy=target.policy,
                         trainable=target.trainable)


def with_counter(state, target):
    """`state` as `target`'s type: a state restored into a `legacy_target` gets `consecutive_skips` 0 (on the
    target's sharding) and no model state; any other state is returned as it is."""
    if not isinstance(state, _LEGACY_STATE):
        return state
    counter = target.consecutive_skips
    zero = jnp.zeros(counter.shape, counter.dtype)
    sharding = getattr(counter, "sharding", None)
    return type(target)(step=state.step, params=state.params, opt_state=state.opt_state,
                        loss_scale=state.loss_scale, rng=state.rng, tx=state.tx, policy=state.policy,
                        trainable=state.trainable, model_state=None,
                        consecutive_skips=zero if sharding is None else jax.device_put(zero, sharding))


def _structure_mismatch(where: str, record: dict, target) -> str | None:
    this_structure = structure_string(target)
    if record.get("structure") != this_structure:
        a, b = _first_difference(str(record.get("structure")), this_structure)
        return f"{where} was saved with a different pytree structure: saved {a} but this run has {b}"
    return None


def verify(state: TrainState, record: dict) -> tuple[str | None, list[str]]:
    """Recomputes every leaf's sha256 and compares it with the record.

    Returns:
      (the first difference as "checksum mismatch in KEY", or None; the keys of leaves that could not be checked on
      this shard layout, saved with another one).
    """
    saved_leaves = record["leaves"]
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    unverified = []
    whole = [(jax.tree_util.keystr(p), x) for p, x in flat
             if not isinstance(x, jax.Array) or x.is_fully_addressable]
    plain = [(key, x) for key, x in whole if "sha256" in saved_leaves[key]]
    for (key, _), digest in zip(plain, digests([x for _, x in plain])):
        if digest != saved_leaves[key]["sha256"]:
            return f"checksum mismatch in {key}", unverified
    for key, x in whole:
        if "shards" in saved_leaves[key]:  # saved from a multi-process run: check each saved shard
            arr = host_array(x)
            for index, digest in saved_leaves[key]["shards"].items():
                if sha256(np.ascontiguousarray(arr[parse_index(index)])) != digest:
                    return f"checksum mismatch in {key}[{index}]", unverified
    for path, x in flat:
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            continue
        key = jax.tree_util.keystr(path)
        saved = saved_leaves[key].get("shards")
        if saved is None and "sha256" not in saved_leaves[key]:
            continue  # saved with checksums=False
        checked = False
        for shard in x.addressable_shards:
            digest = (saved or {}).get(index_str(shard.index, x.shape))
            if digest is not None:
                checked = True
                if sha256(host_array(shard.data)) != digest:
                    return f"checksum mismatch in {key}[{index_str(shard.index, x.shape)}]", unverified
        if not checked:
            unverified.append(key)
    return None, unverified
