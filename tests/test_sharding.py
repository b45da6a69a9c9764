"""Scale-out: meshes, data-parallel and FSDP steps, a global overflow skip, sharded checkpoints, two processes.

Device counts are fixed when JAX starts, so the multi-device checks run in child processes with fake CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=N), all started at once by one fixture:

- `_sharding_child.py mesh8` (8 devices): 1 device vs data=8 vs data=2,fsdp=4; an inf on one device's rows; an
  FSDP checkpoint; compile count;
- `_sharding_child.py train4` (4 devices): experiments/train_lm.py --mesh data=4 in one process, then a restore of
  the 8-device checkpoint onto data=2,fsdp=2;
- two processes of experiments/train_lm.py (2 devices each) joined by jax.distributed on 127.0.0.1, --mesh data=4.

This process (1 device) then restores the 8-device checkpoint and resumes the two-process run.
"""

import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxamp import sharding as shd
from jaxamp.checkpoint import Checkpointer
from jaxamp.lm.metrics_log import read_metrics
from jaxamp.lm.setup import build

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "_sharding_child.py"
SCRIPT = ROOT / "experiments" / "train_lm.py"
sys.path.insert(0, str(SCRIPT.parent))
import train_lm  # noqa: E402

TIMEOUT = 420


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                                                             "JAX_PROCESS_ID")}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    flags.append("--xla_backend_optimization_level=0")  # compiles about twice as fast; numerics as tested here
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _corpus(path: Path) -> Path:
    """A small deterministic text (no download, no dependence on the stdlib's sources)."""
    words = np.array("the cat sat on a mat and the dog ran far away from home\n".split(" "))
    path.write_text(" ".join(np.random.default_rng(0).choice(words, 6000)), encoding="utf-8")
    return path


