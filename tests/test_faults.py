"""Faults that benchmarks/fault_campaign.py found, each with the input that failed, and the campaign itself."""

from __future__ import annotations

import errno
import json
import logging
import math
import resource
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

from jaxamp import DynamicLossScale, TrainState, get_policy
from jaxamp.checkpoint import CheckpointSaveError, Checkpointer, _save_reason
from jaxamp.metrics_log import MetricsLogger, read_metrics

from conftest import number, table_rows
from test_train import REPO, SCRIPT, _quick, _small_corpus, tensorboard_scalars, train_lm

# orbax leaves the coroutines of a failed read behind; collecting them prints "Exception ignored in <coroutine>".
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _record(step: int, grad_norm: float = 1.0) -> dict:
    return {"step": step, "loss": 3.0, "loss_scale": 2.0**15, "grads_finite": math.isfinite(grad_norm),
            "loss_finite": True, "grad_norm": grad_norm, "lr": 1e-3, "retries": 0, "tokens_per_s": 1.0}


def _tiny_state(step: int = 1) -> TrainState:
    params = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3)}
    state = TrainState.create(params=params, tx=optax.adam(1e-3), policy=get_policy("fp16"),
                              loss_scale=DynamicLossScale(2.0**10), rng=jax.random.key(0))
    return state.replace(step=jnp.asarray(step, jnp.int32))


# ---- the event files: written in this thread, quietly --------------------------------------------------------


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_event_files_take_non_finite_values_quietly_and_a_full_disk_raises_once(tmp_path, caplog):
    """Campaign input: a SIGTERM-stopped fp16 run printed 7 lines ("NaN or Inf found in input tensor.", one per
    skipped step) on stderr; on a full disk tensorboardX's thread and its exit hook printed two tracebacks."""
    logger = MetricsLogger(tmp_path)
    with caplog.at_level(logging.WARNING):
        logger.write([_record(1, grad_norm=math.inf), _record(2)])
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert tensorboard_scalars(tmp_path / "tb")["train/grad_norm"] == [(1, math.inf), (2, 1.0)]
    logger._file.close()
    logger._file = open("/dev/full", "a", encoding="utf-8")  # every flush fails with ENOSPC, as on a full disk
    with pytest.raises(OSError) as info:
        logger.write([_record(3)])
    assert info.value.errno == errno.ENOSPC
    assert logger._file.closed  # nothing is left to fail again, with a traceback, when the interpreter exits
    logger.close()  # a no-op now


# ---- a full disk: one line -------------------------------------------------------------------------------------


def test_save_error_reason_is_the_os_error():
    """Campaign input: the step-6 save on a full tmpfs; the one-line error cut tensorstore's message at 400
    characters, before "No space left on device"."""
    where = '"/w/checkpoints/6.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/'
    err = ValueError(f'RESOURCE_EXHAUSTED: Error writing "opt_state.1.count/0" in OCDBT database at local file {where}'
                     f'": Failed writing: {where}d/6487a22f7c27f6aba92efb0cfc2e4244": Failed to write 221450 bytes '
                     "to file 13: No space left on device [os_error_code='28']")
    assert _save_reason(err) == ("No space left on device (ENOSPC)", errno.ENOSPC)
    assert _save_reason(OSError(errno.EROFS, "Read-only file system")) == ("Read-only file system (EROFS)",
                                                                          errno.EROFS)
    assert _save_reason(RuntimeError("orbax: something else")) == ("RuntimeError: orbax: something else", None)


def test_a_save_that_cannot_be_written_ends_in_one_line(tmp_path):
    """Campaign input: a save that runs out of room (a 3 MB filesystem in the issue; here a 64 kB file-size limit,
    which needs no mount): 326 to 782 stderr lines and up to 80 tracebacks from orbax's and tensorstore's threads
    before the error line. Now the error line alone, naming the step, the OS error and how to resume."""
    corpus = _small_corpus(tmp_path / "corpus.txt")
    workdir = tmp_path / "run"
    limit = 64 * 1024  # below the step's array file (about 300 kB), above metrics.jsonl and the event file
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *_quick(corpus), "--layers", "1", "--steps", "8", "--checkpoint-every", "4",
         "--workdir",
         str(workdir)], cwd=REPO, capture_output=True, text=True, timeout=240,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr == (f"error: saving step 4 to {workdir / 'checkpoints'} failed: File too large (EFBIG); "
                             "raise the file-size limit (ulimit -f), then run the same command to start over (no "
                             "checkpoint was committed)\n")


def test_a_failed_background_save_is_reported_once_and_saving_goes_on(tmp_path, monkeypatch):
    """After a failed save the writer is dropped: close() does not raise the failure again, a later save works."""
    state = _tiny_state()
    ckpt = Checkpointer(tmp_path / "ckpt")
    assert ckpt.save(state, {})
    ckpt.wait()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt._manager, "wait_until_finished", full)
    with pytest.raises(CheckpointSaveError, match=r"saving a step to .* failed: No space left on device \(ENOSPC\)"):
        ckpt.wait()
    ckpt.close()
    assert ckpt.save(state.replace(step=jnp.asarray(2, jnp.int32)), {})
    ckpt.close()
    assert ckpt.steps() == [1, 2]


# ---- SIGINT while starting up ------------------------------------------------------------------------------------

SIGINT_IN_BUILD = """
import os, runpy, signal, sys, time
import jaxamp.train as train_mod
train_mod.build = lambda cfg: (os.kill(os.getpid(), signal.SIGINT), time.sleep(30))
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_sigint_while_starting_up_exits_at_once_in_one_line(tmp_path):
    """Campaign input: SIGINT 1.29 s after launch, inside the model build: a 99-line KeyboardInterrupt traceback
    (and, elsewhere in the start-up, a segfault, or an interrupt swallowed by a gc callback with the run going on)."""
    workdir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", SIGINT_IN_BUILD, str(SCRIPT), "--workdir", str(workdir)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 130, result.stderr[-3000:]
    assert result.stderr == train_lm.INTERRUPTED.decode()
    assert not workdir.exists()
