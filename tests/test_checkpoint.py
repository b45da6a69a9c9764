"""Checkpointer: bitwise round trip, corruption fallback, mismatch detection, keep, topology change, kill -9."""

from __future__ import annotations

import ast
import gc
import hashlib
import importlib.util
import inspect
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from jaxamp import DynamicLossScale, TrainState, get_policy, train_step
from jaxamp.checkpoint import Checkpointer, CheckpointError, CheckpointMismatchError

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "_ckpt_child.py"
CONFIG = {"width": 64, "lr": 1e-3, "policy": "fp16", "layers": [16, 64, 64, 1]}
# orbax leaves the coroutines of a failed read behind; collecting them prints "Exception ignored in <coroutine>".
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
BIG_MB = 300  # kill -9 test: params size of the child's state


@pytest.fixture(autouse=True)
def _collect_orbax_leftovers():
    """Collects the coroutines a failed read left behind while this module's warning filter applies, not later
    inside another module's test."""
    yield
    gc.collect()


def _tx():
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 5, 50, 1e-4)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.1))


def _loss_scale():
    return DynamicLossScale(2.0**10, growth_interval=3, min_loss_scale=2.0**-6, max_loss_scale=2.0**20,
                            hysteresis=2)


def _build(seed: int = 0) -> TrainState:
    keys = jax.random.split(jax.random.key(seed), 3)
    params = {
        "dense1": {"kernel": jax.random.normal(keys[0], (16, 64), jnp.float32) * 0.25,
                   "bias": jnp.zeros((64,), jnp.float32)},
        "dense2": {"kernel": jax.random.normal(keys[1], (64, 64), jnp.float32) * 0.125,
                   "bias": jnp.zeros((64,), jnp.float32)},
        "out": {"kernel": jax.random.normal(keys[2], (64, 1), jnp.float32) * 0.125},
    }
    return TrainState.create(params=params, tx=_tx(), policy=get_policy("fp16"), loss_scale=_loss_scale(),
                             rng=jax.random.key(seed))


def _loss_fn(params, batch, rng):
    del rng
    x, y = batch
    h = jax.nn.relu(x.astype(jnp.float16) @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    h = jax.nn.relu(h @ params["dense2"]["kernel"] + params["dense2"]["bias"])
    pred = (h @ params["out"]["kernel"]).astype(jnp.float32)
    return jnp.mean((pred - y) ** 2)


@pytest.fixture(scope="module")
def states() -> dict[int, TrainState]:
    """States after steps 1..5: growth_counter 1 at step 4, an overflow (overflow_counter 1) at step 5."""
    step = jax.jit(train_step, static_argnames="loss_fn")
    x = jax.random.normal(jax.random.key(42), (8, 16), jnp.float32)
    normal = (x, jnp.ones((8, 1), jnp.float32))
    overflow = (x, jnp.full((8, 1), 3e4, jnp.float32))  # fp16 cotangents ~ 2*3e4*1024/8 > 65504 -> inf
    state, out = _build(), {}
    with jax.numpy_dtype_promotion("strict"):
        for i, batch in enumerate([normal, normal, normal, normal, overflow], start=1):
            state, metrics = step(state, batch, loss_fn=_loss_fn)
            out[i] = state
    assert int(out[4].loss_scale.growth_counter) == 1 and float(out[4].loss_scale.loss_scale) == 2.0**11
    assert int(out[5].loss_scale.overflow_counter) == 1 and not bool(metrics["grads_finite"])
    assert int(out[4].opt_state[1].count) == 4 and float(out[4].opt_state[1].hyperparams["learning_rate"]) > 0
    return out


def _abstract(state: TrainState) -> TrainState:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)


def _save(directory: Path, states: dict, steps=(1, 2, 3, 4, 5), **kwargs) -> Checkpointer:
    ckpt = Checkpointer(directory, **kwargs)
    for s in steps:
        assert ckpt.save(states[s], dict(CONFIG, saved_at=s))
    ckpt.wait()
    return ckpt


def _leaf_bytes(state) -> dict:
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        arr = np.asarray(jax.device_get(x))
        out[jax.tree_util.keystr(path)] = (arr.dtype, arr.shape, arr.tobytes())
    return out


