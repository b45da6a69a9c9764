"""Fault campaign: random faults at random instants, each followed by a resume compared bitwise with a clean run.

    python benchmarks/fault_campaign.py --trials 100 --seed 0        # about 30 minutes on 2 shared cores
    python benchmarks/fault_campaign.py --trials 5 --steps 12 --checkpoint-every 3 --out /tmp/faults.md   # smoke

A clean run of `experiments/train_lm.py` (the reference LM's architecture at a small size, fp16 with the dynamic
loss scale starting at 2**24 so that the run holds skipped steps, `--steps` steps, a checkpoint every
`--checkpoint-every`) is made twice: the first fills a JAX compilation cache that every later launch reads (it only
shortens each launch's compile time), the second must equal the first bitwise (the run itself is reproducible) and
gives the first value of `T`, the duration of one launch (afterwards the median of the last 5 launches that ran a
whole run, as the machine's load changes). Then each trial draws a fault kind (every `len(KINDS)` trials cover every
kind once, in random order) and the fault's random parameters, runs the command on a fresh workdir, injects the
fault, and then reruns the same command "as a user would" (at most `--max-reruns` times, until a run exits 0 at
`--steps`), first undoing what the last error message asked the user to fix (free space, make the workdir writable,
delete a workdir whose checkpoints are gone). The fault kinds:

  sigkill          SIGKILL at a uniformly random instant in [0, T] after launch (startup included);
  sigkill-step     SIGKILL 0-50 ms after a random training step is dispatched (the step still computing);
  sigkill-save     SIGKILL 0-0.3 s after a random `Checkpointer.save` returned (orbax writing in its thread);
  sigkill-commit   SIGKILL at a random orbax commit (5 per save: 4 items and the step folder), just before or just
                   after its rename;
  sigkill-delete   SIGKILL while orbax deletes an old step folder (`--keep`), a random share of its files deleted;
  sigkill-append   SIGKILL during a random append to metrics.jsonl, a random share of its bytes written (torn line);
  sigterm, sigint  the signal at a uniformly random instant in [0, T];
  disk-full        the workdir on a tmpfs; at a random instant in [0, T] a ballast file outside the workdir fills
                   it, leaving 0-64 KiB; after the run ends the ballast is deleted (space freed);
  corrupt-checkpoint  a random byte of a random file of the newest committed step XORed with a random non-zero
                   mask, or the file truncated to a random length; after a SIGKILL at a random step or a finished run;
  corrupt-metrics  the same damage to metrics.jsonl;
  corrupt-summary  the same damage to summary.json, after a run finished or stopped by SIGTERM at a random step;
  read-only        the workdir's tmpfs remounted read-only after a run killed at a random instant (or finished, or
                   never started); one run on the read-only workdir, then remounted writable;
  vanished-checkpoint  a random committed step folder, or the whole checkpoints folder, deleted during a run (at
                   a random step) or between runs;
  two-runs         the same command started twice on one workdir, the second 0 to T/2 s after the first.

Faults at a failpoint (sigkill-step ... sigkill-append) are injected by launching the command through
`benchmarks/_fault_child.py`; every rerun is the plain command. Kinds that need a tmpfs (disk-full, read-only) are
skipped, with the reason, where `mount` is not allowed.

Success, for every trial (the goals): after the reruns the workdir's final checkpoint restores (sha256-verified) to
a state whose every leaf equals the clean run's bitwise; metrics.jsonl holds each step 1..N exactly once and every
record equals the clean run's except `tokens_per_s` (wall-clock throughput of that interval: it differs between any
two runs); summary.json equals the clean one except `tokens_per_s` and `wall_s` (timings of the last invocation
only) and `sha256` (the digest of the summary's fields, those timings included). "Records lost" counts clean-run
steps missing from the final metrics.jsonl. Every launch that stops (an exit status other than 0, or a
SIGTERM/SIGINT stop) writes at most 3 lines to stderr, and no launch prints a traceback (launches that are SIGKILLed
cannot print anything and are not counted as stopping runs). On top of these, per kind (`KIND_SUCCESS`, also printed
in the report):

  sigkill*         nothing more: the reruns resume and end bitwise;
  sigterm, sigint  the signalled launch stops quietly: exit 0 with a checkpoint (in the loop), 130 with one line
                   (SIGINT before the loop), or killed by the signal with no output (SIGTERM before the loop);
  disk-full        the launch that meets the full disk exits 2 (one line); once the ballast is deleted, the reruns
                   resume;
  corrupt-*        the reruns fall back to the previous step, or rewrite metrics.jsonl from the checkpoint's copy,
                   or recompute summary.json, and end bitwise;
  read-only        the launch on the read-only workdir exits 2 and changes no file; once writable, the reruns resume;
  vanished-checkpoint  a vanished step: the reruns fall back to an older one; every checkpoint gone: the rerun is
                   refused (exit 2, one line) and, the workdir deleted as the message says, the run starts over;
  two-runs         each launch exits 0, or exits 2 saying the workdir is in use by another run.

Writes `--out` (markdown: the table per kind, then one line per trial) and prints it. Trial folders are deleted
unless a trial fails (kept under the temporary folder, whose path the report gives).
"""

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import numpy as np  # noqa: E402

