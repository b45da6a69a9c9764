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
cannot print anything and are not counted as stopping runs). On top of these, per kind (`fault_kinds.KIND_SUCCESS`,
also printed in the report):

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

This file is the campaign (flags, the clean run, trials, the report); the fault kinds are in
`benchmarks/fault_kinds.py`, launching and comparing runs in `benchmarks/fault_runs.py`.
"""


from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import numpy as np  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.fault_kinds import FAULTS, KINDS, MOUNT_KINDS, success  # noqa: E402
from benchmarks.fault_runs import (  # noqa: E402
    MAX_STDERR_LINES,
    WALL_CLOCK_RECORD_FIELDS,
    WALL_CLOCK_SUMMARY_FIELDS,
    Launch,
    Reference,
    Running,
    Tmpfs,
    Trial,
    compare,
    final_leaves,
    last_line,
    mount_problem,
    read_records,
    read_summary,
)

REPO = harness.REPO
SCRIPT = REPO / "experiments" / "train_lm.py"
CHILD = REPO / "benchmarks" / "_fault_child.py"
DEFAULT_OUT = harness.RESULTS / "fault_campaign.md"
CLEAN_RUN_TIMEOUT_S = 600


def parse_args(argv=None) -> argparse.Namespace:
    """The campaign's flags, checked (one-line usage errors)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=100, help="faulted runs")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault draws")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds to draw from")
    p.add_argument("--steps", type=int, default=40, help="training steps of each run")
    p.add_argument("--checkpoint-every", type=int, default=4, help="steps between checkpoints")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    p.add_argument("--log-every", type=int, default=2, help="steps between metric fetches (appends)")
    harness.add_model_flags(p, layers=2, heads=2, width=64, seq_len=32, batch_size=8)
    p.add_argument("--max-reruns", type=int, default=4, help="reruns of the command after the fault")
    p.add_argument("--data", type=Path, default=None, help="corpus (default: a generated 40 kB text)")
    p.add_argument("--tmp-dir", type=Path, default=None, help="where workdirs go (default: $TMPDIR)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown report")
    args = p.parse_args(argv)
    harness.check_sizes(p, args, ("trials", "steps", "checkpoint_every", "keep", "log_every", "layers", "heads",
                                  "width", "seq_len", "batch_size", "max_reruns"), ("seed",))
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown or not args.kinds:
        p.error(f"--kinds: unknown {unknown or 'empty list'}; choose among {', '.join(KINDS)}")
    harness.check_file(p, "--data", args.data, "; pass a UTF-8 text file, or nothing for the generated corpus")
    harness.check_output(p, "--out", args.out)
    if args.tmp_dir is not None:
        harness.check_output(p, "--tmp-dir", args.tmp_dir, directory=True)
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
# The campaign: settings, the clean run's figures, and the launching shared by every trial.


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
        """The training command on `workdir` (through the failpoint child when one is armed)."""
        script = SCRIPT if failpoint is None else CHILD
        return [sys.executable, str(script), *self.base, "--workdir", str(workdir)]

    def start(self, t: Trial, role: str, failpoint: dict | None = None) -> Running:
        """Launches the command on the trial's workdir (logs under its folder as `role`)."""
        env = self.env if failpoint is None else {**self.env, "JAXAMP_FAILPOINT": json.dumps(failpoint)}
        return Running(self.command(t.workdir, failpoint), env, t.folder / "logs", role)

    def finish(self, t: Trial, run: Running) -> Launch:
        """Waits for `run` (killed when it hangs past 10 T + 60 s), records and returns its launch."""
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
        """`start`, then `finish`."""
        return self.finish(t, self.start(t, role, failpoint))

    def finished(self, workdir: Path) -> bool:
        """summary.json says the run ended at --steps (not stopped by a signal)."""
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
                                f"{last_line(launch.stderr)}")
            return
        t.violations.append(f"not finished after {self.args.max_reruns} reruns")

    def wait_until(self, run: Running, instant: float) -> bool:
        """Sleeps until `instant` seconds after launch; False when the run ended first."""
        while run.alive() and time.monotonic() - run.started < instant:
            time.sleep(0.005)
        return run.alive()

    def wait_records(self, t: Trial, run: Running, count: int) -> bool:
        """Waits until metrics.jsonl holds `count` records; False when the run ended first."""
        while run.alive() and len(read_records(t.workdir)) < count:
            time.sleep(0.01)
        return run.alive()

    def where(self, workdir: Path) -> str:
        """Where the run stood: records written, committed steps, saves cut short."""
        folder = workdir / "checkpoints"
        entries = sorted(os.listdir(folder)) if folder.is_dir() else []
        steps = sorted(int(e) for e in entries if e.isdigit())
        cut = sorted(e.split(".")[0] for e in entries if ".orbax-checkpoint-tmp" in e)
        records = read_records(workdir)
        return (f"records to step {records[-1]['step'] if records else 0}, committed steps {steps}"
                + (f", saves cut short {cut}" if cut else ""))

    def mount(self, t: Trial) -> None:
        """Puts the trial's workdir on a tmpfs twice the clean run's size."""
        t.fs = Tmpfs(t.folder / "mnt", max(4, 2 * self.ref_bytes // 2**20 + 2))
        t.workdir = t.fs.path / "run"


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
    """One trial of `kind`, judged; its folder deleted when it meets every goal (else kept, tmpfs copied out)."""
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
    """A generated corpus of 8,000 random words (about 40 kB) at `path`."""
    words = np.array("to be or not to be that is the question whether tis nobler in the mind\n".split(" "))
    path.write_text(" ".join(np.random.default_rng(0).choice(words, 8000)), encoding="utf-8")
    return path


def clean_run(c: Campaign, workdir: Path) -> tuple[Launch, float]:
    """One clean launch on `workdir` and its seconds; RuntimeError unless it finished."""
    started = time.monotonic()
    launch = Running(c.command(workdir), c.env, workdir.parent / "logs", workdir.name).finish(600)
    if launch.returncode != 0 or not c.finished(workdir):
        raise RuntimeError(f"the clean run failed (exit {launch.returncode}): {last_line(launch.stderr)}")
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
    ref = Reference(read_records(first), read_summary(first), leaves, launch_s)
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


def _totals(trials: list[Trial]) -> dict:
    """The figures of one table row (or of the headline) over `trials`: those that ran, bitwise, lost, ..."""
    ran = [t for t in trials if t.skipped is None]
    stopping = [launch for t in ran for launch in t.launches if launch.stopping]
    return {"ran": len(ran), "bitwise": sum(t.result.get("bitwise", False) for t in ran),
            "lost": sum(t.result.get("lost", 0) for t in ran),
            "duplicated": sum(t.result.get("duplicated", 0) for t in ran), "stopping": len(stopping),
            "max_lines": max((s.stderr_lines for s in stopping), default=0),
            "tracebacks": sum(launch.tracebacks for t in ran for launch in t.launches), "ok": sum(t.ok for t in ran)}


def kind_row(kind: str, trials: list[Trial]) -> str:
    """The per-kind table's row of `kind`."""
    n = _totals(trials)
    if not n["ran"]:
        return f"| {kind} | 0 | skipped: {trials[0].skipped} | | | | | | |"
    return harness.row([kind, n["ran"], n["bitwise"], n["lost"], n["duplicated"], n["stopping"], n["max_lines"],
                        n["tracebacks"], n["ok"]])


def trial_line(t: Trial) -> str:
    """The per-trial table's row of `t` (also printed as each trial ends)."""
    if t.skipped:
        return f"| {t.index} | {t.kind} | skipped: {t.skipped} | | |"
    launches = "; ".join(launch.brief() for launch in t.launches)
    result = "ok" if t.ok else "**FAILED**: " + "; ".join(t.violations)
    return f"| {t.index} | {t.kind} | {'; '.join(t.details)} | {launches} | {result} |"


DEFINITIONS = (
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
    "there too.")


def _header(c: Campaign, trials: list[Trial], argv: list[str], wall: float) -> list[str]:
    n = _totals(trials)
    skipped = f" ({len(trials) - n['ran']} skipped)" if n["ran"] < len(trials) else ""
    return [
        "# Fault campaign: random faults, resumed runs compared bitwise with a clean run",
        "",
        f"Command: `{harness.command_line(__file__, argv)}` ({wall:.0f} s)",
        f"Date: {harness.now()}",
        f"Machine: {harness.machine()}; trial folders in {c.tmp}",
        f"Each run: `python experiments/train_lm.py {shlex.join(c.base)} --workdir WORKDIR` "
        f"(T = {c.durations[0]:.1f} s per clean launch at the start, {c.ref.launch_s:.1f} s at the end; two clean "
        "runs agree bitwise)",
        "",
        f"**{n['bitwise']} of {n['ran']} trials resumed bitwise; {n['lost']} records lost; {n['stopping']} stopping "
        f"runs, at most {n['max_lines']} stderr lines each; {n['tracebacks']} tracebacks; {n['ok']} of {n['ran']} "
        f"trials meet every goal**{skipped}",
    ]


def report(c: Campaign, trials: list[Trial], argv: list[str], wall: float) -> str:
    """The markdown report: headline, the table per kind, each kind's own success, definitions, one row per trial."""
    by_kind: dict[str, list[Trial]] = {}
    for t in trials:
        by_kind.setdefault(t.kind, []).append(t)
    kinds = [kind for kind in KINDS if kind in by_kind]
    lines = [
        *_header(c, trials, argv, wall),
        "",
        *harness.table(["fault kind", "trials", "resumed bitwise", "records lost", "duplicated", "stopping runs",
                        "max stderr lines", "tracebacks", "goals met"], align="lrrrrrrrr"),
        *(kind_row(kind, by_kind[kind]) for kind in kinds),
        "",
        *harness.table(["fault kind", "success, on top of the goals"], [[kind, success(kind)] for kind in kinds]),
        "",
        DEFINITIONS,
        "",
        *harness.table(["#", "kind", "fault (what happened)", "launches", "result"], align="rllll"),
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
    harness.write_report(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