def _train_args(corpus: Path) -> list[str]:
    # fp32 compute with a dynamic loss scale (it grows every 2 steps): the runs compared differ only by the order of
    # float32 sums in the collectives (gloo across processes, XLA within one), a few ulps.
    return ["--data", str(corpus), "--layers", "1", "--heads", "2", "--width", "32", "--seq-len", "16",
            "--batch-size", "8", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--decay-steps", "6",
            "--warmup-steps", "1", "--eval-every", "4", "--log-every", "2", "--checkpoint-every", "4",
            "--precision", "fp32", "--loss-scale", "dynamic", "--growth-interval", "2"]


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """Starts every child at once (they overlap on a loaded machine), waits, and returns their outputs."""
    tmp = tmp_path_factory.mktemp("sharding")
    corpus = _corpus(tmp / "corpus.txt")
    args = _train_args(corpus)
    paths = {"ckpt8": tmp / "ckpt8", "out8": tmp / "mesh8.json", "out4": tmp / "train4.json",
             "work4": tmp / "one_process", "work2": tmp / "two_processes", "corpus": corpus, "tmp": tmp}
    t0 = time.perf_counter()
    procs = {
        "mesh8": subprocess.Popen([sys.executable, str(CHILD), "mesh8", str(paths["ckpt8"]), str(paths["out8"])],
                                  env=_env(8), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        "train4": subprocess.Popen([sys.executable, str(CHILD), "train4", str(paths["out4"]), str(paths["out8"]),
                                    str(paths["ckpt8"]), "--", *args, "--mesh", "data=4", "--steps", "6",
                                    "--workdir", str(paths["work4"])],
                                   env=_env(4), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
    }
    port = _free_port()
    for i in range(2):
        procs[f"process{i}"] = subprocess.Popen(
            [sys.executable, str(SCRIPT), *args, "--mesh", "data=4", "--steps", "4", "--workdir", str(paths["work2"]),
             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
            env=_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outputs = {}
    paths["resumed"] = tmp / "resumed_single"
    try:
        for name in ["process0", "process1", "resume", "damaged0", "damaged1", "mesh8", "train4"]:
            if name == "resume":  # the two-process run's checkpoint, resumed by one process on one device
                shutil.copytree(paths["work2"], paths["resumed"])
                procs[name] = subprocess.Popen(
                    [sys.executable, str(SCRIPT), *args, "--steps", "6", "--workdir", str(paths["resumed"])],
                    env=_env(1), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if name == "damaged0":  # that run, its newest step damaged, resumed by two processes again
                procs.update(_start_damaged_resume(paths, args))
            out, err = procs[name].communicate(timeout=max(1.0, TIMEOUT - (time.perf_counter() - t0)))
            outputs[name] = {"code": procs[name].returncode, "stdout": out, "stderr": err,
                             "done_after_s": time.perf_counter() - t0}
            assert name in ("resume", "damaged0") or outputs[name]["code"] == 0, f"{name} failed:\n{err[-4000:]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, result in outputs.items():
        assert result["code"] == 0, f"{name} failed:\n{result['stderr'][-4000:]}"
    (tmp / "timings.json").write_text(json.dumps({k: v["done_after_s"] for k, v in outputs.items()}))
    return {"paths": paths, "outputs": outputs, "args": args, "seconds": time.perf_counter() - t0,
            "mesh8": json.loads(paths["out8"].read_text()), "train4": json.loads(paths["out4"].read_text())}


def _start_damaged_resume(paths: dict, args: list[str]) -> dict:
    """Copies the one-process resumed run (steps 4 and 6 on disk), deletes step 6's integrity record and starts two
    processes that resume it to step 8: both must fall back to step 4, and only process 0 may move step 6 aside."""
    paths["damaged"] = paths["tmp"] / "damaged_two_processes"
    shutil.copytree(paths["resumed"], paths["damaged"])
    record = paths["damaged"] / "checkpoints" / "6" / "integrity" / "metadata"
    assert record.is_file(), sorted(p.name for p in (paths["damaged"] / "checkpoints").iterdir())
    record.unlink()
    port = _free_port()
    return {f"damaged{i}": subprocess.Popen(
        [sys.executable, str(SCRIPT), *args, "--mesh", "data=4", "--steps", "8", "--workdir", str(paths["damaged"]),
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
        env=_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)}


def _child_module():
    spec = importlib.util.spec_from_file_location("_sharding_child", CHILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _restored(args: list[str], workdir: Path, step: int):
    """Step `step` of workdir's checkpoints, restored onto this process's one device."""
    cfg = train_lm.parse_args([*args, "--workdir", str(workdir)])
    abstract = jax.eval_shape(lambda: build(cfg).state)
    with Checkpointer(workdir / "checkpoints") as ckpt:
        state, _ = ckpt.restore(abstract, step=step)
    return state


# ---- the spec and the mesh (this process, 1 device) ------------------------------------------------------------


@pytest.mark.parametrize("spec, expected", [
    ("data=8", {"data": 8, "fsdp": 1}),
    ("data=2,fsdp=4", {"data": 2, "fsdp": 4}),
    (" fsdp = 4 , data = 2 ", {"data": 2, "fsdp": 4}),
    ("fsdp=2", {"data": 1, "fsdp": 2}),
])
def test_parse_mesh_spec(spec, expected):
    assert shd.parse_mesh_spec(spec) == expected


@pytest.mark.parametrize("spec, message", [
    ("", "at least one axis"),
    ("data", "not AXIS=SIZE"),
    ("=4", "not AXIS=SIZE"),
    ("model=2", "unknown axis 'model'; the axes are data and fsdp"),
    ("data=2,data=2", "given twice"),
    ("data=two", "must be an integer >= 1, got 'two'"),
    ("data=1.5", "must be an integer >= 1, got '1.5'"),
    ("data=0", "must be an integer >= 1, got 0"),
    ("data=-2", "must be an integer >= 1, got '-2'"),
    ("data=\u0664", "must be an integer >= 1, got '\u0664'"),  # an Arabic-Indic four
    ("data=4_0", "must be an integer >= 1, got '4_0'"),
])
def test_parse_mesh_spec_errors(spec, message):
    with pytest.raises(ValueError, match="--mesh") as err:
        shd.parse_mesh_spec(spec)
    assert message in str(err.value)


def test_make_mesh_on_one_device():
    mesh = shd.make_mesh("data=1")
    assert mesh.axis_names == ("data", "fsdp") and dict(mesh.shape) == {"data": 1, "fsdp": 1}
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
    with pytest.raises(ValueError, match=r"--mesh data=2,fsdp=4 needs 8 devices but this run has 1"):
        shd.make_mesh("data=2,fsdp=4")


def test_leaf_sharding_rule():
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "fsdp"))  # the rule reads only the mesh's shape
    spec = lambda shape: tuple(shd.leaf_sharding(shape, mesh).spec)
    assert spec((65, 128)) == (None, "fsdp")  # 65 does not divide by 4
    assert spec((512, 128)) == ("fsdp", None)  # the largest divisible dimension
    assert spec((3, 5)) == () and spec(()) == () and spec((2,)) == ()  # nothing divides: replicated


@pytest.mark.parametrize("flags, message", [
    (["--mesh", "model=2"], "unknown axis 'model'"),
    (["--mesh", "data=x"], "must be an integer"),
    (["--mesh", "data=3"], "--batch-size (8, the global batch) must be divisible by the 3 devices"),
    (["--mesh", "data=2"], "--mesh data=2 needs 2 devices but this run has 1"),
    (["--coordinator", "127.0.0.1:1234"], "go together"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0", "--mesh", "data=2"], "HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2", "--mesh", "data=2"], "--process-id"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "1"], "several processes need --mesh"),
])
def test_cli_scale_out_errors_are_one_line(tmp_path, capsys, flags, message):
    corpus = _corpus(tmp_path / "corpus.txt")
    code = train_lm.main([*_train_args(corpus), *flags, "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err and message in err, err


# ---- 8 devices -------------------------------------------------------------------------------------------------


def _close(a: list[dict], b: list[dict], key: str, rtol: float) -> None:
    np.testing.assert_allclose([m[key] for m in a], [m[key] for m in b], rtol=rtol, err_msg=key)


@pytest.mark.slow
def test_data_parallel_and_fsdp_match_one_device(children):
    r = children["mesh8"]
    # fp32 + SGD (update linear in the gradient): the sharded runs agree with one device to float32 rounding.
    sgd = r["fp32_sgd"]
    for pair in ("dp_vs_one", "fsdp_vs_dp"):
        assert sgd[pair]["max_rel_leaf"] < 1e-5, (pair, sgd[pair])
    for other in ("dp", "fsdp"):
        _close(sgd["metrics"][other], sgd["metrics"]["one"], "loss", 1e-6)
        _close(sgd["metrics"][other], sgd["metrics"]["one"], "grad_norm", 1e-6)
    # fp16 compute + DynamicLossScale + clip + AdamW. Each device's float16 weight gradient is rounded to float16
    # before the cross-device sum, so gradients agree to float16 rounding (grad_norm to ~1e-4), losses to ~1e-6;
    # Adam's m/sqrt(v) turns that noise on near-zero gradient entries into sign flips, so a few params differ by up
    # to ~lr per step while the typical one agrees to ~1e-4 of its update.
    amp = r["fp16_adamw"]
    for other in ("dp", "fsdp"):
        _close(amp["metrics"][other], amp["metrics"]["one"], "loss", 1e-5)
        _close(amp["metrics"][other], amp["metrics"]["one"], "grad_norm", 1e-3)
        assert [m["loss_scale"] for m in amp["metrics"][other]] == [m["loss_scale"] for m in amp["metrics"]["one"]]
        assert all(m["grads_finite"] for m in amp["metrics"][other])
    assert [m["loss_scale"] for m in amp["metrics"]["one"]] == [2.0**15, 2.0**15, 2.0**16]  # grew at step 2
    for pair in ("dp_vs_one", "fsdp_vs_dp"):
        d = amp[pair]
        assert d["median_abs"] < 2e-3 * d["median_update"], (pair, d)
        assert d["max_abs"] <= 2 * 3e-3 * 3, (pair, d)  # at most a sign flip of every Adam step (lr 3e-3, 3 steps)
    assert sgd["steps"] == amp["steps"] == [3, 3, 3]


@pytest.mark.slow
def test_fsdp_shards_params_and_optimizer_state(children):
    r = children["mesh8"]
    specs = r["fsdp_specs"]
    assert specs["['wte']['embedding']"] == "P('fsdp', None)"  # vocab 40 divides by 4, is larger than width 32
    assert specs["['h_0']['mlp']['c_fc']['kernel']"] == "P(None, 'fsdp')"  # [32, 128]: the larger dimension
    assert all("fsdp" in s for s in specs.values())  # every param of this model has a dimension divisible by 4
    assert r["wte"] == {"shape": [40, 32], "shard_shape": [10, 32], "devices": 8}
    assert "P()" in r["opt_state_specs"] and any("fsdp" in s for s in r["opt_state_specs"])  # counts / moments
    assert r["scalar_specs"] == ["P()"]  # step, loss scale and rng: replicated global arrays


@pytest.mark.slow
def test_inf_on_one_device_skips_the_step_on_every_device(children):
    p = children["mesh8"]["poison"]
    assert p["device_id"] == 3 and p["rows"] == [6, 7] and p["nonfinite_shard_devices"] == [3]
    assert p["grads_finite"] is False
    assert p["unchanged"]  # params and optimizer state bitwise as before the step
    # The loss itself is not finite (an inf row weight): no scale fixes that, so the scale is left as it was, the
    # same on all 8 devices (a gradient overflow backs it off, tests/test_step.py).
    assert p["scale_shards"] == [p["scale_before"]] * 8
    assert len(set(p["growth_counter_shards"])) == 1 and p["step_shards"] == [4] * 8


@pytest.mark.slow
def test_sharded_step_compiles_once(children):
    assert children["mesh8"]["compiled"] == 1  # 3 steps, an overflowed step, a restored state: one executable
    assert children["mesh8"]["restore_same_mesh_equal"]
    t4 = children["train4"]
    assert t4["code"] == 0 and t4["step_fns"] == 1 and t4["compiled"] == [1]  # train(): 6 steps, one compile


@pytest.mark.slow
def test_fsdp_checkpoint_restores_on_1_and_on_4_devices(children):
    saved = children["mesh8"]["saved_digests"]
    on4 = children["train4"]["restore"]
    assert on4["devices"] == 4 and on4["wte_devices"] == 4 and on4["wte_spec"] == "P('fsdp', None)"
    assert on4["digests"] == saved  # dtype, shape and sha256 of every leaf
    on1 = _child_module().restore("none", str(children["paths"]["ckpt8"]))
    assert on1["devices"] == 1 and on1["wte_devices"] == 1 and on1["config"] == {"mesh": "data=2,fsdp=4"}
    assert on1["digests"] == saved


# ---- several processes ------------------------------------------------------------------------------------------


def _assert_close_states(a, b, rtol: float) -> None:
    """Float leaves: max |a - b| <= rtol * max |b| per leaf; other leaves (step, counts, rng) bitwise equal."""
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        if np.issubdtype(x.dtype, np.floating):
            diff = float(np.max(np.abs(x.astype(np.float64) - y))) if x.size else 0.0
            assert diff <= rtol * float(np.max(np.abs(y), initial=0.0)), (jax.tree_util.keystr(path), diff)
        else:
            assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)


@pytest.mark.slow
def test_two_processes_match_one_process(children):
    paths, outputs = children["paths"], children["outputs"]
    main, other = outputs["process0"]["stdout"], outputs["process1"]["stdout"]
    assert "mesh data=4,fsdp=1 over 4 devices (2 process(es)), global batch 8" in main
    assert "summary: precision=fp32 steps=4" in main
    assert [line for line in other.splitlines() if not line.startswith("[Gloo]")] == [], other  # process 1: silent
    two, one = read_metrics(paths["work2"] / "metrics.jsonl"), read_metrics(paths["work4"] / "metrics.jsonl")
    assert [r["step"] for r in two] == [1, 2, 3, 4]  # written once, by process 0
    exact = ("step", "loss_scale", "grads_finite", "lr", "skipped_steps")
    assert [{k: r[k] for k in exact} for r in two] == [{k: r[k] for k in exact} for r in one[:4]]
    assert [r["loss_scale"] for r in two] == [2.0**15, 2.0**15, 2.0**16, 2.0**16]  # the scale each step used
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in two], [r[key] for r in one[:4]], rtol=1e-6, err_msg=key)
    assert two[-1]["val_loss"] == pytest.approx(one[3]["val_loss"], rel=1e-6)
    assert json.loads((paths["work2"] / "summary.json").read_text())["steps"] == 4
    # Same state up to the order of float32 sums in the all-reduce (measured: a few ulps, max 7e-9 on params).
    _assert_close_states(_restored(children["args"], paths["work2"], 4),
                         _restored(children["args"], paths["work4"], 4), rtol=1e-5)


@pytest.mark.slow
def test_two_process_checkpoint_resumes_in_one_process(children):
    paths = children["paths"]
    assert "resumed from step 4" in children["outputs"]["resume"]["stdout"]
    ours, ref = read_metrics(paths["resumed"] / "metrics.jsonl"), read_metrics(paths["work4"] / "metrics.jsonl")
    assert [r["step"] for r in ours] == list(range(1, 7))
    # Steps 5-6 ran on 1 device here and on 4 there: float32 rounding apart.
    np.testing.assert_allclose([r["loss"] for r in ours[4:]], [r["loss"] for r in ref[4:]], rtol=1e-5)
    assert [r["loss_scale"] for r in ours] == [r["loss_scale"] for r in ref]
    assert math.isfinite(ours[-1]["val_loss"])


@pytest.mark.slow
def test_two_processes_resume_past_a_damaged_step_and_set_it_aside_once(children):
    paths, outputs = children["paths"], children["outputs"]
    main, other = outputs["damaged0"], outputs["damaged1"]
    assert "resumed from step 4" in main["stdout"]
    assert "checkpoint step 6" in main["stderr"] and "is unusable" in main["stderr"]
    moved = [line for line in (main["stderr"] + other["stderr"]).splitlines() if "moved unusable checkpoint" in line]
    assert len(moved) == 1 and "step 6" in moved[0], moved  # one process moved it, the other did not try
    assert sorted(p.name for p in (paths["damaged"] / "unusable-checkpoints").iterdir()) == ["6"]
    records = read_metrics(paths["damaged"] / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))  # steps 5-6 replaced, none duplicated or missing
    assert Checkpointer(paths["damaged"] / "checkpoints").steps() == [4, 8]  # and step 8 saved (every 4 steps)


@pytest.mark.slow
def test_two_processes_on_a_busy_workdir_are_both_refused(children, tmp_path):
    """Process 0 holds the workdir lock for the run and tells process 1 whether it got it: a second two-process run
    on a busy workdir ends in both processes with the same one-line error, and changes no file."""
    from jaxamp.lm.workdir import WorkdirLock

    busy = tmp_path / "busy"
    shutil.copytree(children["paths"]["work2"], busy)
    snapshot = lambda: sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in busy.rglob("*"))
    port = _free_port()
    with WorkdirLock(busy):  # the first run, still going
        before = snapshot()
        procs = [subprocess.Popen(
            [sys.executable, str(SCRIPT), *children["args"], "--mesh", "data=4", "--steps", "6", "--workdir",
             str(busy), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
            env=_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
        try:
            results = [proc.communicate(timeout=240) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for proc, (_, err) in zip(procs, results):
            assert proc.returncode == 2, err[-3000:]
            expected = (f"error: --workdir {busy} is in use by another run (it holds {busy / 'lock'}); wait for it "
                        "to end or pass another directory")
            assert err.strip().splitlines()[-1] == expected, err[-3000:]
        assert snapshot() == before
