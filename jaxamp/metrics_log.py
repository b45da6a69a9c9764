"""Run logs: `metrics.jsonl` (one JSON record per step) and TensorBoard event files (tensorboardX) beside it."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

TB_SCALARS = ("loss", "val_loss", "loss_scale", "grads_finite", "skipped_steps", "grad_norm", "lr", "tokens_per_s")


def read_metrics(path: str | Path, *, strict: bool = False) -> list[dict]:
    """The records of a `metrics.jsonl`, in file order; [] when the file is absent. A torn last line is dropped.

    Args:
      path: the file.
      strict: also require every line but a torn last one to be a JSON object with an integer `step` (what a run
        about to append to the file needs); otherwise reading stops at the first line that is not JSON.

    Raises:
      ValueError: with `strict`, a line that is not a jaxamp record (names the line and the fix).
    """
    path = Path(path)
    if not path.exists():
        return []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        if strict:
            raise ValueError(f"{path} is not UTF-8 text, so not a jaxamp metrics file; pass a new --workdir") from None
        return []
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if strict and number < len(lines):
                raise ValueError(f"{path} line {number} is not JSON, so not a jaxamp metrics file; pass a new "
                                 "--workdir") from None
            break  # a line cut short by a kill: everything after it is unreliable
        if strict and not (isinstance(record, dict) and isinstance(record.get("step"), int)):
            raise ValueError(f"{path} line {number} has no integer \"step\", so it is not a jaxamp metrics file; "
                             "pass a new --workdir")
        records.append(record)
    return records


class MetricsLogger:
    """Appends step records to `WORKDIR/metrics.jsonl` and mirrors scalars to TensorBoard (`WORKDIR/tb`).

    Args:
      workdir: the run directory.
      resume_step: on resume, the checkpoint's step: records after it (written after the last save) are dropped
        through an atomic rewrite, so the file holds each step once.
      tensorboard: also write TensorBoard event files.

    Raises:
      ValueError: an existing `metrics.jsonl` is not a jaxamp metrics file (it is left untouched).
    """

    def __init__(self, workdir: str | Path, *, resume_step: int = 0, tensorboard: bool = True):
        self.path = Path(workdir) / "metrics.jsonl"
        kept = [r for r in read_metrics(self.path, strict=True) if r["step"] <= resume_step]
        if self.path.exists():
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
            os.replace(tmp, self.path)
        self.skipped = sum(not r["grads_finite"] for r in kept)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            # A suffix unique to this logger: event files are named by the second, and a second logger opened in
            # the same second (an in-process resume) would truncate the first one's file. purge_step: TensorBoard
            # drops the points of earlier files from resume_step + 1 on (all of them when a run starts over).
            self._tb = _EventFile(Path(workdir) / "tb", purge_step=resume_step + 1,
                                  suffix=f".{os.getpid()}.{uuid.uuid4().hex[:8]}")

    def write(self, records: list[dict]) -> None:
        """Appends records (each with `step`) and flushes; adds `skipped_steps` (skipped so far) to each.

        Raises:
          OSError: a file could not be written (e.g. the disk is full); both files are then closed.
        """
        try:
            for record in records:
                self.skipped += not record["grads_finite"]
                record["skipped_steps"] = self.skipped
                self._file.write(json.dumps(record) + "\n")
                if self._tb is not None:
                    for key in TB_SCALARS:
                        if key in record:
                            self._tb.scalar(f"train/{key}" if key != "val_loss" else "val/loss", float(record[key]),
                                            record["step"])
            self._file.flush()
            if self._tb is not None:
                self._tb.flush()
        except OSError:
            self._abandon()
            raise

    def close(self) -> None:
        """Flushes and closes both files.

        Raises:
          OSError: the last data could not be written; both files are closed anyway.
        """
        try:
            self._file.close()
            if self._tb is not None:
                self._tb.close()
                self._tb = None
        except OSError:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Closes both files after a write error, dropping what they still buffer (nothing is left to fail again,
        with a traceback, when the interpreter exits)."""
        for closable in (self._file, self._tb):
            try:
                if closable is not None:
                    closable.close()
            except (OSError, ValueError):  # ValueError: the event file's writer was already closed
                pass
        self._tb = None  # closed: a later close() has nothing left to do


class _EventFile:
    """One TensorBoard event file, written synchronously with tensorboardX's record writer and protos.

    tensorboardX's `SummaryWriter` writes from a thread of its own and flushes again at exit: when the disk fills,
    both print a traceback. Here a write error reaches the caller as an OSError, once. Scalars are written as
    `simple_value`s, as `SummaryWriter.add_scalar` does (a NaN or inf among them is kept, without a warning).
    """

    def __init__(self, logdir: Path, *, purge_step: int, suffix: str):
        from tensorboardX.event_file_writer import EventsWriter  # pylint: disable=import-outside-toplevel
        from tensorboardX.proto.event_pb2 import Event, SessionLog  # pylint: disable=import-outside-toplevel

        logdir.mkdir(parents=True, exist_ok=True)
        self._writer = EventsWriter(str(logdir / "events"), suffix)  # starts with the file_version event
        # TensorBoard reads a SessionLog.START at step s as "drop the points of earlier files from step s on".
        self._writer.write_event(Event(step=purge_step, file_version="brain.Event:2"))
        self._writer.write_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboardX.proto.event_pb2 import Event  # pylint: disable=import-outside-toplevel
        from tensorboardX.proto.summary_pb2 import Summary  # pylint: disable=import-outside-toplevel

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
        self._writer.write_event(Event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
