"""Save/restore time and on-disk size of jaxamp checkpoints (`jaxamp.checkpoint.Checkpointer`), checksums on and off.

    python benchmarks/checkpoint_bench.py                  # reference TrainState + a 124M-parameter state, 3 reps
    python benchmarks/checkpoint_bench.py --tiny --out /tmp/checkpoint.md       # smoke test, a few seconds

Two states, both a real `jaxamp.TrainState` with the reference optimizer (`jaxamp.lm.setup.make_optimizer`: global-norm
clipping + AdamW via `inject_hyperparams`, float32 moments):

  reference  `jaxamp.lm.setup.build(TrainConfig())`: the default LM (4 layers, width 128, ~0.8M parameters), after one
             training step (so the Adam moments are not all zero, which would compress unrealistically well);
  gpt2-small the same LM at GPT-2 small's size (12 layers, 12 heads, width 768, vocab 50304, seq 1024: ~124M
             parameters, ~1.5 GB with both Adam moments); params drawn normal(0, 0.02) and one AdamW update
             applied with a synthetic gradient (no forward pass: only the state's shapes and values matter here).

For each state and each setting of `Checkpointer(..., checksums=True/False)` (asynchronous saves, as in training):
one warm-up save and restore, then `--reps` repetitions of
  - save, blocking: `save()` until it returns (device-to-host copy, the sha256 of every leaf when checksums are on,
    orbax's synchronous part); the training loop stalls for this long;
  - save, until complete: `save()` + `wait()` (the background write and commit);
  - restore, cold: `restore(step=...)` into an abstract target, arrays ready, every leaf's sha256 verified when the
    step has checksums; the step's files are fsync'ed and dropped from the OS page cache first
    (`posix_fadvise(DONTNEED)`), so they are read from disk (as far as the VM's disk allows);
  - restore, warm: the same again, files now in the page cache;
  - on-disk bytes of the step folder (all files).
The two settings alternate within each repetition so drifts in machine load hit both alike. Figures: medians.
Checkpoints go to a temporary folder (`--tmp-dir`), deleted afterwards. Writes `--out` (markdown) and prints it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks import harness  # noqa: E402
from jaxamp import NoOpLossScale, TrainState, get_policy  # noqa: E402
from jaxamp.checkpoint import Checkpointer  # noqa: E402
from jaxamp.lm.config import TrainConfig  # noqa: E402
from jaxamp.lm.data import batch_at  # noqa: E402
from jaxamp.lm.model import TransformerConfig, TransformerLM, count_params  # noqa: E402
from jaxamp.lm.setup import build, make_optimizer  # noqa: E402

REPO = harness.REPO
DEFAULT_OUT = harness.RESULTS / "checkpoint.md"
TINY_OUT = harness.RESULTS / "checkpoint_tiny.md"  # --tiny never overwrites the real results
GPT2_SMALL = TransformerConfig(vocab_size=50304, seq_len=1024, num_layers=12, num_heads=12, width=768)
TINY_LARGE = TransformerConfig(vocab_size=512, seq_len=64, num_layers=2, num_heads=2, width=64)
TINY_REFERENCE = TrainConfig(layers=1, heads=2, width=16, seq_len=8, batch_size=2)


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked (one-line usage errors); `--tiny` picks its own `--out`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3, help="measured repetitions per state and setting")
    p.add_argument("--tiny", action="store_true",
                   help="tiny states, the reference one untrained (a smoke test of a few seconds)")
    p.add_argument("--skip-large", action="store_true", help="only the reference state")
    p.add_argument("--data", default=None, help="corpus for the reference state (default: Python stdlib sources)")
    p.add_argument("--tmp-dir", type=Path, default=None, help="where checkpoints are written (default: $TMPDIR)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"markdown output (default: {DEFAULT_OUT.relative_to(REPO)}; with --tiny: "
                   f"{TINY_OUT.relative_to(REPO)})")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    args.out = args.out if args.out is not None else (TINY_OUT if args.tiny else DEFAULT_OUT)
    harness.check_output(p, "--out", args.out)
    if args.tmp_dir is not None:
        harness.check_output(p, "--tmp-dir", args.tmp_dir, directory=True)
    return args


# ---------------------------------------------------------------------------------------------------------------
# States.


def reference_state(cfg: TrainConfig, *, train: bool = True) -> TrainState:
    """`build(cfg)`'s state after one real training step (`train`), else as built (Adam moments all zero)."""
    run = build(cfg)
    if not train:
        return run.state
    batch = batch_at(run.dataset.train, seed=cfg.seed, step=0, batch_size=cfg.batch_size, seq_len=cfg.seq_len)
    state, _ = run.step_fn(run.state, batch)
    return jax.block_until_ready(state)