def assert_bitwise(restored: TrainState, expected: TrainState, same_tx: bool = True) -> None:
    """Every leaf equal in dtype, shape and bytes; the structure (static fields included) equal when same_tx."""
    if same_tx:
        assert jax.tree.structure(restored) == jax.tree.structure(expected)
    got, want = _leaf_bytes(restored), _leaf_bytes(expected)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key][:2] == want[key][:2], key  # dtype and shape
        assert got[key][2] == want[key][2], f"{key} differs bitwise"


def _snapshot(directory: Path) -> list:
    out = []
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            p = Path(root) / name
            st = p.stat()
            out.append((str(p.relative_to(directory)), st.st_size, st.st_mtime_ns))
    return sorted(out)


def _data_files(step_dir: Path) -> list[Path]:
    """Every file under a step folder, largest last (the largest is OCDBT array data)."""
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    return sorted(files, key=lambda p: p.stat().st_size)


def _restore_with_warnings(ckpt, abstract, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, config = ckpt.restore(abstract, **kwargs)
    messages = [str(w.message) for w in caught if "unusable" in str(w.message)]
    return state, config, messages


# 1 -------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_round_trip_bitwise(tmp_path, states):
    ckpt = _save(tmp_path, states, keep=5)
    assert ckpt.steps() == [1, 2, 3, 4, 5] and ckpt.latest_step() == 5
    target = _abstract(states[5])
    restored, config = ckpt.restore(target, dict(CONFIG), match_keys=("width", "layers"))
    assert_bitwise(restored, states[5])
    assert config == dict(CONFIG, saved_at=5)
    assert int(restored.step) == 5 and int(restored.loss_scale.overflow_counter) == 1
    ls = restored.loss_scale
    assert (ls.min_loss_scale, ls.max_loss_scale, ls.hysteresis, ls.growth_interval) == (2.0**-6, 2.0**20, 2, 3)
    assert (ls.growth_factor, ls.backoff_factor) == (2.0, 0.5)
    assert ls.loss_scale.dtype == jnp.float32 and ls.growth_counter.dtype == jnp.int32
    assert restored.tx is target.tx and restored.policy == get_policy("fp16")
    assert restored.rng.dtype == jnp.uint32 and restored.step.dtype == jnp.int32

    # An explicit older step, into a target from eval_shape (a new tx object, no shardings).
    target = jax.eval_shape(_build)
    restored, config = ckpt.restore(target, step=4)
    assert_bitwise(restored, states[4], same_tx=False)
    assert int(restored.loss_scale.growth_counter) == 1 and config["saved_at"] == 4
    assert restored.tx is target.tx and restored.tx is not states[4].tx
    ckpt.close()


# 2 -------------------------------------------------------------------------------------------------------------


def test_flipped_byte_falls_back_to_previous_step(tmp_path, states):
    _save(tmp_path, states, steps=(3, 4)).close()
    victim = _data_files(tmp_path / "4")[-1]
    assert "ocdbt" in str(victim.relative_to(tmp_path)) or victim.parent.name == "d"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))

    restored, config, messages = _restore_with_warnings(Checkpointer(tmp_path), _abstract(states[4]))
    assert int(restored.step) == 3 and config["saved_at"] == 3
    assert_bitwise(restored, states[3])
    assert len(messages) == 1 and messages[0].startswith(f"checkpoint step 4 in {tmp_path} is unusable (")
    # orbax 0.12.8 restores a flip inside zstd data silently; a decode error is the other possible outcome.
    assert "checksum mismatch in" in messages[0] or "orbax could not restore" in messages[0], messages[0]
    assert messages[0].endswith("; trying the previous one")


# 3 -------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["delete largest data file", "delete state/_METADATA",
                                    "delete integrity/metadata", "truncate largest data file"])
