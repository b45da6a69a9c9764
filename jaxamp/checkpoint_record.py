"""The integrity record of a checkpoint step: per-leaf sha256 digests, dtypes and shapes, the loss scale's type
and hyperparameters, the policy name, the pytree structure and digests of the config and metrics.

`jaxamp.checkpoint.Checkpointer` writes it beside each step and checks restores against it; the design (whole-array
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

import jax
import numpy as np

from jaxamp.precision import policy_name
from jaxamp.state import TrainState

__all__ = ["FORMAT", "READABLE_FORMATS", "allgather_json", "config_digest", "digests",
           "host_array", "index_str", "integrity_record", "leaf_dtype", "loss_scale_record",
           "parse_index", "seal_intact", "sealed", "sha256", "structure_string"]

FORMAT = 2  # 2 adds record_sha256, the record's own digest; format-1 records are still read
READABLE_FORMATS = (1, 2)
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
    config = loss_scale.config() if hasattr(loss_scale, "config") else {}
    return {"type": type(loss_scale).__name__, "config": config}


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