from jaxamp.lm.cli import check_output, check_sizes, write_report  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "train_lm.py"
CHILD = REPO / "benchmarks" / "_fault_child.py"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "fault_campaign.md"
WALL_CLOCK_RECORD_FIELDS = ("tokens_per_s",)
WALL_CLOCK_SUMMARY_FIELDS = ("tokens_per_s", "wall_s", "sha256")  # sha256: the summary's digest, timings included
MAX_STDERR_LINES = 3
KINDS = ("sigkill", "sigkill-step", "sigkill-save", "sigkill-commit", "sigkill-delete", "sigkill-append", "sigterm",
         "sigint", "disk-full", "corrupt-checkpoint", "corrupt-metrics", "corrupt-summary", "read-only",
         "vanished-checkpoint", "two-runs")
MOUNT_KINDS = ("disk-full", "read-only")
KIND_SUCCESS = {  # on top of the goals every trial must meet (bitwise, no record lost, quiet stops)
    "sigkill": "the reruns resume and end bitwise",
    "sigterm": "the signalled launch exits 0 with a checkpoint, or dies silently before the loop",
    "sigint": "the signalled launch exits 0 with a checkpoint, or 130 with one line before the loop",
    "disk-full": "the launch that meets the full disk exits 2 (one line); with space freed the reruns resume",
    "corrupt-checkpoint": "the reruns fall back to the previous step",
    "corrupt-metrics": "the reruns rewrite metrics.jsonl from the checkpoint's copy",
    "corrupt-summary": "the reruns recompute summary.json from the checkpoint and the records",
    "read-only": "the launch on the read-only workdir exits 2 and changes no file; once writable the reruns resume",
    "vanished-checkpoint": "an older step is used; with none left the rerun is refused (exit 2) and, the workdir "
                           "deleted as the message says, the run starts over",
    "two-runs": "each launch exits 0, or 2 saying the workdir is in use by another run",
}
COMMITS_PER_SAVE = 5  # orbax renames each item's temporary folder (state, config, integrity, metrics), then the step's


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=100, help="faulted runs")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault draws")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds to draw from")
    p.add_argument("--steps", type=int, default=40, help="training steps of each run")
    p.add_argument("--checkpoint-every", type=int, default=4, help="steps between checkpoints")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    p.add_argument("--log-every", type=int, default=2, help="steps between metric fetches (appends)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-reruns", type=int, default=4, help="reruns of the command after the fault")
    p.add_argument("--data", type=Path, default=None, help="corpus (default: a generated 40 kB text)")
    p.add_argument("--tmp-dir", type=Path, default=None, help="where workdirs go (default: $TMPDIR)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown report")
    args = p.parse_args(argv)
    check_sizes(p, args, ("trials", "steps", "checkpoint_every", "keep", "log_every", "layers", "heads", "width",
                          "seq_len", "batch_size", "max_reruns"), ("seed",))
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown or not args.kinds:
        p.error(f"--kinds: unknown {unknown or 'empty list'}; choose among {', '.join(KINDS)}")
    if args.data is not None and not args.data.is_file():
        p.error(f"--data {args.data} is not a file; pass a UTF-8 text file, or nothing for the generated corpus")
    check_output(p, "--out", args.out)
    if args.tmp_dir is not None:
        check_output(p, "--tmp-dir", args.tmp_dir, directory=True)
    return args