def synthetic_lm_state(model_cfg: TransformerConfig, seed: int = 0) -> TrainState:
    """A TrainState of the LM at `model_cfg`'s size: normal(0, 0.02) params, one AdamW update (synthetic gradient)."""
    model = TransformerLM(model_cfg)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, model_cfg.seq_len), jnp.int32))["params"]
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: jnp.asarray(0.02 * rng.standard_normal(x.shape, np.float32)), shapes)
    tx = make_optimizer(TrainConfig(), params)
    state = TrainState.create(params=params, tx=tx, policy=get_policy("fp32"), loss_scale=NoOpLossScale(),
                              rng=jax.random.key(seed))

    @jax.jit
    def one_update(state):
        grads = jax.tree.map(lambda p: 1e-3 * jnp.sin(1e3 * p), state.params)  # a synthetic, varied gradient
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                             opt_state=opt_state)

    return jax.block_until_ready(one_update(state))


def state_bytes(state: TrainState) -> int:
    """Bytes of every array leaf of `state`."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, "dtype")))


# ---------------------------------------------------------------------------------------------------------------
# Measurement.


def _files(folder: Path) -> list[Path]:
    return [Path(root) / f for root, _, files in os.walk(folder) for f in files]


def disk_bytes(folder: Path) -> int:
    """Bytes of every file under `folder`."""
    return sum(f.stat().st_size for f in _files(folder))


def drop_page_cache(folder: Path) -> bool:
    """fsync and evict the folder's files from the OS page cache; False where posix_fadvise is unavailable."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in _files(folder):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _with_step(state: TrainState, step: int) -> TrainState:
    return state.replace(step=jnp.asarray(step, state.step.dtype))


def _timed_restore(ckpt: Checkpointer, abstract, step: int, check) -> float:
    t0 = time.perf_counter()
    restored, _ = ckpt.restore(abstract, step=step)
    jax.block_until_ready(restored)
    seconds = time.perf_counter() - t0
    assert int(restored.step) == step and np.array_equal(np.asarray(jax.tree.leaves(restored.params)[0]), check)
    return seconds


def bench_state(name: str, state: TrainState, root: Path, reps: int) -> list[dict]:
    """Rows (one per checksum setting) of median timings for `state`."""
    abstract = jax.eval_shape(lambda: state)
    check = np.asarray(jax.tree.leaves(state.params)[0])
    config = {"benchmark": name}
    settings = (True, False)
    ckpts = {on: Checkpointer(root / f"{name}-checksums-{'on' if on else 'off'}", keep=reps + 2, checksums=on)
             for on in settings}
    times = {on: {"blocking": [], "complete": [], "cold": [], "warm": [], "disk": []} for on in settings}
    try:
        for on in settings:  # warm-up: orbax manager creation, first-call costs
            ckpt = ckpts[on]
            ckpt.save(_with_step(state, 1), config)
            ckpt.wait()
            _timed_restore(ckpt, abstract, 1, check)
        for rep in range(reps):
            step = rep + 2
            for on in harness.rotated(settings, rep):
                ckpt, t = ckpts[on], times[on]
                s = _with_step(state, step)
                jax.block_until_ready(s)
                t0 = time.perf_counter()
                ckpt.save(s, config)
                t1 = time.perf_counter()
                ckpt.wait()
                t2 = time.perf_counter()
                t["blocking"].append(t1 - t0)
                t["complete"].append(t2 - t0)
                folder = ckpt.directory / str(step)
                t["disk"].append(disk_bytes(folder))
                drop_page_cache(folder)
                t["cold"].append(_timed_restore(ckpt, abstract, step, check))
                t["warm"].append(_timed_restore(ckpt, abstract, step, check))
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
    rows = []
    for on in settings:
        t = times[on]
        rows.append({"state": name, "params": count_params(state.params), "bytes": state_bytes(state),
                     "leaves": len(jax.tree.leaves(state)), "checksums": on,
                     **{k: statistics.median(v) for k, v in t.items()}, "raw": t})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Report.


def _filesystem(folder: Path) -> str:
    """The filesystem `folder` lies on ("tmpfs on tmpfs"), from /proc/mounts ("unknown filesystem" elsewhere)."""
    fs, best = "", ""
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, kind = line.split()[:3]
            if str(folder.resolve()).startswith(mnt) and len(mnt) >= len(best):
                best, fs = mnt, f"{kind} on {dev}"
    except (OSError, ValueError):
        pass
    return fs or "unknown filesystem"


def _machine(tmp: Path) -> str:
    """harness.machine() with the RAM, where the checkpoints go and orbax's version."""
    import orbax.checkpoint as ocp

    try:
        mem_s = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM"
    except (ValueError, OSError, AttributeError):
        mem_s = ""
    return (f"{harness.machine(load=False)}{mem_s}; checkpoints in {tmp} ({_filesystem(tmp)}); "
            f"orbax-checkpoint {ocp.__version__}")


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return float("nan")


def _mib(n: float) -> str:
    mib = n / 2**20
    return f"{mib:,.1f}" if mib >= 10 else f"{mib:.3f}"


