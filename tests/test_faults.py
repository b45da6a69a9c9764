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
from jaxamp.checkpoint import Checkpointer
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
