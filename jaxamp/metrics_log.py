"""Run logs: `metrics.jsonl` (one JSON record per step) and TensorBoard event files (tensorboardX) beside it."""

from __future__ import annotations

import json
import os
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
            from tensorboardX import SummaryWriter

            # A suffix unique to this logger: tensorboardX names files by the second, and a second logger opened in
            # the same second (an in-process resume) would truncate the first one's file. purge_step: TensorBoard
            # drops the points of earlier files from resume_step + 1 on (all of them when a run starts over).
            self._tb = SummaryWriter(str(Path(workdir) / "tb"), purge_step=resume_step + 1,
                                     filename_suffix=f".{os.getpid()}.{uuid.uuid4().hex[:8]}")

    def write(self, records: list[dict]) -> None:
        """Appends records (each with `step`) and flushes; adds `skipped_steps` (skipped so far) to each."""
        for record in records:
            self.skipped += not record["grads_finite"]
            record["skipped_steps"] = self.skipped
            self._file.write(json.dumps(record) + "\n")
            if self._tb is not None:
                for key in TB_SCALARS:
                    if key in record:
                        self._tb.add_scalar(f"train/{key}" if key != "val_loss" else "val/loss",
                                            float(record[key]), record["step"])
        self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
