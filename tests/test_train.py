"""End to end: experiments/train_lm.py trains, logs, rejects bad input, checkpoints and resumes to the bit."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp.checkpoint import Checkpointer
from jaxamp.lm.config import TrainConfig
from jaxamp.lm.metrics_log import read_metrics
from jaxamp.lm.setup import build

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "train_lm.py"
sys.path.insert(0, str(SCRIPT.parent))
import train_lm  # noqa: E402

TINY = ["--layers", "2", "--heads", "2", "--width", "32", "--seq-len", "32", "--batch-size", "8",
        "--eval-batches", "4", "--sample-tokens", "20", "--no-progress"]


@pytest.fixture(scope="session")  # (not module: conftest would put every test using it on one xdist worker)
def corpus(text_corpus):
    """60,000 characters of tinyshakespeare, or of the stdlib's sources where ../shared is absent (conftest)."""
    return text_corpus


def cli(*args, timeout=240):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_fp16_run_lowers_loss_and_writes_metrics(corpus, tmp_path, capsys):
    workdir = tmp_path / "run"
    code = train_lm.main(["--data", str(corpus), "--precision", "fp16", "--steps", "30", "--warmup-steps", "5",
                          "--lr", "3e-3", "--eval-every", "15", "--log-every", "4", "--workdir", str(workdir), *TINY])
    out = capsys.readouterr().out
    assert code == 0
    records = read_metrics(workdir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 31))
    for key in ("loss", "loss_scale", "grads_finite", "grad_norm", "lr", "tokens_per_s", "skipped_steps"):
        assert all(key in r for r in records), key
    assert [r["step"] for r in records if "val_loss" in r] == [15, 30]
    assert records[0]["lr"] == pytest.approx(3e-3 / 6) and records[5]["lr"] == pytest.approx(3e-3, rel=1e-6)  # warmup
    assert all(r["loss_scale"] >= 1.0 for r in records)
    first, last = records[0]["loss"], np.mean([r["loss"] for r in records[-5:]])
    assert last < first - 0.5, (first, last)
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["precision"] == "fp16" and summary["loss_scale_kind"] == "DynamicLossScale"
    assert summary["steps"] == 30 and summary["val_loss"] == records[-1]["val_loss"]
    assert "parameters" in out and "256 tokens per step" in out and "sample:" in out and "summary:" in out
    scalars = tensorboard_scalars(workdir / "tb")
    assert [step for step, _ in scalars["train/loss_scale"]] == list(range(1, 31))
    assert [v for _, v in scalars["train/loss_scale"]] == [r["loss_scale"] for r in records]
    assert {"train/loss", "val/loss", "train/grads_finite", "train/skipped_steps", "train/lr"} <= set(scalars)


