"""The run directory (WORKDIR): opening it (new, empty, or a jaxamp run's own; refused if its checkpoints were
removed), its lock against a second run (`WorkdirLock`), summary.json sealed with a digest of its fields, and what
to tell the user when a write in it fails (`WorkdirWriteError`, `resume_advice`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import jax
import numpy as np

from jaxamp.checkpoint import Checkpointer
from jaxamp.lm.config import ConfigError, TrainConfig
from jaxamp.lm.log import warn
from jaxamp.lm.metrics_log import scan_metrics
from jaxamp.sharding import is_main_process

BPE_DIR = "tokenizer"  # WORKDIR/tokenizer: a BPE tokenizer trained by the run and its token files (jaxamp.lm.corpus)
RUN_ENTRIES = {"metrics.jsonl", "metrics.jsonl.tmp", "summary.json", "tb", "checkpoints", "unusable-checkpoints",
               "lock", BPE_DIR, BPE_DIR + ".tmp"}


class WorkdirLock:
    """An exclusive `flock` on WORKDIR/lock for the run's lifetime: a second run on the same workdir is refused
    before it touches anything. The kernel releases it when the process ends, even on SIGKILL, so it never goes
    stale, and it writes nothing into the file (a refused run changes no file). Process 0 takes it (the one that
    writes metrics; several processes may share a filesystem) and tells the others whether it could."""

    _BUSY, _UNWRITABLE = 1, 2

    def __init__(self, workdir: Path):
        self._fd, outcome, reason = None, 0, ""
        if is_main_process():
            outcome, reason = self._take(workdir)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

            outcome = int(multihost_utils.broadcast_one_to_all(np.int32(outcome)))
        if outcome == self._BUSY:
            raise ConfigError(f"--workdir {workdir} is in use by another run (it holds {workdir / 'lock'}); wait for "
                              "it to end or pass another directory")
        if outcome == self._UNWRITABLE:
            raise ConfigError(f"cannot write in --workdir {workdir}{reason}; pass a writable directory")

    def _take(self, workdir: Path) -> tuple[int, str]:
        import errno  # pylint: disable=import-outside-toplevel
        import fcntl  # pylint: disable=import-outside-toplevel  (POSIX)

        try:
            self._fd = os.open(workdir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            return self._UNWRITABLE, f" ({err.strerror})"
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                self.release()
                return self._BUSY, ""
            warn(f"cannot lock {workdir / 'lock'} ({err.strerror}; the filesystem may not support flock): "
                  "running without the guard against a second run on this workdir")
        return 0, ""

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def open_workdir(cfg: TrainConfig) -> tuple[Path, Checkpointer, WorkdirLock]:
    """The run directory, locked: new, empty, or a jaxamp run's own (anything else is refused, untouched)."""
    workdir = Path(cfg.workdir)
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"--workdir {workdir} is a file; pass a directory")
    stray = sorted(e.name for e in workdir.iterdir() if e.name not in RUN_ENTRIES) if workdir.exists() else []
    if stray:
        raise ConfigError(f"--workdir {workdir} holds entries that are not a jaxamp run's ({', '.join(stray[:5])}"
                          f"{' ...' if len(stray) > 5 else ''}); pass a new directory or a jaxamp run's workdir")
    ckpt = Checkpointer(workdir / "checkpoints", keep=cfg.keep)
    _check_resumable(workdir, cfg, ckpt)  # reads only
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create --workdir {workdir} ({err.strerror}); pass a writable directory") from None
    return workdir, ckpt, WorkdirLock(workdir)


def _check_resumable(workdir: Path, cfg: TrainConfig, ckpt: Checkpointer) -> None:
    """Refuses a workdir whose checkpoints were removed; a run killed before its first save starts over."""
    if ckpt.steps():
        return  # metrics.jsonl is rewritten from the copy saved with the checkpoint: damage in it is repaired
    try:
        records, _ = scan_metrics(workdir / "metrics.jsonl")  # past damaged lines; another program's file raises
    except ValueError as err:
        raise ConfigError(str(err)) from None
    # No checkpoint: a run killed before its first save committed (none begun yet, or one still being written when
    # it died) starts over: its records are recomputed, bitwise, from the same seed. Records past a save that
    # should have committed, or a finished run's summary, mean checkpoints were removed.
    last, cut = max((r["step"] for r in records), default=0), ckpt.interrupted_saves()
    # The first save is at step checkpoint_every (or earlier: at the end or on a signal); the loop runs on while it
    # is written, but the next save waits for it, so its records stop at 2 * checkpoint_every.
    first_save_cut = bool(cut) and max(cut) <= cfg.checkpoint_every and last <= 2 * cfg.checkpoint_every
    if (workdir / "summary.json").exists() or (last > cfg.checkpoint_every and not first_save_cut):
        raise ConfigError(f"--workdir {workdir} holds a previous run's metrics (steps up to {last}) but no checkpoint "
                          "to resume from; pass a new directory, or delete this one to start over")


SUMMARY_DIGEST = "sha256"  # summary.json's digest of its other fields, to tell a damaged file


def _sealed_summary(summary: dict) -> dict:
    body = {k: v for k, v in summary.items() if k != SUMMARY_DIGEST}
    return {**body, SUMMARY_DIGEST: hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


def read_summary(path: Path) -> tuple[dict | None, str]:
    """summary.json if it is intact, else None and why (missing, not JSON, or not matching its digest)."""
    if not path.exists():
        return None, "missing"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, "damaged (not JSON)"
    if not isinstance(summary, dict):
        return None, "damaged (not a JSON object)"
    if SUMMARY_DIGEST in summary and _sealed_summary(summary) != summary:
        return None, "damaged (it does not match its sha256)"
    return summary, ""


def write_summary(workdir: Path, summary: dict) -> None:
    if is_main_process():
        (workdir / "summary.json").write_text(json.dumps(_sealed_summary(summary), indent=2) + "\n")


# Operating-system errors of a workdir that cannot take more writes: the run stops with one line saying what to do.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)


class WorkdirWriteError(RuntimeError):
    """Writing a run's files (metrics, TensorBoard events, summary) failed: disk full, read-only, no permission."""


def resume_advice(code: int | None, ckpt: Checkpointer) -> str:
    """What to do after a failed write: the fix for the OS error, and where the same command will resume."""
    fix = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space (disk quota)",
           errno.EFBIG: "raise the file-size limit (ulimit -f)", errno.EROFS: "make the workdir writable",
           errno.EACCES: "make the workdir writable", errno.EPERM: "make the workdir writable"}.get(code,
                                                                                                 "fix the cause")
    steps = ckpt.steps()
    where = f"resume from step {steps[-1]}" if steps else "start over (no checkpoint was committed)"
    return f"{fix}, then run the same command to {where}"