def test_missing_or_truncated_file_falls_back(tmp_path, states, damage):
    _save(tmp_path, states, steps=(3, 4)).close()
    step_dir = tmp_path / "4"
    if damage == "delete largest data file":
        _data_files(step_dir)[-1].unlink()
    elif damage == "truncate largest data file":
        victim = _data_files(step_dir)[-1]
        os.truncate(victim, victim.stat().st_size // 2)
    else:
        (step_dir / damage.split()[-1]).unlink()
    restored, config, messages = _restore_with_warnings(Checkpointer(tmp_path), _abstract(states[4]))
    assert int(restored.step) == 3 and config["saved_at"] == 3
    assert_bitwise(restored, states[3])
    assert len(messages) == 1 and messages[0].startswith(f"checkpoint step 4 in {tmp_path} is unusable (")


@pytest.mark.parametrize("damage", ["truncate state/manifest.ocdbt", "truncate the root b-tree node in state/d",
                                    "delete state/manifest.ocdbt"])
def test_damaged_array_index_falls_back_quietly(tmp_path, states, damage):
    _save(tmp_path, states, steps=(3, 4)).close()
    step_dir = tmp_path / "4"
    victim = (step_dir / "state" / "manifest.ocdbt" if damage.endswith(".ocdbt")
              else next((step_dir / "state" / "d").iterdir()))
    if damage.startswith("delete"):
        victim.unlink()
    else:
        os.truncate(victim, victim.stat().st_size // 2)
    restored, _, messages = _restore_with_warnings(Checkpointer(tmp_path), _abstract(states[4]))
    assert_bitwise(restored, states[3])
    reason = ("its array index (state/manifest.ocdbt) is missing" if damage.startswith("delete")
              else "its array index is unreadable")
    assert len(messages) == 1 and reason in messages[0], messages  # checked before orbax's concurrent reads
    # (tensorstore's tracebacks from those reads show only in a separate process: see test_train)


def test_a_tmp_folder_renamed_while_listing_is_not_a_stray_entry(tmp_path, states, monkeypatch):
    """orbax renames N.orbax-checkpoint-tmp-* to N between os.listdir and the is_dir check (another process of a
    multi-process run committing): the vanished name is not a non-checkpoint entry."""
    import jaxamp.checkpoint as checkpoint_mod

    ckpt = _save(tmp_path, states, steps=(1,))
    real = os.listdir
    monkeypatch.setattr(checkpoint_mod.os, "listdir", lambda d: [*real(d), "2.orbax-checkpoint-tmp-1764531000"])
    assert ckpt.save(states[2], CONFIG) is True
    ckpt.close()


# 4 -------------------------------------------------------------------------------------------------------------


def test_empty_newest_folder_is_skipped(tmp_path, states):
    ckpt = _save(tmp_path, states, steps=(3, 4))
    (tmp_path / "999").mkdir()
    assert ckpt.steps() == [3, 4, 999]
    restored, _, messages = _restore_with_warnings(ckpt, _abstract(states[4]))
    assert_bitwise(restored, states[4])
    assert messages == [f"checkpoint step 999 in {tmp_path} is unusable (empty step folder); trying the previous one"]
    # orbax would silently refuse to save below the empty folder: the Checkpointer says so instead.
    with pytest.raises(CheckpointError, match=r"cannot save step 5 .* newer step folders \[999\]"):
        ckpt.save(states[5], CONFIG)
    (tmp_path / "999").rmdir()
    assert ckpt.save(states[4], CONFIG) is False  # already on disk: never overwritten
    assert ckpt.save(states[5], CONFIG) is True
    ckpt.close()
    assert Checkpointer(tmp_path).steps() == [3, 4, 5]


# 5 -------------------------------------------------------------------------------------------------------------


def test_all_steps_broken_raises(tmp_path, states):
    _save(tmp_path, states, steps=(2, 3, 4)).close()
    victim = _data_files(tmp_path / "4")[-1]
    os.truncate(victim, victim.stat().st_size // 3)
    (tmp_path / "3" / "integrity" / "metadata").unlink()
    for p in sorted((tmp_path / "2").rglob("*"), key=lambda p: -len(p.parts)):
        p.unlink() if p.is_file() else p.rmdir()
    ckpt = Checkpointer(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError) as info:
            ckpt.restore(_abstract(states[4]))
    assert not isinstance(info.value, CheckpointMismatchError)
    msg = str(info.value)
    assert msg.startswith(f"no usable checkpoint in {tmp_path}")
    for n in (2, 3, 4):
        assert f"step {n} ({tmp_path / str(n)})" in msg
    assert "empty step folder" in msg and "integrity record" in msg
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        Checkpointer(tmp_path / "nothing").restore(_abstract(states[4]))


# 6 -------------------------------------------------------------------------------------------------------------


def test_mismatch_raises_and_touches_nothing(tmp_path, states):
    _save(tmp_path, states, steps=(4, 5)).close()
    before = _snapshot(tmp_path)
    ckpt = Checkpointer(tmp_path)
    target = _abstract(states[5])

    with pytest.raises(CheckpointMismatchError) as info:
        ckpt.restore(target, dict(CONFIG, width=256), match_keys=("lr", "width"))
    assert str(info.value) == ("checkpoint at step 5 was saved with width=64 but this run has width=256; "
                               "use another checkpoint directory (--workdir) or the same settings")
    with pytest.raises(CheckpointMismatchError, match=r"layers=\[16, 64, 64, 1\] but this run has layers=\[16, 32\]"):
        ckpt.restore(target, dict(CONFIG, layers=(16, 32)), match_keys=("layers",))
    # Tuples compare equal to the lists JSON gives back.
    ckpt.restore(target, dict(CONFIG, layers=(16, 64, 64, 1)), match_keys=("layers",))

    other_ls = DynamicLossScale(2.0**10, growth_interval=3, min_loss_scale=1.0, max_loss_scale=2.0**20, hysteresis=2)
    with pytest.raises(CheckpointMismatchError,
                       match=r"loss_scale.min_loss_scale=0.015625 but this run has loss_scale.min_loss_scale=1.0"):
        ckpt.restore(target.replace(loss_scale=_abstract(other_ls)))
    with pytest.raises(CheckpointMismatchError, match=r"policy='fp16' but this run has policy='bf16'"):
        ckpt.restore(target.replace(policy=get_policy("bf16")))
    half = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float16), target.params)
    with pytest.raises(CheckpointMismatchError,
                       match=r"\.params\['dense1'\]\['bias'\] as float32\[64\] but this run has float16\[64\]"):
        ckpt.restore(target.replace(params=half))
    wider = dict(target.params, extra={"kernel": jax.ShapeDtypeStruct((2, 2), jnp.float32)})
    with pytest.raises(CheckpointMismatchError, match=r"lacks leaves \[\"\.params\['extra'\]\['kernel'\]\"\]"):
        ckpt.restore(target.replace(params=wider))
    ckpt.close()
    assert _snapshot(tmp_path) == before


def test_check_says_what_restore_would_do_and_reads_no_array(tmp_path, states, monkeypatch):
    """`check`: the step `restore` would take and the mismatch it would raise, from the JSON items alone."""
    _save(tmp_path, states, steps=(4, 5)).close()
    (tmp_path / "5" / "integrity" / "metadata").write_text("{}")  # step 5's record damaged: restore passes it over
    before = _snapshot(tmp_path)
    ckpt = Checkpointer(tmp_path)
    target = _abstract(states[4])
    monkeypatch.setattr(Checkpointer, "_read_arrays", lambda *a: pytest.fail("check read the arrays"))
    assert ckpt.check(target, dict(CONFIG), match_keys=("lr", "width")) == (4, None)
    assert ckpt.check(target, dict(CONFIG, width=256), match_keys=("width",)) == (
        4, "checkpoint at step 4 was saved with width=64 but this run has width=256; use another checkpoint "
           "directory (--workdir) or the same settings")
    step, problem = ckpt.check(target.replace(policy=get_policy("bf16")))
    assert step == 4 and "policy='fp16' but this run has policy='bf16'" in problem
    with pytest.raises(ValueError, match=r"match_keys \['depth'\] are not in expected_config"):
        ckpt.check(target, dict(CONFIG), match_keys=("depth",))
    with pytest.raises(CheckpointError, match="no checkpoint step 3"):
        ckpt.check(target, step=3)
    ckpt.close()
    assert _snapshot(tmp_path) == before
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="checkpoint step 5 .* is unusable"):  # restore agrees: step 4
        assert int(Checkpointer(tmp_path).restore(target)[0].step) == int(states[4].step)