def tensorboard_scalars(logdir) -> dict:
    """{tag: [(step, value)]} read back from the TFRecord event files tensorboardX wrote."""
    import struct

    from tensorboardX.proto import event_pb2

    out = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_tensorboard_keeps_every_step_across_a_resume_within_one_second(tmp_path):
    """tensorboardX names event files by the second: a resumed logger must not truncate the first one's file."""
    from jaxamp.lm.metrics_log import MetricsLogger

    record = lambda step: {"step": step, "loss": 5.0 - step, "loss_scale": 2.0**15, "grads_finite": True,
                           "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1.0}
    first = MetricsLogger(tmp_path)
    first.write([record(s) for s in (1, 2, 3, 4)])
    first.close()
    second = MetricsLogger(tmp_path, resume_step=2)  # steps 3-4 are dropped and written again
    second.write([record(s) for s in (3, 4, 5)])
    second.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    steps = sorted({step for step, _ in tensorboard_scalars(tmp_path / "tb")["train/loss"]})
    assert steps == [1, 2, 3, 4, 5]
    # A run that starts over (killed before its first checkpoint) purges every earlier point in TensorBoard too:
    # each event file opens with a SessionLog.START at resume_step + 1, which TensorBoard reads as "drop the
    # earlier files' points from this step on".
    MetricsLogger(tmp_path, resume_step=0).close()
    newest = max((tmp_path / "tb").glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns)
    assert session_starts(newest) == [1]


def session_starts(path) -> list[int]:
    """Steps of the SessionLog.START events (TensorBoard's purge markers) in one event file."""
    import struct

    from tensorboardX.proto import event_pb2

    data, pos, starts = Path(path).read_bytes(), 0, []
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
        pos += 12 + length + 4
        if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
            starts.append(event.step)
    return starts


@pytest.mark.slow
def test_default_corpus_needs_no_download(tmp_path, capsys):
    code = train_lm.main(["--steps", "3", "--eval-every", "3", "--workdir", str(tmp_path / "run"), *TINY])
    assert code == 0
    assert "summary: precision=fp32 steps=3" in capsys.readouterr().out


def _bad_inputs(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"hello \xff\xfe world" * 100)
    short = tmp_path / "short.txt"
    short.write_text("tiny corpus")
    return [
        (["--data", str(tmp_path / "missing.txt")], "missing.txt"),
        (["--data", str(empty)], "empty"),
        (["--data", str(binary)], "UTF-8"),
        (["--data", str(short)], "too short"),
        (["--precision", "fp7"], "fp7"),
        (["--precision", "bf16;fp9"], "unknown policy rule"),
        (["--precision", "fp8", "--fp8-amax-history", "0"], "--fp8-amax-history"),
        (["--lr", "0"], "--lr"),
        (["--lr", "-1"], "--lr"),
        (["--steps", "0"], "--steps"),
        (["--batch-size", "-2"], "--batch-size"),
        (["--heads", "3"], "--heads (3) must divide --width (32)"),
        (["--seed", "-1"], "--seed"),
        (["--min-lr", "-0.01"], "--min-lr"),
        (["--min-lr", "1"], "--min-lr"),
        (["--beta1", "1.0"], "--beta1"),
        (["--beta2", "1.5"], "--beta2"),
        (["--weight-decay", "nan"], "--weight-decay must be >= 0, got nan"),
        (["--grad-clip", "-1"], "--grad-clip"),
    ]


def test_bad_inputs_give_one_line_errors(tmp_path, capsys):
    for args, expected in _bad_inputs(tmp_path):
        code = train_lm.main([*TINY, *args, "--workdir", str(tmp_path / "w")])
        err = capsys.readouterr().err.strip()
        assert code == 2, args
        assert err.startswith("error: ") and "\n" not in err and expected in err, (args, err)


def test_out_of_memory_at_build_is_one_line_with_the_bytes_it_needs(tmp_path, capsys, monkeypatch):
    """XLA's RESOURCE_EXHAUSTED while the weights and Adam state are created (gpt2-xl on a small device) is one
    line: the parameter count, the bytes per parameter and the fixes; no workdir is written."""
    import jaxamp.lm.setup as setup

    real, n = setup.init_variables, train_lm_params(TINY)

    def exhausted(model_cfg, key):
        if not isinstance(key, jax.core.Tracer):  # the real call runs out; eval_shape's count still works
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 40960000 bytes.")
        return real(model_cfg, key)

    monkeypatch.setattr(setup, "init_variables", exhausted)
    code = train_lm.main([*TINY, "--precision", "bf16;opt_state=bf16", "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith("error: out of memory creating the model's weights and optimizer state on ") and \
        f": {n:,} parameters x 8 bytes (float32 master weights and Adam moments) = " in err, err
    assert err.endswith("or ';opt_state=bf16' (8 bytes per parameter)") and not (tmp_path / "w").exists()


def train_lm_params(args) -> int:
    """The parameter count of the LM `args` build (the default corpus's vocabulary)."""
    from jaxamp.lm.model import count_params

    run = build(train_lm.parse_args([*args, "--steps", "1"]))
    return count_params(run.state.params)


def test_the_summary_line_says_which_step_a_stale_val_loss_is_from():
    from jaxamp.lm.log import summary_line

    summary = {"precision": "fp32", "steps": 140, "val_loss": 2.6272, "val_loss_step": 100, "train_loss": 2.5374,
               "skipped_steps": 0, "final_loss_scale": 1.0, "tokens_per_s": 8000.0, "wall_s": 10.0}
    assert "val_loss=2.6272 (step 100) train_loss=2.5374" in summary_line(summary)  # stopped between evaluations
    assert "val_loss=2.6272 train_loss" in summary_line({**summary, "val_loss_step": 140})


@pytest.mark.slow
def test_workdir_that_is_not_a_run_is_refused_untouched(tmp_path, capsys):
    (tmp_path / "thesis.tex").write_text("precious")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "notes.txt").write_text("not a checkpoint")
    before = sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    assert train_lm.main([*TINY, "--steps", "2", "--workdir", str(tmp_path)]) == 2
    assert "thesis.tex" in capsys.readouterr().err
    (tmp_path / "thesis.tex").unlink()
    assert train_lm.main([*TINY, "--steps", "2", "--workdir", str(tmp_path)]) == 2
    assert "notes.txt" in capsys.readouterr().err
    assert sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == [
        b for b in before if "thesis.tex" not in b[0]]


def _quick(corpus) -> list[str]:
    """TINY on `corpus`, without the sample and with one validation batch: the fastest complete run."""
    return [*TINY, "--data", str(corpus), "--sample-tokens", "0", "--eval-batches", "1"]


def _small_corpus(path: Path) -> Path:
    words = np.array("to be or not to be that is the question whether tis nobler in the mind\n".split(" "))
    path.write_text(" ".join(np.random.default_rng(0).choice(words, 4000)), encoding="utf-8")
    return path


def test_cli_defaults_equal_the_config_defaults():
    """A run started from Python (TrainConfig defaults) and one from the CLI save the same settings."""
    assert train_lm.parse_args([]) == TrainConfig()
    assert train_lm.parse_args(["--bias"]).bias is True and train_lm.parse_args(["--no-bias"]).bias is False


@pytest.mark.slow
def test_previous_metrics_without_checkpoint_are_refused_untouched(tmp_path, capsys):
    corpus = _small_corpus(tmp_path / "corpus.txt")
    args = _quick(corpus)
    workdir = tmp_path / "run"
    assert train_lm.main([*args, "--steps", "4", "--workdir", str(workdir)]) == 0
    shutil.rmtree(workdir / "checkpoints")
    snapshot = lambda: sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in workdir.rglob("*"))
    before = snapshot()
    capsys.readouterr()
    assert train_lm.main([*args, "--steps", "2", "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no checkpoint to resume from" in err and "steps up to 4" in err and "\n" not in err
    assert snapshot() == before
    # Killed before its first checkpoint (no summary, records short of --checkpoint-every): it starts over and
    # recomputes the very same records.
    old = read_metrics(workdir / "metrics.jsonl")
    (workdir / "summary.json").unlink()
    assert train_lm.main([*args, "--steps", "4", "--workdir", str(workdir)]) == 0
    strip = lambda rs: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rs]
    assert strip(read_metrics(workdir / "metrics.jsonl")) == strip(old)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for text, expected in (("not json\nat all\n", "line 1 is not JSON"), ('{"loss": 1}\n', 'no integer "step"')):
        (foreign / "metrics.jsonl").write_text(text)
        assert train_lm.main([*args, "--steps", "2", "--workdir", str(foreign)]) == 2
        assert expected in capsys.readouterr().err
        assert (foreign / "metrics.jsonl").read_text() == text and sorted(foreign.iterdir()) == [
            foreign / "metrics.jsonl"]


@pytest.mark.slow
def test_a_first_save_cut_short_starts_over(tmp_path, capsys):
    """Killed (or out of disk) while its first checkpoint was still being written: only orbax's tmp folder is left,
    with records past --checkpoint-every. The same command starts over and writes the very same records."""
    corpus = _small_corpus(tmp_path / "corpus.txt")
    args = [*_quick(corpus), "--steps", "4", "--checkpoint-every", "2", "--eval-every", "2", "--log-every", "1"]
    reference = tmp_path / "reference"
    assert train_lm.main([*args, "--workdir", str(reference)]) == 0
    workdir = tmp_path / "cut"
    shutil.copytree(reference, workdir)
    (workdir / "summary.json").unlink()
    shutil.rmtree(workdir / "checkpoints" / "4")
    (workdir / "checkpoints" / "2").rename(workdir / "checkpoints" / "2.orbax-checkpoint-tmp-1764531000")
    capsys.readouterr()
    assert train_lm.main([*args, "--workdir", str(workdir)]) == 0
    assert "resumed" not in capsys.readouterr().out
    strip = lambda rs: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rs]
    assert strip(read_metrics(workdir / "metrics.jsonl")) == strip(read_metrics(reference / "metrics.jsonl"))
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4"]  # the tmp folder is gone
    # A later save cut short (step 4 > --checkpoint-every 2) after the committed steps were removed is not a first
    # save: the workdir is refused, untouched, as any workdir whose checkpoints are gone.
    later = tmp_path / "later"
    shutil.copytree(reference, later)
    (later / "summary.json").unlink()
    shutil.rmtree(later / "checkpoints" / "2")
    (later / "checkpoints" / "4").rename(later / "checkpoints" / "4.orbax-checkpoint-tmp-1764531000")
    snapshot = lambda: sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in later.rglob("*"))
    before = snapshot()
    assert train_lm.main([*args, "--workdir", str(later)]) == 2
    assert "no checkpoint to resume from" in capsys.readouterr().err
    assert snapshot() == before


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_falls_back_quietly(tmp_path):
    """A truncated OCDBT manifest: one warning and a resume from the previous step, not hundreds of tensorstore
    "Event loop is closed" tracebacks (they come from tensorstore's threads, so only a separate process shows them)."""
    corpus = _small_corpus(tmp_path / "corpus.txt")
    args = [*_quick(corpus), "--checkpoint-every", "2", "--eval-every", "2", "--workdir", tmp_path / "run"]
    first = cli(*args, "--steps", "4")
    assert first.returncode == 0, first.stderr
    manifest = tmp_path / "run" / "checkpoints" / "4" / "state" / "manifest.ocdbt"
    os.truncate(manifest, manifest.stat().st_size // 2)
    second = cli(*args, "--steps", "6")
    assert second.returncode == 0, second.stderr
    assert "resumed from step 2" in second.stdout and "checkpoint step 4" in second.stderr
    assert "Event loop is closed" not in second.stderr and "Traceback" not in second.stderr, second.stderr[:3000]
    lines = second.stderr.splitlines()  # one line per warning: step 4 unusable, then moved aside
    assert len(lines) == 2 and all(line.startswith("warning: ") for line in lines), lines


@pytest.mark.slow
def test_a_busy_or_unwritable_workdir_is_refused_untouched(tmp_path, capsys):
    from jaxamp.lm.workdir import WorkdirLock

    corpus = _small_corpus(tmp_path / "corpus.txt")
    args = [*_quick(corpus), "--steps", "2"]
    workdir = tmp_path / "run"
    assert train_lm.main([*args, "--workdir", str(workdir)]) == 0
    snapshot = lambda: sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in workdir.rglob("*"))
    with WorkdirLock(workdir):  # another run holds the workdir
        before = snapshot()
        capsys.readouterr()
        assert train_lm.main([*args, "--steps", "4", "--workdir", str(workdir)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"error: --workdir {workdir} is in use by another run (it holds {workdir / 'lock'}); wait "
                       "for it to end or pass another directory")
        assert snapshot() == before
    assert train_lm.main([*args, "--steps", "4", "--workdir", str(workdir)]) == 0  # released: it resumes
    odd = tmp_path / "odd"
    (odd / "lock").mkdir(parents=True)  # cannot be opened for writing, like a read-only workdir
    assert train_lm.main([*args, "--workdir", str(odd)]) == 2
    assert "cannot write in --workdir" in capsys.readouterr().err


@pytest.mark.slow
def test_a_filesystem_without_flock_runs_with_a_warning(tmp_path, capsys, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    corpus = _small_corpus(tmp_path / "corpus.txt")
    args = [*_quick(corpus), "--steps", "2"]
    assert train_lm.main([*args, "--workdir", str(tmp_path / "run")]) == 0
    assert "running without the guard against a second run" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before the first step", "during the last step", "after the loop"])
def test_signals_outside_the_loop_leave_a_consistent_run(tmp_path, capsys, monkeypatch, when):
    """SIGTERM before the first step saves step 0 and resumes; during the last step or after the loop (final save,
    summary) the run completes as if no signal had come: exit 0, stopped_by null."""
    import os as os_

    import jaxamp.lm.train as train_mod

    corpus = _small_corpus(tmp_path / "corpus.txt")
    args = [*_quick(corpus), "--steps", "3", "--workdir", str(tmp_path / "run")]
    term = lambda: os_.kill(os_.getpid(), signal.SIGTERM)
    if when == "before the first step":
        original = train_mod.resume_state
        monkeypatch.setattr(train_mod, "resume_state", lambda run, ckpt: (term(), original(run, ckpt))[1])
    elif when == "during the last step":
        original = train_mod._Loop.step
        monkeypatch.setattr(train_mod._Loop, "step",
                            lambda self, state, step: ((term() if step == 2 else None), original(self, state, step))[1])
    else:
        original = train_mod._summary
        monkeypatch.setattr(train_mod, "_summary", lambda *a: (term(), original(*a))[1])
    assert train_lm.main(args) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    if when == "before the first step":
        assert "stopped by SIGTERM after step 0" in out and summary["stopped_by"] == "SIGTERM"
        assert Checkpointer(tmp_path / "run" / "checkpoints").steps() == [0]
        monkeypatch.undo()
        assert train_lm.main(args) == 0
        assert "resumed from step 0" in capsys.readouterr().out
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    else:
        assert "stopped by" not in out
    assert summary["stopped_by"] is None and summary["steps"] == 3
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.slow
def test_rerunning_a_finished_run_changes_nothing(tmp_path, capsys):
    corpus = _small_corpus(tmp_path / "corpus.txt")
    args = [*_quick(corpus), "--workdir", str(tmp_path / "run")]
    assert train_lm.main([*args, "--steps", "4"]) == 0
    files = sorted(p for p in (tmp_path / "run").rglob("*") if p.is_file())
    before = {p: p.read_bytes() for p in files}
    capsys.readouterr()
    for steps in ("4", "2"):
        assert train_lm.main([*args, "--steps", steps]) == 0
        out = capsys.readouterr().out
        assert f"already holds step 4 (--steps {steps}): nothing to train" in out and "summary: " in out
        assert {p: p.read_bytes() for p in files} == before
    # A summary older than the checkpoint (killed between the last save and the summary) is rewritten.
    summary_path = tmp_path / "run" / "summary.json"
    summary_path.write_text(json.dumps({**json.loads(summary_path.read_text()), "steps": 3}))
    assert train_lm.main([*args, "--steps", "4"]) == 0
    assert f"warning: {summary_path} was damaged (it does not match its sha256); rewritten" in capsys.readouterr().err
    assert json.loads(summary_path.read_text())["steps"] == 4


@pytest.mark.slow
def test_half_precision_master_weights_train_from_the_cli(tmp_path, capsys):
    corpus = _small_corpus(tmp_path / "corpus.txt")
    workdir = tmp_path / "f16"
    code = train_lm.main([*_quick(corpus), "--steps", "6", "--precision", "float16", "--workdir", str(workdir)])
    assert code == 0
    assert "summary: precision=p=f16,c=f16,o=f16 steps=6" in capsys.readouterr().out
    cfg = train_lm.parse_args([*TINY, "--data", str(corpus), "--precision", "float16"])
    abstract = jax.eval_shape(lambda: build(cfg).state)
    with Checkpointer(workdir / "checkpoints") as ckpt:
        state, _ = ckpt.restore(abstract)
    weights_and_moments = jax.tree.leaves((state.params, state.opt_state[1].inner_state))
    floats = {x.dtype for x in weights_and_moments if jnp.issubdtype(x.dtype, jnp.floating)}
    assert floats == {jnp.dtype(jnp.float16)} and len(weights_and_moments) > 3 * len(jax.tree.leaves(state.params))
    hyper = state.opt_state[1].hyperparams
    assert hyper["b2"].dtype == jnp.float32  # 0.99 would round to 1.0 in bfloat16


@pytest.mark.slow
def test_bad_input_exits_without_traceback(tmp_path):
    result = cli("--data", tmp_path / "missing.txt", "--workdir", tmp_path / "w", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert "missing.txt" in result.stderr


# ---- checkpoint and exact resume -------------------------------------------------------------------------------

TOTAL = 300
RESUME = [*TINY, "--precision", "fp16", "--steps", TOTAL, "--decay-steps", TOTAL, "--init-scale", 2.0**24,
          "--growth-interval", 20, "--log-every", 1, "--eval-every", 50, "--checkpoint-every", 100,
          "--sample-tokens", 0]


def _with_steps(args, steps):
    args = list(args)
    args[args.index("--steps") + 1] = steps
    return args


def restored(workdir, corpus, **overrides):
    """The newest checkpoint in workdir, restored into the abstract state of the matching config."""
    cfg = TrainConfig(data=str(corpus), precision="fp16", layers=2, heads=2, width=32, seq_len=32, batch_size=8,
                      init_scale=2.0**24, growth_interval=20, **overrides)
    abstract = jax.eval_shape(lambda: build(cfg).state)
    ckpt = Checkpointer(Path(workdir) / "checkpoints")
    try:
        state, _ = ckpt.restore(abstract)
    finally:
        ckpt.close()
    return state


def assert_bitwise_equal(a, b):
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    result = cli("--data", corpus, "--workdir", workdir, *RESUME)
    assert result.returncode == 0, result.stderr
    return workdir


@pytest.mark.slow
def test_resume_in_new_process_is_bitwise(corpus, uninterrupted, tmp_path):
    workdir = tmp_path / "resumed"
    first = cli("--data", corpus, "--workdir", workdir, *_with_steps(RESUME, TOTAL // 2))
    assert first.returncode == 0, first.stderr
    second = cli("--data", corpus, "--workdir", workdir, *RESUME)
    assert second.returncode == 0, second.stderr
    assert f"resumed from step {TOTAL // 2}" in second.stdout
    ours, ref = read_metrics(workdir / "metrics.jsonl"), read_metrics(uninterrupted / "metrics.jsonl")
    assert [r["step"] for r in ours] == list(range(1, TOTAL + 1))  # no duplicate, no missing step
    assert sum(not r["grads_finite"] for r in ref) >= 1  # the run contains skipped steps
    strip = lambda rs: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rs]
    assert strip(ours) == strip(ref)
    assert_bitwise_equal(restored(workdir, corpus), restored(uninterrupted, corpus))


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_resumes_bitwise(corpus, uninterrupted, tmp_path):
    workdir = tmp_path / "preempted"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--data", str(corpus), "--workdir", str(workdir),
                             *map(str, RESUME)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while len(read_metrics(workdir / "metrics.jsonl")) < 5 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    sent = time.time()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert time.time() - sent < 20
    records = read_metrics(workdir / "metrics.jsonl")
    stopped_at = records[-1]["step"]
    assert stopped_at < TOTAL, "the run finished before SIGTERM arrived"
    assert f"stopped by SIGTERM after step {stopped_at}" in out
    ckpt = Checkpointer(workdir / "checkpoints")
    assert ckpt.latest_step() == stopped_at
    ckpt.close()
    resumed = cli("--data", corpus, "--workdir", workdir, *RESUME)
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in read_metrics(workdir / "metrics.jsonl")] == list(range(1, TOTAL + 1))
    assert_bitwise_equal(restored(workdir, corpus), restored(uninterrupted, corpus))


@pytest.mark.slow
@pytest.mark.parametrize("flag, ours, theirs", [("--width", "32", "64"), ("--accum-steps", "1", "2")])
def test_resume_with_other_settings_is_refused_untouched(corpus, uninterrupted, flag, ours, theirs):
    snapshot = lambda: sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in uninterrupted.rglob("*"))
    before = snapshot()
    args = [*RESUME, flag, ours] if flag not in RESUME else list(RESUME)
    args[args.index(flag) + 1] = theirs
    result = cli("--data", corpus, "--workdir", uninterrupted, *_with_steps(args, TOTAL + 10))
    assert result.returncode == 2
    assert flag[2:].replace("-", "_") in result.stderr and ours in result.stderr and theirs in result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot() == before


# ---- loss-scaling options of the experiment ------------------------------------------------------------------------

@pytest.mark.slow
def test_divergence_guard_stops_after_saving(corpus, tmp_path, capsys):
    workdir = tmp_path / "diverged"
    code = train_lm.main(["--data", str(corpus), "--precision", "fp16", "--loss-scale", "static", "--init-scale",
                          "1e30", "--steps", "40", "--max-consecutive-skips", "6", "--log-every", "2",
                          "--workdir", str(workdir), *TINY])
    err = capsys.readouterr().err.strip()
    assert code == 3
    assert err.startswith("error: training diverged at step 6: 6 consecutive skipped steps") and "\n" not in err
    assert re.search(r"gradient overflow in [a-z_0-9]+/", err), err  # leaf paths: "h_0/attn/c_attn/kernel"
    records = read_metrics(workdir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7)) and not any(r["grads_finite"] for r in records)
    assert all(r["loss_finite"] and r["nonfinite_leaves"] for r in records)
    ckpt = Checkpointer(workdir / "checkpoints")
    assert ckpt.latest_step() == 6
    ckpt.close()


@pytest.mark.slow
def test_retry_and_accumulation_flags(corpus, tmp_path, capsys):
    workdir = tmp_path / "retry"
    code = train_lm.main(["--data", str(corpus), "--precision", "fp16", "--init-scale", str(2.0**24),
                          "--on-overflow", "retry", "--max-retries", "24", "--accum-steps", "2", "--steps", "4",
                          "--underflow-stats", "--workdir", str(workdir), *TINY])
    out = capsys.readouterr().out
    assert code == 0 and "512 tokens per step" in out
    records = read_metrics(workdir / "metrics.jsonl")
    assert all(r["grads_finite"] for r in records) and records[0]["retries"] >= 1
    assert records[0]["loss_scale"] == 2.0 ** (24 - records[0]["retries"])
    assert 0 <= records[0]["grad_zero_fraction"] <= 1 and len(records[0]["worst_zero_leaves"]) == 3


@pytest.mark.slow
def test_second_sigint_exits_at_once():
    """The first SIGINT asks the loop to save and stop; a second one exits at once with status 130 (a save in
    flight stays in orbax's tmp folder, which restores ignore: see test_checkpoint's kill -9 test)."""
    code = """
import os, signal, sys, time
from jaxamp.lm.stopping import StopRequest
with StopRequest() as stop:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)
    assert stop.signal == signal.SIGINT, stop.signal
    print("first signal noted", flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
sys.exit(0)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 130, result.stderr
    assert "first signal noted" in result.stdout


def _tree_snapshot(directory: Path) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_precision_switches_on_resume_as_the_error_advises(corpus, tmp_path):
    """fp16 at a scale that overflows stops at step 1 advising bf16; bf16 resumes from the saved master weights and
    optimizer state, then fp32 does; a change of master-weight dtype is refused and touches nothing."""
    workdir = tmp_path / "switch"
    base = ["--data", corpus, "--workdir", workdir, *TINY, "--log-every", 1, "--checkpoint-every", 3,
            "--sample-tokens", 0, "--decay-steps", 20]
    first = cli(*base, "--precision", "fp16", "--init-scale", 2.0**24, "--max-consecutive-skips", 1, "--steps", 8)
    assert first.returncode == 3 and "try --precision bf16" in first.stderr, first.stderr
    second = cli(*base, "--precision", "bf16", "--steps", 4)
    assert second.returncode == 0, second.stderr
    assert "resumed from step 1" in second.stdout and "switched from fp16 to bf16" in second.stdout
    third = cli(*base, "--precision", "fp32", "--steps", 6)
    assert third.returncode == 0, third.stderr
    records = read_metrics(workdir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7))  # no duplicate records
    assert not records[0]["grads_finite"] and all(r["grads_finite"] for r in records[1:])
    assert (records[1]["precision_from"], records[1]["precision"]) == ("fp16", "bf16")
    assert (records[4]["precision_from"], records[4]["precision"]) == ("bf16", "fp32")
    assert [r["loss_scale"] for r in records[1:]] == [1.0] * 5  # the fp16 scale was not carried into bf16
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["precision"] == "fp32" and summary["precision_switches"] == [
        {"step": 2, "from": "fp16", "to": "bf16"}, {"step": 5, "from": "bf16", "to": "fp32"}]
    before = _tree_snapshot(workdir)
    refused = cli(*base, "--precision", "float16", "--steps", 8)  # float16 master weights
    assert refused.returncode == 2 and "master weights in float32" in refused.stderr, refused.stderr
    errors = [line for line in refused.stderr.splitlines() if not line.startswith("WARNING:absl")]  # orbax's reader
    assert "fp32, bf16 and fp16 all keep float32" in refused.stderr and len(errors) == 1
    assert _tree_snapshot(workdir) == before


@pytest.mark.slow
def test_fidelity_every_writes_grad_rel_err(corpus, tmp_path, capsys):
    workdir = tmp_path / "fidelity"
    code = train_lm.main(["--data", str(corpus), "--precision", "bf16", "--steps", "4", "--fidelity-every", "2",
                          "--workdir", str(workdir), *TINY])
    assert code == 0
    records = read_metrics(workdir / "metrics.jsonl")
    assert ["grad_rel_err" in r for r in records] == [False, True, False, True]
    errors = records[1]["grad_rel_err"]
    assert set(errors) >= {"wte/embedding", "h_0/mlp/c_fc/kernel"} and 0 < max(errors.values()) < 0.02
    assert "gradient error against float32, worst leaves:" in capsys.readouterr().out


@pytest.mark.slow
def test_fidelity_every_in_an_fp8_run_compares_with_the_model_without_fp8(corpus, tmp_path):
    """The reference bypasses the FP8 ops, so the error holds what e4m3/e5m2 cost: well above bf16's 0.4%."""
    workdir = tmp_path / "fidelity"
    code = train_lm.main(["--data", str(corpus), "--precision", "fp8", "--steps", "2", "--fidelity-every", "2",
                          "--workdir", str(workdir), *TINY])
    assert code == 0
    errors = read_metrics(workdir / "metrics.jsonl")[1]["grad_rel_err"]
    assert "h_0/mlp/c_fc/kernel" in errors and not any("amax" in k or "_scale" in k for k in errors)  # bf16's keys
    assert 0.02 < errors["h_0/mlp/c_fc/kernel"] < 0.5, errors
