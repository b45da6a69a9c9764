"""Child process for tests/test_checkpoint.py: work that needs its own process (fake devices, kill -9).

Usage:
  python tests/_ckpt_child.py save_sharded DIR OUT.json   # 8 fake CPU devices (XLA_FLAGS set by the parent)
  python tests/_ckpt_child.py restore_single DIR OUT.json # 1 device
  python tests/_ckpt_child.py big_save DIR MB OUT.json    # saves step 1, then step 2 (the parent kills it)

Each mode writes a JSON {leaf path: sha256} (plus details) to OUT.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxamp import DynamicLossScale, TrainState, get_policy  # noqa: E402
from jaxamp.checkpoint import Checkpointer  # noqa: E402


def leaf_digests(state) -> dict:
    """{keystr path: sha256 of the leaf's bytes} for every array leaf of `state`."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        arr = np.ascontiguousarray(np.asarray(jax.device_get(x)))
        out[jax.tree_util.keystr(path)] = [str(arr.dtype), list(arr.shape),
                                           hashlib.sha256(arr.reshape(-1).view(np.uint8)).hexdigest()]
    return out


def sharded_state(seed: int = 0) -> TrainState:
    """A TrainState (adam, fp16 policy, dynamic loss scale) with params of a size divisible by 8 devices."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = {"w": jax.random.normal(k1, (64, 32), jnp.float32), "b": jax.random.normal(k2, (32,), jnp.float32),
              "v": jax.random.normal(k3, (16, 8), jnp.float32)}
    return TrainState.create(params=params, tx=optax.adam(1e-3), policy=get_policy("fp16"),
                             loss_scale=DynamicLossScale(2.0**12, growth_interval=5, hysteresis=2),
                             rng=jax.random.key(seed))


def big_state(mb: float, seed: int = 0) -> TrainState:
    """A TrainState whose float32 params take about `mb` MB (4 matrices), with a cheap optimizer (sgd).

    The values are random floats in [1, 2) made from numpy's random bytes (jax.random.normal on ~75M values takes
    seconds on 2 CPU cores).
    """
    n = max(1, int(mb * 2**20 / 4 / 4 / 1024))  # rows of 1024 float32 per matrix
    rng = np.random.default_rng(seed)
    params = {}
    for i in range(4):
        bits = np.frombuffer(rng.bytes(n * 1024 * 4), np.uint32).reshape(n, 1024)
        params[f"w{i}"] = jnp.asarray(((bits >> 9) | np.uint32(0x3F800000)).view(np.float32))
    return TrainState.create(params=params, tx=optax.sgd(1e-2), policy=get_policy("bf16"),
                             loss_scale=DynamicLossScale(2.0**8), rng=jax.random.key(seed))


def _write(path: str, obj) -> None:
    with open(path + ".part", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".part", path)


def main(argv: list[str]) -> None:
    mode, directory = argv[1], argv[2]
    if mode == "save_sharded":
        out = argv[3]
        assert jax.device_count() == 8, jax.devices()
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
        state = sharded_state()
        state = state.replace(params=jax.device_put(state.params, rows),
                              step=jnp.asarray(7, jnp.int32))
        assert len(state.params["w"].sharding.device_set) == 8
        ckpt = Checkpointer(directory)
        assert ckpt.save(state, {"devices": 8})
        ckpt.close()
        _write(out, {"digests": leaf_digests(state), "num_devices": len(state.params["w"].sharding.device_set)})
    elif mode == "restore_single":
        out = argv[3]
        assert jax.device_count() == 1, jax.devices()
        abstract = jax.eval_shape(sharded_state)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), abstract)
        state, config = Checkpointer(directory).restore(abstract)
        _write(out, {"digests": leaf_digests(state), "config": config,
                     "num_devices": len(state.params["w"].sharding.device_set)})
    elif mode == "big_save":
        mb, out = float(argv[3]), argv[4]
        state = big_state(mb)
        ckpt = Checkpointer(directory, keep=3)
        state1 = state.replace(step=jnp.asarray(1, jnp.int32))
        digests1 = leaf_digests(state1)
        assert ckpt.save(state1, {"mb": mb})
        ckpt.wait()
        state2 = state1.replace(step=jnp.asarray(2, jnp.int32),
                                params=jax.tree.map(lambda p: p + 1.0, state1.params))
        digests2 = leaf_digests(state2)
        _write(out, {"1": digests1, "2": digests2})
        print("SAVING2", flush=True)
        t = time.perf_counter()
        ckpt.save(state2, {"mb": mb})
        print(f"SAVE2_STARTED {time.perf_counter() - t:.3f}", flush=True)
        ckpt.wait()
        print(f"DONE2 {time.perf_counter() - t:.3f}", flush=True)
        ckpt.close()
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv)