def train_args(args: argparse.Namespace, corpus: Path) -> list[str]:
    """The flags of every launch (the workdir aside)."""
    n = args.steps
    return ["--data", str(corpus), "--precision", "fp16", "--init-scale", str(2.0**24), "--growth-interval", "10",
            "--layers", str(args.layers), "--heads", str(args.heads), "--width", str(args.width),
            "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--steps", str(n),
            "--decay-steps", str(n), "--warmup-steps", str(max(1, n // 8)), "--checkpoint-every",
            str(args.checkpoint_every), "--keep", str(args.keep), "--log-every", str(args.log_every),
            "--eval-every", str(max(1, n // 2)), "--eval-batches", "2", "--sample-tokens", "0", "--no-progress"]


# ---------------------------------------------------------------------------------------------------------------
# Launching runs.


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
        return len([line for line in self.stderr.splitlines() if line.strip()])

    @property
    def tracebacks(self) -> int:
        return self.stderr.count("Traceback (most recent call last)")

    @property
    def stopping(self) -> bool:
        """A run the fault stopped on its own terms (an error exit, or a SIGTERM/SIGINT stop)."""
        return not self.killed and (self.returncode != 0 or "stopped by SIG" in self.stdout)

    def brief(self) -> str:
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


def _read_records(workdir: Path) -> list[dict]:
    from jaxamp.lm.metrics_log import read_metrics

    try:
        return read_metrics(workdir / "metrics.jsonl")
    except (OSError, ValueError):
        return []


def read_summary(workdir: Path) -> dict | None:
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
    records = _read_records(workdir)
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
        if _sh("umount", str(self.path)).returncode != 0:
            _sh("umount", "-l", str(self.path))


# ---------------------------------------------------------------------------------------------------------------
# Trials.


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
        self.details.append(text)

    def expect(self, ok: bool, text: str) -> None:
        if not ok:
            self.violations.append(text)

    @property
    def ok(self) -> bool:
        return self.skipped is None and not self.violations


class Campaign:
    """The settings, the clean run and the launching of commands shared by every trial."""

    def __init__(self, args: argparse.Namespace, tmp: Path, corpus: Path):
        self.args, self.tmp, self.n = args, tmp, args.steps
        self.base = train_args(args, corpus)
        self.env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp / "jax-cache"),
                    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
        n, every = args.steps, args.checkpoint_every
        self.saves = [s for s in range(1, n + 1) if s % every == 0 or s == n]
        evals = max(1, n // 2)
        self.appends = [s for s in range(1, n + 1) if s % args.log_every == 0 or s % evals == 0 or s in self.saves]
        self.ref: Reference | None = None
        self.durations: list[float] = []  # of recent whole launches, for T
        self.abstract = None
        self.ref_bytes = 0

    def command(self, workdir: Path, failpoint: dict | None = None) -> list[str]:
        script = SCRIPT if failpoint is None else CHILD
        return [sys.executable, str(script), *self.base, "--workdir", str(workdir)]

    def start(self, t: Trial, role: str, failpoint: dict | None = None) -> Running:
        env = self.env if failpoint is None else {**self.env, "JAXAMP_FAILPOINT": json.dumps(failpoint)}
        return Running(self.command(t.workdir, failpoint), env, t.folder / "logs", role)

    def finish(self, t: Trial, run: Running) -> Launch:
        timeout = 60 + 10 * (self.ref.launch_s if self.ref else 60)
        launch = run.finish(timeout)
        t.launches.append(launch)
        self._observe(launch)
        return launch

    def _observe(self, launch: Launch) -> None:
        """Keeps `T` (ref.launch_s) the median duration of the last 5 launches that ran a whole run from step 0:
        the machine's load changes, and instants drawn in [0, T] should fall within a run's life."""
        whole = launch.returncode == 0 and "resumed from" not in launch.stdout and "summary:" in launch.stdout
        if whole and "nothing to train" not in launch.stdout:
            self.durations = (self.durations + [launch.wall_s])[-5:]
            self.ref.launch_s = float(np.median(self.durations))

    def launch(self, t: Trial, role: str, failpoint: dict | None = None) -> Launch:
        return self.finish(t, self.start(t, role, failpoint))

    def finished(self, workdir: Path) -> bool:
        summary = read_summary(workdir)
        return bool(summary) and summary.get("steps") == self.n and summary.get("stopped_by") is None

    def resume(self, t: Trial) -> None:
        """Reruns the command as a user would until a run ends at --steps (or the user cannot go on)."""
        for i in range(self.args.max_reruns):
            launch = self.launch(t, f"rerun{i + 1}")
            if launch.returncode == 0 and self.finished(t.workdir):
                return
            if launch.returncode == 0 or launch.killed:
                continue
            if t.allow_start_over and "delete this one to start over" in launch.stderr:
                shutil.rmtree(t.workdir)  # what the message asks for: the checkpoints are gone
                t.note("refused (no checkpoint left); workdir deleted as the message says")
                continue
            t.violations.append(f"{launch.role} exited {launch.returncode} with nothing the user can fix: "
                                f"{_last_line(launch.stderr)}")
            return
        t.violations.append(f"not finished after {self.args.max_reruns} reruns")

    def wait_until(self, run: Running, instant: float) -> bool:
        """Sleeps until `instant` seconds after launch; False when the run ended first."""
        while run.alive() and time.monotonic() - run.started < instant:
            time.sleep(0.005)
        return run.alive()

    def wait_records(self, t: Trial, run: Running, count: int) -> bool:
        """Waits until metrics.jsonl holds `count` records; False when the run ended first."""
        while run.alive() and len(_read_records(t.workdir)) < count:
            time.sleep(0.01)
        return run.alive()

    def where(self, workdir: Path) -> str:
        """Where the run stood: records written, committed steps, saves cut short."""
        folder = workdir / "checkpoints"
        entries = sorted(os.listdir(folder)) if folder.is_dir() else []
        steps = sorted(int(e) for e in entries if e.isdigit())
        cut = sorted(e.split(".")[0] for e in entries if ".orbax-checkpoint-tmp" in e)
        records = _read_records(workdir)
        return (f"records to step {records[-1]['step'] if records else 0}, committed steps {steps}"
                + (f", saves cut short {cut}" if cut else ""))

    def mount(self, t: Trial) -> None:
        t.fs = Tmpfs(t.folder / "mnt", max(4, 2 * self.ref_bytes // 2**20 + 2))
        t.workdir = t.fs.path / "run"


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def _committed_steps(workdir: Path) -> list[int]:
    folder = workdir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(e) for e in os.listdir(folder) if e.isdigit() and (folder / e).is_dir())


def _stop_run(c: Campaign, t: Trial, how: str) -> None:
    """Runs the command once and stops it as `how` says: "finished", "SIGKILL at a random instant",
    "SIGKILL at a random step" or "SIGTERM at a random step" (or "never started": nothing)."""
    if how == "never started":
        t.note("no run before the fault")
        return
    if how == "finished":
        c.launch(t, "first")
        t.note("after a finished run")
        return
    run = c.start(t, "first")
    sig = signal.SIGKILL if how.startswith("SIGKILL") else signal.SIGTERM
    if how.endswith("random instant"):
        instant = t.rng.uniform(0, c.ref.launch_s)
        hit = run.signal_at(instant, sig)
        what = f"{instant:.2f} s after launch"
    else:
        step = t.rng.randint(min(c.args.checkpoint_every + 1, c.n), c.n)
        hit = c.wait_records(t, run, step) and run.signal_at(0, sig)
        what = f"at step {step}"
    c.finish(t, run)
    t.note(f"after {sig.name} {what}" + ("" if hit else " (the run had ended)") + f" ({c.where(t.workdir)})")


def fault_sigkill(c: Campaign, t: Trial) -> None:
    instant = t.rng.uniform(0, c.ref.launch_s)
    run = c.start(t, "faulted")
    hit = run.signal_at(instant, signal.SIGKILL)
    c.finish(t, run)
    t.note(f"SIGKILL {instant:.2f} s after launch" + ("" if hit else " (the run had ended)")
           + f" ({c.where(t.workdir)})")
    c.resume(t)


def _failpoint(c: Campaign, t: Trial, at: str) -> dict:
    rng = t.rng
    spec = {"at": at, "seed": rng.randrange(2**31)}
    if at == "step":
        spec.update(hit=rng.randint(1, c.n), delay=rng.uniform(0, 0.05))
    elif at == "save":
        spec.update(hit=rng.randint(1, len(c.saves)), delay=rng.uniform(0, 0.3))
    elif at == "commit":
        spec.update(hit=rng.randint(1, COMMITS_PER_SAVE * len(c.saves)), point=rng.choice(["before", "after"]))
    elif at == "delete":
        spec.update(hit=rng.randint(1, max(1, len(c.saves) - c.args.keep)), fraction=rng.random())
    else:
        spec.update(hit=rng.randint(1, len(c.appends)), fraction=rng.random())
    return spec


def _describe_failpoint(spec: dict) -> str:
    what = {"step": "step {hit} dispatched + {delay:.3f} s", "save": "save #{hit} returned + {delay:.3f} s",
            "commit": "commit #{hit} ({point} its rename)", "delete": "deletion #{hit}, {fraction:.0%} of its files",
            "append": "append #{hit}, {fraction:.0%} of its bytes written"}[spec["at"]]
    return "SIGKILL at " + what.format(**spec)


def fault_failpoint(at: str) -> Callable[[Campaign, Trial], None]:
    def fault(c: Campaign, t: Trial) -> None:
        spec = _failpoint(c, t, at)
        launch = c.launch(t, "faulted", spec)
        t.note(_describe_failpoint(spec) + ("" if launch.killed else " (never reached: the run ended)")
               + f" ({c.where(t.workdir)})")
        c.resume(t)

    return fault


def fault_signal(sig: signal.Signals) -> Callable[[Campaign, Trial], None]:
    def fault(c: Campaign, t: Trial) -> None:
        instant = t.rng.uniform(0, c.ref.launch_s)
        run = c.start(t, "faulted")
        hit = run.signal_at(instant, sig)
        launch = c.finish(t, run)
        t.note(f"{sig.name} {instant:.2f} s after launch" + ("" if hit else " (the run had ended)")
               + f": exit {launch.returncode} ({c.where(t.workdir)})")
        c.resume(t)

    return fault


def fault_disk_full(c: Campaign, t: Trial) -> None:
    c.mount(t)
    instant, leave = t.rng.uniform(0, c.ref.launch_s), t.rng.randrange(64 * 1024)
    ballast = t.fs.path / "ballast"
    run = c.start(t, "faulted")
    alive = c.wait_until(run, instant)
    taken = t.fs.fill(ballast, leave)
    launch = c.finish(t, run)
    t.note(f"disk filled {instant:.2f} s after launch ({taken // 1024} KiB, {leave // 1024} KiB left)"
           + ("" if alive else " (the run had ended)") + f": exit {launch.returncode} ({c.where(t.workdir)})")
    t.expect(launch.returncode in (0, 2) or launch.killed, f"a run on a full disk exits 0 or 2, got "
             f"{launch.returncode}")
    ballast.unlink()
    c.resume(t)


def fault_corrupt(target: str) -> Callable[[Campaign, Trial], None]:
    def fault(c: Campaign, t: Trial) -> None:
        stop = "SIGTERM at a random step" if target == "summary" else "SIGKILL at a random step"
        _stop_run(c, t, t.rng.choice([stop, "finished"]))
        if target == "checkpoint":
            steps = _committed_steps(t.workdir)
            if not steps:
                t.note("no committed step to damage")
                c.resume(t)
                return
            folder = t.workdir / "checkpoints" / str(steps[-1])
            files = sorted(p for p in folder.rglob("*") if p.is_file() and p.stat().st_size > 0)
            victim = t.rng.choice(files)
        else:
            victim = t.workdir / ("metrics.jsonl" if target == "metrics" else "summary.json")
        if victim.exists():
            t.note(f"{victim.relative_to(t.workdir)}: {damage(victim, t.rng)}")
        else:
            t.note(f"no {victim.name} to damage")
        c.resume(t)

    return fault


def fault_read_only(c: Campaign, t: Trial) -> None:
    c.mount(t)
    _stop_run(c, t, t.rng.choice(["never started", "SIGKILL at a random instant", "finished"]))
    before = snapshot(t.fs.path)
    t.fs.remount(read_only=True)
    launch = c.launch(t, "read-only")
    t.note(f"read-only run: exit {launch.returncode}: {_last_line(launch.stderr or launch.stdout)}")
    t.expect(launch.returncode == 2 or (launch.returncode == 0 and "nothing to train" in launch.stdout),
             f"the run on a read-only workdir exits 2 (or 0 with nothing to train), got {launch.returncode}")
    t.expect(snapshot(t.fs.path) == before, "the run on a read-only workdir changed files")
    t.fs.remount(read_only=False)
    c.resume(t)


def _remove_checkpoints(t: Trial, what: str) -> str:
    folder = t.workdir / "checkpoints"
    if what == "the checkpoints folder":
        if not folder.exists():
            return "no checkpoints folder yet"
        shutil.rmtree(folder, ignore_errors=True)
        t.allow_start_over = True
        return "checkpoints/ deleted"
    steps = _committed_steps(t.workdir)
    if not steps:
        return "no committed step to delete"
    step = t.rng.choice(steps)
    shutil.rmtree(folder / str(step), ignore_errors=True)
    return f"step {step} of {steps} deleted"


def fault_vanished(c: Campaign, t: Trial) -> None:
    what = t.rng.choice(["a step folder", "the checkpoints folder"])
    if t.rng.random() < 0.5:
        run = c.start(t, "faulted")
        step = t.rng.randint(min(c.args.checkpoint_every + 1, c.n), c.n)
        alive = c.wait_records(t, run, step)
        removed = _remove_checkpoints(t, what)
        launch = c.finish(t, run)
        t.note(f"during the run, at step {step}" + ("" if alive else " (the run had ended)")
               + f": {removed}; the run exited {launch.returncode}")
    else:
        _stop_run(c, t, t.rng.choice(["SIGKILL at a random instant", "finished"]))
        t.note(f"between runs: {_remove_checkpoints(t, what)}")
    c.resume(t)


def fault_two_runs(c: Campaign, t: Trial) -> None:
    gap = t.rng.uniform(0, c.ref.launch_s / 2)
    first = c.start(t, "first")
    time.sleep(gap)
    second = c.start(t, "second")
    a, b = c.finish(t, first), c.finish(t, second)
    t.note(f"second run {gap:.2f} s after the first: exits {a.returncode} and {b.returncode}")
    for launch in (a, b):
        t.expect(launch.returncode == 0 or (launch.returncode == 2 and "in use by another run" in launch.stderr),
                 f"{launch.role} run: exit {launch.returncode}: {_last_line(launch.stderr)}")
    if not c.finished(t.workdir):
        c.resume(t)


FAULTS: dict[str, Callable[[Campaign, Trial], None]] = {
    "sigkill": fault_sigkill, "sigkill-step": fault_failpoint("step"), "sigkill-save": fault_failpoint("save"),
    "sigkill-commit": fault_failpoint("commit"), "sigkill-delete": fault_failpoint("delete"),
    "sigkill-append": fault_failpoint("append"), "sigterm": fault_signal(signal.SIGTERM),
    "sigint": fault_signal(signal.SIGINT), "disk-full": fault_disk_full,
    "corrupt-checkpoint": fault_corrupt("checkpoint"), "corrupt-metrics": fault_corrupt("metrics"),
    "corrupt-summary": fault_corrupt("summary"), "read-only": fault_read_only,
    "vanished-checkpoint": fault_vanished, "two-runs": fault_two_runs,
}
assert tuple(FAULTS) == KINDS


def judge(c: Campaign, t: Trial) -> None:
    """Compares the finished workdir with the clean run and checks every launch's stderr."""
    r = t.result = compare(c.ref, t.workdir, c.abstract)
    if not r["bitwise"]:
        parts = [name for name, key in (("state", "state_equal"), ("metrics", "records_equal"),
                                         ("summary", "summary_equal")) if not r[key]]
        t.violations.append(f"not bitwise: {', '.join(parts)} differ (final step {r['final_step']}; "
                            f"{r['differing']} records differ, {r['extra']} extra)")
    t.expect(not r["lost"] and not r["duplicated"], f"{r['lost']} records lost, {r['duplicated']} duplicated")
    for launch in t.launches:
        t.expect(not launch.tracebacks, f"{launch.role}: {launch.tracebacks} traceback(s) on stderr")
        t.expect(not launch.stopping or launch.stderr_lines <= MAX_STDERR_LINES,
                 f"{launch.role}: {launch.stderr_lines} stderr lines (at most {MAX_STDERR_LINES})")


def run_trial(c: Campaign, index: int, kind: str, seed: int, mount_problem: str | None) -> Trial:
    folder = c.tmp / f"trial-{index:03d}-{kind}"
    t = Trial(index, kind, random.Random(seed), folder, folder / "run")
    if kind in MOUNT_KINDS and mount_problem:
        t.skipped = mount_problem
        return t
    try:
        FAULTS[kind](c, t)
        judge(c, t)
    except Exception as err:  # noqa: BLE001 - a campaign error fails the trial, with its reason, and goes on
        t.violations.append(f"campaign error: {type(err).__name__}: {err}")
    finally:
        if t.fs is not None:
            if not t.ok:
                shutil.copytree(t.fs.path, folder / "mnt-kept", symlinks=True, dirs_exist_ok=True)
            t.fs.close()
    if t.ok:
        shutil.rmtree(folder, ignore_errors=True)
    return t


# ---------------------------------------------------------------------------------------------------------------
# The clean run.


def make_corpus(path: Path) -> Path:
    words = np.array("to be or not to be that is the question whether tis nobler in the mind\n".split(" "))
    path.write_text(" ".join(np.random.default_rng(0).choice(words, 8000)), encoding="utf-8")
    return path


def clean_run(c: Campaign, workdir: Path) -> tuple[Launch, float]:
    started = time.monotonic()
    launch = Running(c.command(workdir), c.env, workdir.parent / "logs", workdir.name).finish(600)
    if launch.returncode != 0 or not c.finished(workdir):
        raise RuntimeError(f"the clean run failed (exit {launch.returncode}): {_last_line(launch.stderr)}")
    return launch, time.monotonic() - started


def reference(c: Campaign) -> Reference:
    """Two clean runs: the first fills the compilation cache, the second must equal it bitwise and is timed."""
    import jax

    sys.path.insert(0, str(SCRIPT.parent))
    import train_lm

    from jaxamp.lm.setup import build

    cfg = train_lm.parse_args([*c.base, "--workdir", str(c.tmp / "unused")])
    c.abstract = jax.eval_shape(lambda: build(cfg).state)
    first, second = c.tmp / "clean" / "first", c.tmp / "clean" / "second"
    clean_run(c, first)
    _, launch_s = clean_run(c, second)
    c.durations = [launch_s]
    _, leaves = final_leaves(first, c.abstract)
    ref = Reference(_read_records(first), read_summary(first), leaves, launch_s)
    check = compare(ref, second, c.abstract)
    if not check["bitwise"]:
        raise RuntimeError(f"two clean runs differ ({check}): the run is not reproducible, so no resume can be "
                           "compared bitwise")
    c.ref_bytes = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
    return ref


# ---------------------------------------------------------------------------------------------------------------
# Report.


def draw_kinds(kinds: list[str], trials: int, rng: random.Random) -> list[str]:
    """Every len(kinds) consecutive trials hold every kind once, in random order."""
    out: list[str] = []
    while len(out) < trials:
        block = list(kinds)
        rng.shuffle(block)
        out += block
    return out[:trials]


def kind_row(kind: str, trials: list[Trial]) -> str:
    ran = [t for t in trials if t.skipped is None]
    if not ran:
        return f"| {kind} | 0 | skipped: {trials[0].skipped} | | | | | | |"
    stopping = [launch for t in ran for launch in t.launches if launch.stopping]
    return (f"| {kind} | {len(ran)} | {sum(t.result.get('bitwise', False) for t in ran)} | "
            f"{sum(t.result.get('lost', 0) for t in ran)} | {sum(t.result.get('duplicated', 0) for t in ran)} | "
            f"{len(stopping)} | {max((s.stderr_lines for s in stopping), default=0)} | "
            f"{sum(launch.tracebacks for t in ran for launch in t.launches)} | {sum(t.ok for t in ran)} |")


def trial_line(t: Trial) -> str:
    if t.skipped:
        return f"| {t.index} | {t.kind} | skipped: {t.skipped} | | |"
    launches = "; ".join(launch.brief() for launch in t.launches)
    result = "ok" if t.ok else "**FAILED**: " + "; ".join(t.violations)
    return f"| {t.index} | {t.kind} | {'; '.join(t.details)} | {launches} | {result} |"


def report(c: Campaign, trials: list[Trial], argv: list[str], wall: float) -> str:
    ran = [t for t in trials if t.skipped is None]
    stopping = [launch for t in ran for launch in t.launches if launch.stopping]
    by_kind: dict[str, list[Trial]] = {}
    for t in trials:
        by_kind.setdefault(t.kind, []).append(t)
    lines = [
        "# Fault campaign: random faults, resumed runs compared bitwise with a clean run",
        "",
        f"Command: `{' '.join(['python benchmarks/fault_campaign.py', shlex.join(argv)]).strip()}` ({wall:.0f} s)",
        f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs; Python "
        f"{platform.python_version()}; trial folders in {c.tmp}",
        f"Each run: `python experiments/train_lm.py {shlex.join(c.base)} --workdir WORKDIR` "
        f"(T = {c.durations[0]:.1f} s per clean launch at the start, {c.ref.launch_s:.1f} s at the end; two clean "
        "runs agree bitwise)",
        "",
        f"**{sum(t.result.get('bitwise', False) for t in ran)} of {len(ran)} trials resumed bitwise; "
        f"{sum(t.result.get('lost', 0) for t in ran)} records lost; {len(stopping)} stopping runs, at most "
        f"{max((s.stderr_lines for s in stopping), default=0)} stderr lines each; "
        f"{sum(launch.tracebacks for t in ran for launch in t.launches)} tracebacks; {sum(t.ok for t in ran)} of "
        f"{len(ran)} trials meet every goal**" + (f" ({len(trials) - len(ran)} skipped)" if len(ran) < len(trials)
                                                  else ""),
        "",
        "| fault kind | trials | resumed bitwise | records lost | duplicated | stopping runs | max stderr lines | "
        "tracebacks | goals met |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(kind_row(kind, by_kind[kind]) for kind in KINDS if kind in by_kind),
        "",
        "| fault kind | success, on top of the goals |",
        "| --- | --- |",
        *(f"| {kind} | {KIND_SUCCESS[kind.split('-')[0] if kind.startswith('sigkill') else kind]} |"
          for kind in KINDS if kind in by_kind),
        "",
        "Definitions. *Resumed bitwise*: after the reruns, the final checkpoint's state (restored, sha256-verified) "
        "equals the clean run's in every leaf's bytes, metrics.jsonl equals the clean run's record by record except "
        f"{', '.join(WALL_CLOCK_RECORD_FIELDS)} (wall-clock throughput), and summary.json equals the clean one "
        f"except {', '.join(WALL_CLOCK_SUMMARY_FIELDS)} (timings of the last invocation, and the digest that covers "
        "them). *Records lost*: clean-run "
        "steps missing from the final metrics.jsonl; *duplicated*: steps written twice. *Stopping runs*: launches "
        "that ended with an error exit or a SIGTERM/SIGINT stop (SIGKILLed launches cannot print and are not "
        f"counted); each must write at most {MAX_STDERR_LINES} stderr lines; no launch may print a traceback. "
        "*Goals met*: trials with no violation of these rules or of their kind's own expectations (see the "
        "docstring of benchmarks/fault_campaign.py). The fault kinds and their random parameters are described "
        "there too.",
        "",
        "| # | kind | fault (what happened) | launches | result |",
        "| ---: | --- | --- | --- | --- |",
        *(trial_line(t) for t in trials),
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # Launched from a shell in the background, this process may ignore SIGINT, and its children would inherit that:
    # with a handler here, they start with the default disposition, as in a terminal.
    previous_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _campaign(args, argv)
    finally:
        signal.signal(signal.SIGINT, previous_sigint)


def _campaign(args: argparse.Namespace, argv: list[str]) -> int:
    t_start = time.monotonic()
    if args.tmp_dir is not None:
        args.tmp_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="jaxamp-faults-", dir=args.tmp_dir))
    corpus = args.data.resolve() if args.data else make_corpus(tmp / "corpus.txt")
    c = Campaign(args, tmp, corpus)
    try:
        c.ref = reference(c)
    except RuntimeError as err:  # the clean run failed or is not reproducible: no trial can be judged
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"clean run: {c.ref.launch_s:.1f} s per launch; {args.trials} trials", flush=True)
    problem = mount_problem(tmp) if any(k in MOUNT_KINDS for k in args.kinds) else None
    rng = random.Random(args.seed)
    kinds = draw_kinds(args.kinds, args.trials, rng)
    trials = []
    for index, kind in enumerate(kinds, 1):
        t = run_trial(c, index, kind, rng.randrange(2**32), problem)
        trials.append(t)
        print(trial_line(t), flush=True)
    text = report(c, trials, argv, time.monotonic() - t_start)
    if all(t.ok or t.skipped for t in trials):
        shutil.rmtree(tmp, ignore_errors=True)
    write_report(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