def _checksum_cost(rows: list[dict]) -> list[str]:
    """One line per state: what checksums cost (on minus off, medians)."""
    lines = ["", "Cost of checksums (on minus off, medians):", ""]
    by_state: dict[str, dict[bool, dict]] = {}
    for r in rows:
        by_state.setdefault(r["state"], {})[r["checksums"]] = r
    for name, pair in by_state.items():
        on, off = pair[True], pair[False]
        gb = on["bytes"] / 1e9
        rate = f"; {gb / (on['blocking'] - off['blocking']):.2f} GB/s hashed while blocking" \
            if on["blocking"] > off["blocking"] and gb > 0.1 else ""
        lines.append(f"- {name}: save blocking {on['blocking'] - off['blocking']:+.3f} s, save until complete "
                     f"{on['complete'] - off['complete']:+.3f} s, cold restore (verification) "
                     f"{on['cold'] - off['cold']:+.3f} s{rate}")
    return lines


DEFINITIONS = (
    "Definitions: *save: blocking* = `Checkpointer.save()` until it returns (device-to-host copy, sha256 of "
    "every leaf when checksums are on, orbax's synchronous part: the training loop stalls this long); *save: "
    "until complete* = `save()` + `wait()` (background write and commit); *restore* = `restore(abstract, "
    "step=N)` until the arrays are ready, including the sha256 verification of every leaf when the step holds "
    "checksums (a step saved with checksums off has nothing to verify); *cold* = after fsync + "
    "`posix_fadvise(DONTNEED)` of the step's files (read from the disk, as far as the VM allows), *warm* = "
    "right after, from the page cache; *on disk* = all files of the step folder. `state (MiB)` = all array "
    "leaves of the TrainState (params + AdamW mu and nu + scalars).")


def report(rows: list[dict], args: argparse.Namespace, argv: list[str], tmp: Path, wall: float,
           load: tuple[float, float]) -> str:
    """The markdown report: the medians, the cost of checksums, definitions, the raw timings."""
    lines = [
        "# Checkpoint save/restore cost (jaxamp.checkpoint.Checkpointer, orbax)",
        "",
        f"Command: `{harness.command_line(__file__, argv)}` ({wall:.0f} s)",
        f"Date: {harness.now()}",
        f"Machine: {_machine(tmp)}; 1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end "
        f"(other jobs share the machine: the spread is in the raw timings below)",
        "",
        f"Median of {args.reps} repetitions (after one warm-up save and restore); asynchronous saves, as in "
        f"training. Seconds, except sizes.",
        "",
        *harness.table(["state", "parameters", "state (MiB)", "checksums", "save: blocking", "save: until complete",
                        "restore, cold", "restore, warm", "on disk (MiB)"], align="lrrlrrrrr"),
    ]
    for r in rows:
        lines.append(
            f"| {r['state']} | {r['params']:,} | {_mib(r['bytes'])} | {'on' if r['checksums'] else 'off'} | "
            f"{r['blocking']:.3f} | {r['complete']:.3f} | {r['cold']:.3f} | {r['warm']:.3f} | {_mib(r['disk'])} |")
    lines += [*_checksum_cost(rows), "", DEFINITIONS, "", "Raw timings (s), in repetition order:", ""]
    for r in rows:
        raw = r["raw"]
        lines.append(f"- {r['state']}, checksums {'on' if r['checksums'] else 'off'}: " + "; ".join(
            f"{k} " + ", ".join(f"{v:.3f}" for v in raw[k]) for k in ("blocking", "complete", "cold", "warm")))
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t_start, load_start = time.perf_counter(), _load()
    if args.tmp_dir is not None:
        args.tmp_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="jaxamp-ckpt-bench-", dir=args.tmp_dir))
    try:
        ref_cfg = TINY_REFERENCE if args.tiny else TrainConfig()
        ref_cfg = dataclasses.replace(ref_cfg, data=args.data, workdir=str(tmp / "unused"))
        states = [("reference", lambda: reference_state(ref_cfg, train=not args.tiny))]
        if not args.skip_large:
            large = TINY_LARGE if args.tiny else GPT2_SMALL
            label = "synthetic-tiny" if args.tiny else "gpt2-small (124M)"
            states.append((label, lambda: synthetic_lm_state(large)))
        rows = []
        for name, make in states:
            t0 = time.perf_counter()
            state = make()
            print(f"{name}: {count_params(state.params):,} parameters, {_mib(state_bytes(state))} MiB state "
                  f"(built in {time.perf_counter() - t0:.1f} s)", flush=True)
            rows += bench_state(name.split(" ")[0], state, tmp, args.reps)
            for r in rows[-2:]:
                r["state"] = name
            del state
        text = report(rows, args, argv, tmp, time.perf_counter() - t_start, (load_start, _load()))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    harness.write_report(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
