"""Why the training loop stops before `--steps`: a signal (`StopRequest`: SIGTERM/SIGINT finish the step, save and
exit 0; agreed on by every process of a multi-process run) or divergence (`DivergenceGuard` reads the host records
for too many skipped steps in a row; the loop saves and raises `DivergenceError`).
"""

from __future__ import annotations

import os
import signal

import jax
import numpy as np


class DivergenceError(RuntimeError):
    """Training stopped because steps kept overflowing; the last good state was saved first."""


class DivergenceGuard:
    """Counts consecutive skipped steps in the host records; says why to stop, or None.

    Stops after `max_skips` skipped steps in a row, or after `at_min` in a row while the loss scale already sits at
    its minimum (a lower scale cannot help any more).
    """

    def __init__(self, max_skips: int, min_scale: float, at_min: int = 10):
        self.max_skips, self.min_scale, self.at_min = max_skips, min_scale, min(at_min, max_skips)
        self.streak = self.streak_at_min = 0

    def check(self, records: list[dict]) -> str | None:
        for r in records:
            skipped = not r["grads_finite"]
            self.streak = self.streak + 1 if skipped else 0
            self.streak_at_min = self.streak_at_min + 1 if skipped and r["loss_scale"] <= self.min_scale else 0
            if self.streak >= self.max_skips or self.streak_at_min >= self.at_min:
                return self._reason(r)
        return None

    def _reason(self, r: dict) -> str:
        where = "the loss itself is not finite (NaN/inf from the inputs or the forward pass)" if not r[
            "loss_finite"] else f"gradient overflow in {', '.join(r.get('nonfinite_leaves', [])[:5]) or '?'}"
        at_min = self.streak_at_min >= self.at_min
        why = (f"{self.streak_at_min} consecutive overflows at the minimum loss scale {self.min_scale:g}" if at_min
               else f"{self.streak} consecutive skipped steps (--max-consecutive-skips {self.max_skips})")
        return (f"training diverged at step {r['step']}: {why}; {where}; lower --lr, check the data, or try "
                "--precision bf16")


class StopRequest:
    """SIGTERM/SIGINT handler for the loop: the first signal asks it to finish the step, save and exit 0; a second
    SIGINT exits at once (status 130; the last complete checkpoint is untouched: orbax writes into a tmp folder).

    In a multi-process run the signal a process received takes effect at the next `sync()` (the loop calls it every
    `log_every` steps, at the same step on every process), for every process at once: a process that stopped alone
    would leave the others waiting in a collective."""

    def __init__(self):
        self.signal: int | None = None
        self._received: int | None = None
        self._several = jax.process_count() > 1
        self._previous = {}

    def _handle(self, signum, frame):
        del frame
        if (self._received is not None or self.signal is not None) and signum == signal.SIGINT:
            os._exit(130)
        self._received = signum
        if not self._several:
            self.signal = signum

    def sync(self) -> None:
        """Multi-process runs: a collective that sets `signal` on every process if any process received one."""
        if not self._several or self.signal is not None:
            return
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

        got = np.asarray(multihost_utils.process_allgather(np.int32(self._received or 0))).reshape(-1)
        if got.any():
            self.signal = int(got[np.flatnonzero(got)[0]])

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
