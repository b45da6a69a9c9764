"""Launching training runs and reading what they leave, for `benchmarks/fault_campaign.py`: a launch's outcome, the
clean run a trial must end equal to (bitwise), the comparison, damage to files, and the small tmpfs of the
disk-full and read-only trials.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WALL_CLOCK_RECORD_FIELDS = ("tokens_per_s",)
WALL_CLOCK_SUMMARY_FIELDS = ("tokens_per_s", "wall_s", "sha256")  # sha256: the summary's digest, timings included
MAX_STDERR_LINES = 3


@dataclasses.dataclass
class Launch:
    """One finished invocation of the training command."""

    role: str
    returncode: int
    stdout: str
    stderr: str
    killed: bool = False  # SIGKILLed by the campaign or by its failpoint: it could print nothing more
    wall_s: float = 0.0

    @property
    def stderr_lines(self) -> int:
        """Non-blank lines on stderr."""
        return len([line for line in self.stderr.splitlines() if line.strip()])

    @property
    def tracebacks(self) -> int:
        """Python tracebacks on stderr."""
        return self.stderr.count("Traceback (most recent call last)")

    @property
    def stopping(self) -> bool:
        """A run the fault stopped on its own terms (an error exit, or a SIGTERM/SIGINT stop)."""
        return not self.killed and (self.returncode != 0 or "stopped by SIG" in self.stdout)

    def brief(self) -> str:
        """`role: exit N, K stderr line(s)` for the trial's row."""
        status = "SIGKILLed" if self.killed else f"exit {self.returncode}"
        return f"{self.role}: {status}, {self.stderr_lines} stderr line(s)"


