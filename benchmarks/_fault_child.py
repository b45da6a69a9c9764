"""Runs `experiments/train_lm.py` with one failpoint armed; a helper process of `benchmarks/fault_campaign.py`.

    JAXAMP_FAILPOINT='{"at": "save", "hit": 3, "delay": 0.04, "seed": 7}' python benchmarks/_fault_child.py ARGS...

ARGS are train_lm.py's flags. At the `hit`-th (1-based) occurrence of the event `at`, the process SIGKILLs itself:
no handler runs, no buffer is flushed, as with a power cut or the OOM killer.

  step          after the hit-th training step is dispatched, a timer kills it `delay` seconds later (the step, or
                the next ones, still computing);
  save          after the hit-th `Checkpointer.save` call returns (the arrays are copied, orbax writes them in a
                background thread), a timer kills it `delay` seconds later;
  commit        at the hit-th commit of an orbax temporary folder (each item's folder, then the step's: 5 per save),
                `point` = "before" (everything written, nothing renamed) or "after" (renamed, the rest of the save's
                commit and the deletion of old steps not yet done);
  delete        at the hit-th deletion of an old step folder (`--keep`), after a random share (`fraction`) of its
                files is deleted;
  append        at the hit-th append to metrics.jsonl, after only the first `fraction` of its bytes reached the file
                (a torn append: it may end mid-line).

Nothing here changes what the run computes; the hooks only count events and kill.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Counter:
    """Counts events; `fires()` is True exactly at the hit-th one."""

    def __init__(self, hit: int):
        self.hit, self.count, self.lock = hit, 0, threading.Lock()

    def fires(self) -> bool:
        with self.lock:
            self.count += 1
            return self.count == self.hit


def _arm_step(spec: dict, counter: _Counter) -> None:
    import jaxamp.lm.train as train_mod

    original = train_mod._Loop.step

    def step(self, state, step_index):
        state = original(self, state, step_index)
        if counter.fires():
            threading.Timer(spec["delay"], _kill).start()
        return state

    train_mod._Loop.step = step


def _arm_save(spec: dict, counter: _Counter) -> None:
    import jaxamp.checkpoint as ckpt_mod

    original = ckpt_mod.Checkpointer.save

    def save(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if counter.fires():
            threading.Timer(spec["delay"], _kill).start()
        return result

    ckpt_mod.Checkpointer.save = save


def _arm_commit(spec: dict, counter: _Counter) -> None:
    from orbax.checkpoint._src.path import atomicity

    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self, *args, **kwargs):
        fires = counter.fires()
        if fires and spec["point"] == "before":
            _kill()
        result = await original(self, *args, **kwargs)
        if fires:
            _kill()
        return result

    atomicity.AtomicRenameTemporaryPath.finalize = finalize


def _arm_delete(spec: dict, counter: _Counter) -> None:
    import random

    from orbax.checkpoint._src.path import deleter

    original = deleter.PathDeleter.delete

    def delete(self, path, *args, **kwargs):
        if counter.fires():
            files = sorted(p for p in Path(path).rglob("*") if p.is_file())
            random.Random(spec["seed"]).shuffle(files)
            for p in files[: int(len(files) * spec["fraction"])]:
                p.unlink()
            _kill()
        return original(self, path, *args, **kwargs)

    deleter.PathDeleter.delete = delete


def _arm_append(spec: dict, counter: _Counter) -> None:
    import io

    import jaxamp.lm.metrics_log as log_mod

    original = log_mod.MetricsLogger.write

    def write(self, records):
        if not counter.fires():
            return original(self, records)
        real, self._file = self._file, io.StringIO()
        try:
            original(self, records)
            text = self._file.getvalue()
        finally:
            self._file = real
        real.write(text[: int(len(text) * spec["fraction"])])
        real.flush()
        _kill()
        return None

    log_mod.MetricsLogger.write = write


ARM = {"step": _arm_step, "save": _arm_save, "commit": _arm_commit, "delete": _arm_delete, "append": _arm_append}


def main(argv: list[str]) -> int:
    spec = json.loads(os.environ["JAXAMP_FAILPOINT"])
    ARM[spec["at"]](spec, _Counter(int(spec["hit"])))
    import train_lm  # noqa: E402  (experiments/, after the hooks: it imports jaxamp lazily anyway)

    return train_lm.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
