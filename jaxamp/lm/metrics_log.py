"""Run logs: `metrics.jsonl` (one JSON record per step) and TensorBoard event files (tensorboardX) beside it."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

# Every key a metrics.jsonl record may hold, defined once: name -> (JSON type, meaning). `record_with` refuses others.
RECORD_FIELDS: dict[str, tuple[str, str]] = {
    "step": ("int", "optimizer steps done after this one (train_step calls, skipped steps included)"),
    "loss": ("float", "the step's unscaled mean training loss, nats per token"),
    "loss_scale": ("float", "the loss scale the step's gradients were finally computed with"),
    "grads_finite": ("bool", "False: the step overflowed and was skipped (weights and optimizer state unchanged)"),
    "loss_finite": ("bool", "False: the loss itself was not finite (inputs or forward pass, not the scale)"),
    "grad_norm": ("float", "global L2 norm of the unscaled gradients before clipping (Infinity/NaN when skipped)"),
    "lr": ("float", "the learning rate of the last applied update (read back from the optimizer state)"),
    "retries": ("int", "recomputations of this batch at a lower scale (--on-overflow retry)"),
    "tokens_per_s": ("float", "training tokens per second over the step's logging interval"),
    "skipped_steps": ("int", "skipped steps of the run so far, this one included"),
    "val_loss": ("float", "mean validation loss, nats per token (eval steps only)"),
    "nonfinite_leaves": ("list[str]", "the params whose gradients overflowed (skipped steps only)"),
    "nonfinite_at_min_scale": ("bool", "retry mode: the gradients overflowed even at the lowest loss scale"),
    "grad_rel_err": ("dict[str, float]", "each leaf's gradient error against float32 (--fidelity-every)"),
    "grad_zero_fraction": ("float", "share of gradient elements exactly 0 in the compute dtype (--underflow-stats)"),
    "headroom_log2": ("float", "log2(max finite / max scaled gradient): doublings left (--underflow-stats)"),
    "worst_zero_leaves": ("list[[str, float]]", "the 3 leaves with the largest zero fraction (--underflow-stats)"),
    "worst_headroom_leaves": ("list[[str, float]]", "the 3 leaves with the least headroom (--underflow-stats)"),
    "precision": ("str", "the precision from this step on (first record after a switch on resume)"),
    "precision_from": ("str", "the precision before the switch (first record after a switch on resume)"),
}
TB_SCALARS = ("loss", "val_loss", "loss_scale", "grads_finite", "skipped_steps", "grad_norm", "lr", "tokens_per_s")


def record_with(record: dict, **fields) -> dict:
    """`record` (a metrics.jsonl record, updated in place and returned) with `fields` added.

    Raises:
      ValueError: a key that is not in `RECORD_FIELDS` (add it there, with its type and meaning).
    """
    unknown = sorted(set(fields) - set(RECORD_FIELDS))
    if unknown:
        raise ValueError(f"metrics.jsonl records have no field {unknown[0]!r}; define it in "
                         "jaxamp.lm.metrics_log.RECORD_FIELDS first")
    record.update(fields)
    return record


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


def _is_record(obj) -> bool:
    """A jaxamp step record: a JSON object with an integer step, a loss and the finite flag."""
    return isinstance(obj, dict) and isinstance(obj.get("step"), int) and "loss" in obj and "grads_finite" in obj


def scan_metrics(path: str | Path) -> tuple[list[dict], list[int]]:
    """Reads every line of a `metrics.jsonl` that is a jaxamp record, in file order, past any damaged line.

    Returns:
      `(records, bad)`: the records that read, and the 1-based numbers of the lines that are not jaxamp records
      (not UTF-8, not JSON, or not a record: damaged, torn by a kill, or another program's). `([], [])` when the
      file is absent.

    Raises:
      ValueError: no line is a jaxamp record and the file is not a lone line cut short by a kill: it is not a
        jaxamp metrics file (the message names the line and the fix).
    """
    lines = _scan_lines(Path(path))
    records = [obj for _, obj in lines if obj is not None]
    bad = [number for number, obj in lines if obj is None]
    if bad and not records:
        read_metrics(path, strict=True)  # raises, naming the line, unless the file is one torn line
    return records, bad


def _scan_lines(path: Path) -> list[tuple[int, dict | None]]:
    """(line number, record or None when the line is not a jaxamp record) for every line of the file."""
    if not path.exists():
        return []
    out = []
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            obj = None
        out.append((number, obj if _is_record(obj) else None))
    return out


def sync_metrics(path: str | Path, records: list[dict]) -> int | None:
    """Makes `path` hold exactly `records`, one JSON line each (an atomic rewrite, only when it holds anything else).

    Returns:
      The first line (1-based) among the first `len(records)` that was missing or differed, or None when the file
      already began with exactly these lines (lines after them, e.g. records written after the last checkpoint,
      are dropped without a word).
    """
    path = Path(path)
    want = [json.dumps(r).encode() for r in records]
    have = path.read_bytes().splitlines() if path.exists() else []
    first = next((i + 1 for i, line in enumerate(want) if i >= len(have) or have[i] != line), None)
    if have != want:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(b"".join(line + b"\n" for line in want))
        os.replace(tmp, path)
    return first


class MetricsLogger:
    """Appends step records to `WORKDIR/metrics.jsonl` and mirrors scalars to TensorBoard (`WORKDIR/tb`).

    `records` holds every record of the file (kept and written), e.g. to save a copy with each checkpoint.

    Args:
      workdir: the run directory.
      resume_step: on resume, the checkpoint's step: records after it (written after the last save) are dropped
        through an atomic rewrite, so the file holds each step once.
      history: on resume, the records up to `resume_step` as saved with the checkpoint: the file is made to begin
        with exactly these (a damaged, truncated or missing file is rewritten from them; `repaired_line` then
        names its first line that was missing or differed). Without it the file's own records are kept.
      tensorboard: also write TensorBoard event files.

    Raises:
      ValueError: an existing `metrics.jsonl` is not a jaxamp metrics file, or (without `history`) a record up to
        `resume_step` is damaged; the file is left untouched.
    """

    def __init__(self, workdir: str | Path, *, resume_step: int = 0, history: list[dict] | None = None,
                 tensorboard: bool = True):
        self.path = Path(workdir) / "metrics.jsonl"
        self.repaired_line: int | None = None
        if history is not None:
            kept = [r for r in history if r["step"] <= resume_step]
            self.repaired_line = sync_metrics(self.path, kept)
        else:
            kept = self._own_records(resume_step)
        self.records = list(kept)
        self.skipped = sum(not r["grads_finite"] for r in kept)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            # A suffix unique to this logger: event files are named by the second, and a second logger opened in
            # the same second (an in-process resume) would truncate the first one's file. purge_step: TensorBoard
            # drops the points of earlier files from resume_step + 1 on (all of them when a run starts over).
            self._tb = _EventFile(Path(workdir) / "tb", purge_step=resume_step + 1,
                                  suffix=f".{os.getpid()}.{uuid.uuid4().hex[:8]}")

    def _own_records(self, resume_step: int) -> list[dict]:
        """The file's records up to `resume_step`, the file rewritten to hold only them."""
        records, bad = scan_metrics(self.path)  # raises for another program's file
        lines = _scan_lines(self.path)
        kept = [obj for _, obj in lines if obj is not None and obj["step"] <= resume_step]
        last = max((n for n, obj in lines if obj is not None and obj["step"] <= resume_step), default=0)
        # A bad line before the last kept record, or anywhere when the kept ones stop short of resume_step, may have
        # been a record up to resume_step. (A line torn by a kill lies after the checkpoint's records.)
        damaged = [n for n in bad if n < last or (kept and kept[-1]["step"] < resume_step) or not records]
        if damaged and resume_step > 0:
            raise ValueError(f"{self.path} line {damaged[0]} is damaged and the checkpoint holds no copy of the "
                             f"records to restore it from; repair or delete that line, then run the same command")
        if self.path.exists():
            sync_metrics(self.path, kept)
        return kept

    def write(self, records: list[dict]) -> None:
        """Appends records (each with `step`) and flushes; adds `skipped_steps` (skipped so far) to each.

        Raises:
          OSError: a file could not be written (e.g. the disk is full); both files are then closed.
        """
        try:
            for record in records:
                self.skipped += not record["grads_finite"]
                record_with(record, skipped_steps=self.skipped)
                self._file.write(json.dumps(record) + "\n")
                self.records.append(record)
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