# 7 -------------------------------------------------------------------------------------------------------------


def test_non_checkpoint_directory_is_refused(tmp_path, states):
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "foo").mkdir()
    (tmp_path / "12").mkdir()  # a step-like folder is fine
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=r"holds non-checkpoint entries: foo/, notes.txt; pass an empty"):
        Checkpointer(tmp_path)
    assert _snapshot(tmp_path) == before

    good = tmp_path / "run"
    ckpt = _save(good, states, steps=(4,))
    (good / "notes.txt").write_text("late")
    before = _snapshot(good)
    with pytest.raises(CheckpointError, match="non-checkpoint entries: notes.txt"):
        ckpt.restore(_abstract(states[4]))
    with pytest.raises(CheckpointError, match="non-checkpoint entries: notes.txt"):
        ckpt.save(states[5], CONFIG)
    ckpt.close()
    assert _snapshot(good) == before
    with pytest.raises(CheckpointError, match="is not a directory"):
        Checkpointer(good / "notes.txt")


# 8 -------------------------------------------------------------------------------------------------------------


def test_keep_two(tmp_path, states):
    ckpt = _save(tmp_path, states, steps=(1, 2, 3, 4), keep=2)
    assert ckpt.steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["3", "4"]
    ckpt.save(states[5], CONFIG)
    ckpt.close()
    assert sorted(os.listdir(tmp_path)) == ["4", "5"]
    restored, _ = Checkpointer(tmp_path).restore(_abstract(states[5]), step=4)
    assert_bitwise(restored, states[4])


