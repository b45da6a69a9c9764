"""Child process for tests/test_sharding.py: checks that need a fixed number of fake CPU devices.

The parent sets XLA_FLAGS=--xla_force_host_platform_device_count=N before this process imports JAX.

Usage:
  python tests/_sharding_child.py mesh8 CKPT_DIR OUT.json
      8 devices: 1-device vs data=8 vs data=2,fsdp=4 steps, an inf on device 3's rows, an FSDP checkpoint saved
      in CKPT_DIR, and one compile across steps and a restore.
  python tests/_sharding_child.py restore MESH CKPT_DIR OUT.json
      restores CKPT_DIR onto MESH ("none" = one device) and writes the leaves' digests.
  python tests/_sharding_child.py train4 OUT.json WAIT_FOR CKPT_DIR -- TRAIN_LM_ARGS...
      4 devices: experiments/train_lm.py's main in this process (records how often its sharded step compiled),
      then, once the file WAIT_FOR exists, restores CKPT_DIR onto data=2,fsdp=2.

Each mode writes a JSON object to OUT.json.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxamp import DynamicLossScale, NoOpLossScale, TrainState, get_policy, train_step  # noqa: E402
from jaxamp import sharding as shd  # noqa: E402
from jaxamp.checkpoint import Checkpointer  # noqa: E402
from jaxamp.lm.model import TransformerConfig, TransformerLM  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 40, 16, 16, 3
MODEL = TransformerLM(TransformerConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=1, num_heads=2, width=32,
                                        dropout=0.0))
LR_ADAM, LR_SGD = 3e-3, 3e-2


def make_state(kind: str = "fp16_adamw") -> TrainState:
    """A fresh state (new buffers every call: a donated state never aliases another run's).

    `fp16_adamw`: fp16 compute, DynamicLossScale (growth every 2 steps), clip + AdamW: the realistic set-up.
    `fp32_sgd`: fp32 and plain SGD, whose update is linear in the gradient: differences are float32 rounding only.
    """
    params = MODEL.init(jax.random.PRNGKey(0), jnp.zeros((1, SEQ), jnp.int32))["params"]
    if kind == "fp32_sgd":
        return TrainState.create(params=params, tx=optax.sgd(LR_SGD), policy=get_policy("fp32"),
                                 loss_scale=NoOpLossScale(), rng=jax.random.PRNGKey(1))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR_ADAM, weight_decay=0.1))
    return TrainState.create(params=params, tx=tx, policy=get_policy("fp16"),
                             loss_scale=DynamicLossScale(2.0**15, growth_interval=2), rng=jax.random.PRNGKey(1))


def loss_fn(params, batch, rng):
    """Mean cross-entropy; row r is weighted by 1 + poison[r] (poison is 0, or inf to overflow that row)."""
    del rng
    inputs, targets, poison = batch
    logits = MODEL.apply({"params": params}, inputs, deterministic=True)  # f32[B, T, V]
    per_row = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(axis=1)  # f32[B]
    return jnp.mean(per_row * (1.0 + poison))


def step_fn(state, batch):
    return train_step(state, batch, loss_fn)


def host_batch(step: int, poison_rows=()) -> tuple:
    rng = np.random.default_rng([7, step])
    tokens = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    poison = np.zeros((BATCH,), np.float32)
    poison[list(poison_rows)] = np.inf
    return tokens[:, :-1], tokens[:, 1:], poison


def global_batch(mesh, step: int, poison_rows=()):
    full = host_batch(step, poison_rows)
    return shd.make_global_batch(lambda a, z: tuple(x[a:z] for x in full), BATCH, mesh)


def host(tree):
    return jax.tree.map(np.asarray, shd.gather_to_host(tree))


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(host(tree))])


def digests(tree) -> dict:
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(host(tree))[0]:
        arr = np.ascontiguousarray(x)
        out[jax.tree_util.keystr(path)] = [str(arr.dtype), list(arr.shape),
                                           hashlib.sha256(arr.reshape(-1).view(np.uint8)).hexdigest()]
    return out


def compare(a, b, initial) -> dict:
    """Differences between the params of two runs from the same `initial` params.

    `max_rel_leaf`: the largest |a - b| in each leaf over that leaf's largest |a|, maximised over leaves.
    `median_abs` / `max_abs`: of |a - b| over all elements; `median_update`: median |b - initial|.
    """
    la, lb = jax.tree.leaves(host(a)), jax.tree.leaves(host(b))
    rel = max(float(np.max(np.abs(x.astype(np.float64) - y)) / max(float(np.max(np.abs(x))), 1e-30))
              for x, y in zip(la, lb))
    d, u = np.abs(flat(a) - flat(b)), np.abs(flat(b) - flat(initial))
    return {"max_rel_leaf": rel, "max_abs": float(d.max()), "median_abs": float(np.median(d)),
            "median_update": float(np.median(u)), "bitwise": all(x.tobytes() == y.tobytes() for x, y in zip(la, lb))}


def run(kind: str, spec: str | None):
    """STEPS steps from a fresh state on one device (spec None) or on a mesh."""
    state = make_state(kind)
    if spec is None:
        jitted, mesh = jax.jit(step_fn, donate_argnums=0), None
    else:
        mesh = shd.make_mesh(spec)
        state = shd.shard_state(state, mesh)
        jitted = shd.jit_train_step(step_fn, mesh)
    metrics = []
    for s in range(STEPS):
        batch = host_batch(s) if mesh is None else global_batch(mesh, s)
        state, m = jitted(state, batch)
        metrics.append({k: float(m[k]) for k in ("loss", "grad_norm", "loss_scale", "grads_finite")})
    return state, metrics, mesh, jitted


def mesh8(ckpt_dir: str) -> dict:
    assert jax.device_count() == 8, jax.devices()
    out: dict = {"seconds": {}}
    t0 = time.perf_counter()
    runs = {}
    for kind in ("fp32_sgd", "fp16_adamw"):
        initial = make_state(kind).params
        one, m1, _, _ = run(kind, None)
        dp, mdp, _, _ = run(kind, "data=8")
        fsdp, mf, mesh, jitted = run(kind, "data=2,fsdp=4")
        out[kind] = {"metrics": {"one": m1, "dp": mdp, "fsdp": mf},
                     "dp_vs_one": compare(dp.params, one.params, initial),
                     "fsdp_vs_dp": compare(fsdp.params, dp.params, initial),
                     "steps": [int(s.step) for s in (one, dp, fsdp)]}
        runs[kind] = (fsdp, mesh, jitted)
        out["seconds"][kind] = time.perf_counter() - t0
    fsdp, mesh, jitted = runs["fp16_adamw"]

    # The FSDP layout: which params are split, and the shard shape of the token embedding.
    leaves = jax.tree_util.tree_flatten_with_path(fsdp.params)[0]
    out["fsdp_specs"] = {jax.tree_util.keystr(p): str(x.sharding.spec) for p, x in leaves}
    wte = fsdp.params["wte"]["embedding"]
    out["wte"] = {"shape": list(wte.shape), "shard_shape": list(wte.addressable_shards[0].data.shape),
                  "devices": len(wte.sharding.device_set)}
    out["opt_state_specs"] = sorted({str(getattr(x.sharding, "spec", None)) for x in jax.tree.leaves(fsdp.opt_state)})
    out["scalar_specs"] = sorted({str(x.sharding.spec) for x in jax.tree.leaves((fsdp.step, fsdp.loss_scale,
                                                                                  fsdp.rng))})

    # An inf in the rows of the mesh's 4th device only: the step is skipped on every device.
    target = mesh.devices.flat[3]
    rows = list(range(*shd.batch_sharding(mesh).devices_indices_map((BATCH,))[target][0].indices(BATCH)))
    before = host((fsdp.params, fsdp.opt_state))
    scale_before = float(fsdp.loss_scale.loss_scale)
    batch = global_batch(mesh, 99, rows)
    out["poison"] = {"rows": rows, "device_id": target.id,
                     "nonfinite_shard_devices": sorted(s.device.id for s in batch[2].addressable_shards
                                                       if not np.isfinite(np.asarray(s.data)).all())}
    state, metrics = jitted(fsdp, batch)
    after = host((state.params, state.opt_state))
    ls = state.loss_scale
    out["poison"].update(
        grads_finite=bool(metrics["grads_finite"]),
        unchanged=jax.tree.structure(before) == jax.tree.structure(after) and all(
            x.tobytes() == y.tobytes() for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after))),
        scale_before=scale_before,
        scale_shards=[float(np.asarray(s.data)) for s in ls.loss_scale.addressable_shards],
        growth_counter_shards=[int(np.asarray(s.data)) for s in ls.growth_counter.addressable_shards],
        step_shards=[int(np.asarray(s.data)) for s in state.step.addressable_shards])

    # Save the FSDP state; restore it onto the same mesh and step on: still one executable.
    out["saved_digests"] = digests(state)
    with Checkpointer(ckpt_dir) as ckpt:
        ckpt.save(state, {"mesh": "data=2,fsdp=4"})
    with Checkpointer(ckpt_dir) as ckpt:
        restored, _ = ckpt.restore(shd.abstract_state(state, mesh))
    out["restore_same_mesh_equal"] = digests(restored) == out["saved_digests"]
    restored, _ = jitted(restored, global_batch(mesh, 100))
    out["compiled"] = jitted.compiled_count()
    out["seconds"]["total"] = time.perf_counter() - t0
    return out


def restore(spec: str, ckpt_dir: str) -> dict:
    mesh = None if spec == "none" else shd.make_mesh(spec)
    with Checkpointer(ckpt_dir) as ckpt:
        state, config = ckpt.restore(shd.abstract_state(jax.eval_shape(make_state), mesh))
    wte = state.params["wte"]["embedding"]
    return {"digests": digests(state), "config": config, "devices": jax.device_count(),
            "wte_devices": len(wte.sharding.device_set), "wte_spec": str(getattr(wte.sharding, "spec", None))}


def train4(argv: list[str], wait_for: str, ckpt_dir: str) -> dict:
    """experiments/train_lm.py's main on 4 devices (argv), then, once `wait_for` exists, a restore of `ckpt_dir`
    (saved by `mesh8`) onto a data=2,fsdp=2 mesh."""
    assert jax.device_count() == 4, jax.devices()
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import train_lm  # pylint: disable=import-outside-toplevel

    import jaxamp.lm.setup as jt  # pylint: disable=import-outside-toplevel  (build() makes the sharded step)

    made = []
    original = jt.jit_train_step

    def recording(*args, **kwargs):  # keeps the sharded step train() builds, to count its compiles afterwards
        made.append(original(*args, **kwargs))
        return made[-1]

    jt.jit_train_step = recording
    out = {"code": train_lm.main(argv), "step_fns": len(made), "compiled": [f.compiled_count() for f in made]}
    deadline = time.time() + 600
    while not os.path.exists(wait_for):
        if time.time() > deadline:
            raise SystemExit(f"{wait_for} did not appear")
        time.sleep(0.2)
    out["restore"] = restore("data=2,fsdp=2", ckpt_dir)
    return out


def main(argv: list[str]) -> None:
    mode = argv[1]
    if mode == "mesh8":
        result, out = mesh8(argv[2]), argv[3]
    elif mode == "restore":
        result, out = restore(argv[2], argv[3]), argv[4]
    elif mode == "train4":
        sep = argv.index("--")
        result, out = train4(argv[sep + 1:], argv[3], argv[4]), argv[2]
    else:
        raise SystemExit(f"unknown mode {mode}")
    with open(out + ".part", "w") as f:
        json.dump(result, f)
    os.replace(out + ".part", out)


if __name__ == "__main__":
    main(sys.argv)