class Running:
    """A launched command whose output goes to files (no pipe can fill up)."""

    def __init__(self, cmd: list[str], env: dict, folder: Path, role: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.role, self.started = role, time.monotonic()
        self._out, self._err = folder / f"{role}.out", folder / f"{role}.err"
        with open(self._out, "w") as out, open(self._err, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err)
        self.signalled: int | None = None

    def alive(self) -> bool:
        """The process has not ended."""
        return self.proc.poll() is None

    def signal_at(self, instant: float, sig: int) -> bool:
        """Sends `sig` `instant` seconds after launch; False when the run had already ended."""
        while self.alive() and time.monotonic() - self.started < instant:
            time.sleep(0.005)
        if not self.alive():
            return False
        self.proc.send_signal(sig)
        self.signalled = sig
        return True

    def finish(self, timeout: float) -> Launch:
        """Waits for the end (killing it after `timeout` s, noted on its stderr) and reads its output."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self._err.write_text(self._err.read_text() + f"\n[campaign: killed after {timeout:.0f} s: hung]\n")
        code = self.proc.returncode
        killed = code == -signal.SIGKILL
        return Launch(self.role, code, self._out.read_text(errors="replace"), self._err.read_text(errors="replace"),
                      killed, time.monotonic() - self.started)


# ---------------------------------------------------------------------------------------------------------------
# The clean run and the comparison with it.


@dataclasses.dataclass
class Reference:
    """What every trial must end with."""

    records: list[dict]
    summary: dict
    leaves: dict[str, tuple]
    launch_s: float  # duration of one clean launch (compilation cached)


def _strip(record: dict, fields: tuple[str, ...]) -> dict:
    return {k: v for k, v in record.items() if k not in fields}


def read_records(workdir: Path) -> list[dict]:
    """metrics.jsonl's records ([] when it is missing or unreadable)."""
    from jaxamp.lm.metrics_log import read_metrics

    try:
        return read_metrics(workdir / "metrics.jsonl")
    except (OSError, ValueError):
        return []


def read_summary(workdir: Path) -> dict | None:
    """summary.json as a dict (None when it is missing, unreadable or not an object)."""
    try:
        summary = json.loads((workdir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def final_leaves(workdir: Path, abstract) -> tuple[int, dict[str, tuple]]:
    """The newest usable checkpoint of `workdir`, restored (sha256-verified): its step and {leaf: (dtype, shape,
    bytes)}."""
    import jax

    from jaxamp.checkpoint import Checkpointer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Checkpointer(workdir / "checkpoints") as ckpt:
            state, _ = ckpt.restore(abstract)
    leaves = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        arr = np.asarray(jax.device_get(x))
        leaves[jax.tree_util.keystr(path)] = (str(arr.dtype), arr.shape, arr.tobytes())
    return int(state.step), leaves


def compare(ref: Reference, workdir: Path, abstract) -> dict:
    """The final workdir against the clean run: bitwise state, records and summary, lost and duplicated steps."""
    records = read_records(workdir)
    steps = [r.get("step") for r in records]
    # Compared as JSON text: a NaN grad_norm equals itself there (NaN != NaN as a float).
    ref_by_step = {r["step"]: json.dumps(_strip(r, WALL_CLOCK_RECORD_FIELDS)) for r in ref.records}
    ours = {r.get("step"): json.dumps(_strip(r, WALL_CLOCK_RECORD_FIELDS)) for r in records}
    out = {"lost": len(set(ref_by_step) - set(steps)), "duplicated": len(steps) - len(set(steps)),
           "differing": sum(s in ref_by_step and ours[s] != ref_by_step[s] for s in ours),
           "extra": len(set(steps) - set(ref_by_step))}
    out["records_equal"] = (steps == [r["step"] for r in ref.records]
                            and [ours[s] for s in steps] == [ref_by_step[s] for s in steps])
    summary = read_summary(workdir)
    out["summary_equal"] = summary is not None and (json.dumps(_strip(summary, WALL_CLOCK_SUMMARY_FIELDS))
                                                    == json.dumps(_strip(ref.summary, WALL_CLOCK_SUMMARY_FIELDS)))
    try:
        step, leaves = final_leaves(workdir, abstract)
        out["state_equal"] = leaves == ref.leaves
        out["final_step"] = step
    except Exception as err:  # noqa: BLE001 - any failure to restore means "not equal"; the reason is reported
        out["state_equal"], out["final_step"] = False, f"unrestorable: {type(err).__name__}: {err}"[:200]
    out["bitwise"] = out["state_equal"] and out["records_equal"] and out["summary_equal"]
    return out


# ---------------------------------------------------------------------------------------------------------------
# File-system helpers: damage, snapshots, tmpfs mounts.


def damage(path: Path, rng: random.Random) -> str:
    """Flips one random byte of `path` (XOR with a random non-zero mask) or truncates it to a random length."""
    data = path.read_bytes()
    if not data:
        return f"{path.name} is empty: left as it is"
    if rng.random() < 0.5:
        i, mask = rng.randrange(len(data)), rng.randrange(1, 256)
        path.write_bytes(data[:i] + bytes([data[i] ^ mask]) + data[i + 1:])
        return f"byte {i} of {len(data)} XOR 0x{mask:02x}"
    size = rng.randrange(len(data))
    os.truncate(path, size)
    return f"truncated from {len(data)} to {size} bytes"


def snapshot(folder: Path) -> list[tuple]:
    """(path, size, mtime) of everything under `folder`: equal snapshots = nothing written."""
    if not folder.exists():
        return []
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*"))


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)


def mount_problem(tmp: Path) -> str | None:
    """None when a tmpfs can be mounted here; else why not (the mount kinds are then skipped)."""
    if shutil.which("mount") is None:
        return "no mount command"
    probe = tmp / "mount-probe"
    probe.mkdir(exist_ok=True)
    result = _sh("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe))
    if result.returncode != 0:
        return f"mount -t tmpfs is not allowed here ({' '.join(result.stderr.split())[:120]})"
    _sh("umount", str(probe))
    return None


class Tmpfs:
    """A small tmpfs mounted on `path` for one trial."""

    def __init__(self, path: Path, size_mb: int):
        path.mkdir(parents=True, exist_ok=True)
        result = _sh("mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path))
        if result.returncode != 0:
            raise RuntimeError(f"mount failed: {result.stderr.strip()}")
        self.path = path

    def remount(self, read_only: bool) -> None:
        """Remounts read-only or writable."""
        result = _sh("mount", "-o", f"remount,{'ro' if read_only else 'rw'}", str(self.path))
        if result.returncode != 0:
            raise RuntimeError(f"remount failed: {result.stderr.strip()}")

    def fill(self, ballast: Path, leave: int) -> int:
        """Fills the filesystem with `ballast` until `leave` bytes stay free; returns the bytes taken."""
        st = os.statvfs(self.path)
        want = max(0, st.f_bavail * st.f_frsize - leave)
        with open(ballast, "wb") as f:
            while want > 0:
                try:
                    os.posix_fallocate(f.fileno(), 0, want)
                    break
                except OSError:  # the run took some space meanwhile
                    want -= 64 * 1024
        return max(want, 0)

    def close(self) -> None:
        """Unmounts (lazily when busy)."""
        if _sh("umount", str(self.path)).returncode != 0:
            _sh("umount", "-l", str(self.path))


# ---------------------------------------------------------------------------------------------------------------
# Trials: one fault and the resumes after it.


@dataclasses.dataclass
class Trial:
    """One fault and the resumes after it."""

    index: int
    kind: str
    rng: random.Random
    folder: Path
    workdir: Path
    details: list[str] = dataclasses.field(default_factory=list)
    launches: list[Launch] = dataclasses.field(default_factory=list)
    violations: list[str] = dataclasses.field(default_factory=list)
    result: dict = dataclasses.field(default_factory=dict)
    skipped: str | None = None
    fs: Tmpfs | None = None
    allow_start_over: bool = False  # the fault removed every checkpoint: the refusal and a fresh start are right

    def note(self, text: str) -> None:
        """Adds `text` to what happened (the trial's row)."""
        self.details.append(text)

    def expect(self, ok: bool, text: str) -> None:
        """A violation `text` unless `ok`."""
        if not ok:
            self.violations.append(text)

    @property
    def ok(self) -> bool:
        """Ran and violated nothing."""
        return self.skipped is None and not self.violations


def last_line(text: str) -> str:
    """The last non-blank line of `text` (at most 300 characters), for a trial's notes."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def committed_steps(workdir: Path) -> list[int]:
    """The step folders under `workdir/checkpoints`, in order."""
    folder = workdir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(e) for e in os.listdir(folder) if e.isdigit() and (folder / e).is_dir())