def test_sync_save_and_no_checksums(tmp_path, states):
    ckpt = Checkpointer(tmp_path, async_save=False, checksums=False)
    assert ckpt.save(states[4], CONFIG)
    assert ckpt.steps() == [4]  # complete on return
    restored, _ = ckpt.restore(_abstract(states[4]))
    assert_bitwise(restored, states[4])
    with pytest.raises(CheckpointError, match="no checkpoint step 7"):
        ckpt.restore(_abstract(states[4]), step=7)
    with pytest.raises(ValueError, match="JSON-serializable"):
        ckpt.save(states[5], {"f": object()})
    ckpt.close()


# 9 -------------------------------------------------------------------------------------------------------------


def _child_env(devices: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    if devices > 1:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _run_child(*args, devices: int, timeout: float = 120) -> None:
    proc = subprocess.run([sys.executable, str(CHILD), *map(str, args)], env=_child_env(devices), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_sharded_over_8_devices_restores_on_1(tmp_path):
    ckpt_dir, saved, restored = tmp_path / "ckpt", tmp_path / "saved.json", tmp_path / "restored.json"
    _run_child("save_sharded", ckpt_dir, saved, devices=8)
    _run_child("restore_single", ckpt_dir, restored, devices=1)
    saved, restored = json.loads(saved.read_text()), json.loads(restored.read_text())
    assert saved["num_devices"] == 8 and restored["num_devices"] == 1
    assert restored["config"] == {"devices": 8}
    assert restored["digests"] == saved["digests"]  # dtype, shape and sha256 of every leaf
    assert restored["digests"][".step"][0] == "int32"


# 10 ------------------------------------------------------------------------------------------------------------


def _load_child_module():
    spec = importlib.util.spec_from_file_location("_ckpt_child", CHILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _digest_tree(state) -> dict:
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        arr = np.ascontiguousarray(np.asarray(jax.device_get(x)))
        out[jax.tree_util.keystr(path)] = [str(arr.dtype), list(arr.shape),
                                           hashlib.sha256(arr.reshape(-1).view(np.uint8)).hexdigest()]
    return out


@pytest.mark.slow
def test_kill_9_during_save_keeps_previous_step(tmp_path):
    child = _load_child_module()
    abstract = jax.eval_shape(lambda: child.big_state(BIG_MB))
    outcomes = []
    for trial, delay in enumerate([0.0, 0.15, 0.5]):
        ckpt_dir, digests_file = tmp_path / f"run{trial}", tmp_path / f"digests{trial}.json"
        proc = subprocess.Popen([sys.executable, str(CHILD), "big_save", str(ckpt_dir), str(BIG_MB),
                                 str(digests_file)], env=_child_env(1), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        try:
            line = ""
            while "SAVING2" not in line:
                line = proc.stdout.readline()
                assert line, "child exited before saving step 2"
            deadline = time.monotonic() + 10
            while not any(".orbax-checkpoint-tmp" in n or n == "2" for n in os.listdir(ckpt_dir)):
                assert time.monotonic() < deadline, "step 2 never started"
                time.sleep(0.002)
            time.sleep(delay)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
            proc.stdout.close()
        assert proc.returncode in (-signal.SIGKILL, 0)  # 0: step 2 finished and the child exited first
        interrupted = any(".orbax-checkpoint-tmp" in n for n in os.listdir(ckpt_dir))
        digests = json.loads(digests_file.read_text())
        ckpt = Checkpointer(ckpt_dir)
        assert ckpt.steps() in ([1], [1, 2])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a step 2 folder killed during finalization may be skipped
            restored, config = ckpt.restore(abstract)
        step = int(restored.step)
        assert step in ckpt.steps() and config == {"mb": BIG_MB}
        assert _digest_tree(restored) == digests[str(step)]
        outcomes.append((delay, interrupted, step))
        if trial == 2:  # saving goes on in the same directory; orbax removes the leftover tmp folder
            assert ckpt.save(restored.replace(step=jnp.asarray(3, jnp.int32)), {"mb": BIG_MB})
            ckpt.close()
            assert not any(".orbax-checkpoint-tmp" in n for n in os.listdir(ckpt_dir))
            assert ckpt.steps()[-1] == 3
        del restored
    assert any(interrupted and step == 1 for _, interrupted, step in outcomes), outcomes


# 11 ------------------------------------------------------------------------------------------------------------
# The public names, and the storage (orbax, tensorstore) apart from the integrity policy.

CHECKPOINT_NAMES = ("Checkpointer", "CheckpointError", "CheckpointMismatchError", "CheckpointSaveError")


def test_checkpointer_is_exported_from_jaxamp():
    import jaxamp
    import jaxamp.checkpoint as checkpoint_mod
    from jaxamp import Checkpointer as exported
    from jaxamp import CheckpointError as exported_error

    assert exported is Checkpointer and exported_error is CheckpointError
    for name in CHECKPOINT_NAMES:
        assert name in jaxamp.__all__ and name in dir(jaxamp)
        assert getattr(jaxamp, name) is getattr(checkpoint_mod, name) and name in checkpoint_mod.__all__
    assert issubclass(jaxamp.CheckpointMismatchError, CheckpointError)
    assert issubclass(jaxamp.CheckpointSaveError, CheckpointError)
    with pytest.raises(AttributeError, match="no attribute 'Checkpointerr'"):
        jaxamp.Checkpointerr  # noqa: B018


@pytest.mark.slow
def test_importing_jaxamp_does_not_import_orbax():
    """`jaxamp.Checkpointer` is imported on first use: orbax-checkpoint would add a second or two to `import jaxamp`."""
    code = ("import sys, jaxamp; assert not [m for m in sys.modules if m.split('.')[0] in ('orbax', 'tensorstore')]; "
            "jaxamp.Checkpointer; assert 'orbax.checkpoint' in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], env=_child_env(1), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _section_names(doc: str) -> set[str]:
    return {line.strip()[:-1] for line in doc.splitlines() if line.strip() in ("Args:", "Returns:", "Raises:")}


def test_checkpointer_is_documented():
    """Google-style docstrings: the class says what is saved, the layout, the guarantees and the orbax version it was
    written for; each public method has Args when it takes arguments and Returns when it returns a value."""
    doc = inspect.getdoc(Checkpointer)
    for part in ("What is saved.", "Directory layout", "Integrity guarantees:", "orbax-checkpoint 0.12.8", "Args:",
                 "Raises:"):
        assert part in doc, part
    for name, member in vars(Checkpointer).items():
        if name.startswith("_") or isinstance(member, property):
            continue
        doc = inspect.getdoc(member) or ""
        signature = inspect.signature(member)
        sections = _section_names(doc)
        assert doc, name
        if len(signature.parameters) > 1:
            assert "Args" in sections, name
        if signature.return_annotation not in ("None", None):
            assert "Returns" in sections, name


# checkpoint_quiet.py imports them too, but calls nothing in them: it reads their source folders (`__file__`) to
# filter their log records and unraisable-exception reports (orbax's and tensorstore's failure reports).
STORAGE_LIBRARIES = ("orbax", "tensorstore")
MAY_IMPORT_STORAGE = {"checkpoint_storage.py", "checkpoint_quiet.py"}


def _imports_a_literal(call: ast.Call) -> bool:
    """`__import__("name")` or `importlib.import_module("name")` (any alias of importlib)."""
    func = getattr(call.func, "id", None) or getattr(call.func, "attr", None)
    named = bool(call.args) and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)
    return named and func in ("__import__", "import_module")


def _storage_imports(source: str) -> list[tuple[str, int]]:
    """`(module, line)` of every import of orbax or tensorstore in `source`, wherever it stands (in a function,
    under `if TYPE_CHECKING:`), `importlib.import_module("...")` and `__import__("...")` of a literal name included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        elif isinstance(node, ast.Call) and _imports_a_literal(node):
            names = [node.args[0].value]
        else:
            continue
        found += [(n, node.lineno) for n in names if n.split(".")[0] in STORAGE_LIBRARIES]
    return sorted(found, key=lambda hit: hit[1])


def test_only_the_storage_module_imports_orbax_or_tensorstore():
    package = ROOT / "jaxamp"
    found = {p.relative_to(package).as_posix(): _storage_imports(p.read_text(encoding="utf-8"))
             for p in sorted(package.rglob("*.py"))}
    bad = [f"jaxamp/{path}:{line} imports {module}" for path, hits in found.items() if path not in MAY_IMPORT_STORAGE
           for module, line in hits]
    assert not bad, "orbax and tensorstore belong in jaxamp/checkpoint_storage.py:\n" + "\n".join(bad)
    assert {m for m, _ in found["checkpoint_storage.py"]} == {"orbax.checkpoint", "tensorstore"}


def test_the_storage_import_check_can_fail():
    source = ("import os\nimport orbax.checkpoint as ocp\ndef f():\n    from tensorstore import KvStore\n"
              "    importlib.import_module('orbax.checkpoint.args')\nfrom orbaxish import x\nfrom . import orbax\n"
              "if TYPE_CHECKING:\n    import numpy, tensorstore.ocdbt\n")
    assert _storage_imports(source) == [("orbax.checkpoint", 2), ("tensorstore", 4), ("orbax.checkpoint.args", 5),
                                        ("tensorstore.ocdbt", 9)]


def test_storage_round_trip_and_read_errors(tmp_path, states):
    """The storage interface on its own: items written by a Writer read back by a Reader as stored (nothing is
    checked there), every failed read one ReadError line, the folders listed as orbax names them."""
    from jaxamp import checkpoint_storage as storage

    writer = storage.Writer(tmp_path, keep=2, async_save=False)
    assert writer.save(4, state=states[4], config={"a": 1}, integrity={"not": "checked"}, metrics=[{"step": 4}])
    writer.close()
    (tmp_path / "7.orbax-checkpoint-tmp-1764531000").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    assert storage.step_numbers(tmp_path) == [4] and storage.interrupted_steps(tmp_path) == [7]
    assert storage.stray_entries(tmp_path) == ["notes.txt"]
    with storage.Reader(tmp_path) as reader:
        assert reader.read_settings(4) == ({"a": 1}, {"not": "checked"})
        assert reader.read_metrics(4) == [{"step": 4}]
        reader.check_array_index(4)
        assert_bitwise(reader.read_state(4, storage.restore_target(_abstract(states[4]))), states[4])
        with pytest.raises(storage.ReadError) as info:
            reader.read_settings(5)
    assert "\n" not in str(info.value) and not isinstance(info.value, storage.ArrayIndexMissing)
    (tmp_path / "4" / "state" / "manifest.ocdbt").unlink()
    with storage.Reader(tmp_path) as reader, pytest.raises(storage.ArrayIndexMissing, match="^state/manifest.ocdbt$"):
        reader.check_array_index(4)
    with pytest.raises(ValueError, match="must be jax.ShapeDtypeStruct"):
        storage.restore_target({"w": object()})
