"""The fault kinds of `benchmarks/fault_campaign.py` (its docstring describes each): `FAULTS[kind](campaign, trial)`
runs the trial's first launches, injects the fault, notes what happened, states the kind's own expectations and
reruns the command as a user would (`campaign.resume`). The campaign then judges the finished workdir.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from benchmarks.fault_runs import Trial, committed_steps, damage, last_line, snapshot

if TYPE_CHECKING:
    from benchmarks.fault_campaign import Campaign

KINDS = ("sigkill", "sigkill-step", "sigkill-save", "sigkill-commit", "sigkill-delete", "sigkill-append", "sigterm",
         "sigint", "disk-full", "corrupt-checkpoint", "corrupt-metrics", "corrupt-summary", "read-only",
         "vanished-checkpoint", "two-runs")
MOUNT_KINDS = ("disk-full", "read-only")  # they need a tmpfs: skipped where mount is not allowed
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


def success(kind: str) -> str:
    """What `kind` must show on top of the goals (every sigkill-* kind: the sigkill line)."""
    return KIND_SUCCESS[kind.split("-")[0] if kind.startswith("sigkill") else kind]


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
    """sigkill: SIGKILL at a uniformly random instant in [0, T] after launch."""
    instant = t.rng.uniform(0, c.ref.launch_s)
    run = c.start(t, "faulted")
    hit = run.signal_at(instant, signal.SIGKILL)
    c.finish(t, run)
    t.note(f"SIGKILL {instant:.2f} s after launch" + ("" if hit else " (the run had ended)")
           + f" ({c.where(t.workdir)})")
    c.resume(t)


def _failpoint(c: Campaign, t: Trial, at: str) -> dict:
    """A random failpoint spec for `benchmarks/_fault_child.py` at event `at`."""
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
    """sigkill-step ... sigkill-append: the fault of a failpoint at event `at`."""
    def fault(c: Campaign, t: Trial) -> None:
        spec = _failpoint(c, t, at)
        launch = c.launch(t, "faulted", spec)
        t.note(_describe_failpoint(spec) + ("" if launch.killed else " (never reached: the run ended)")
               + f" ({c.where(t.workdir)})")
        c.resume(t)

    return fault


def fault_signal(sig: signal.Signals) -> Callable[[Campaign, Trial], None]:
    """sigterm, sigint: `sig` at a uniformly random instant in [0, T]."""
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
    """disk-full: a ballast file fills the workdir's tmpfs at a random instant; freed after the run."""
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
    """corrupt-checkpoint, -metrics, -summary: `damage` to a file of `target` after a stopped or finished run."""
    def fault(c: Campaign, t: Trial) -> None:
        stop = "SIGTERM at a random step" if target == "summary" else "SIGKILL at a random step"
        _stop_run(c, t, t.rng.choice([stop, "finished"]))
        if target == "checkpoint":
            steps = committed_steps(t.workdir)
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
    """read-only: one run on the workdir's tmpfs remounted read-only, which must change no file."""
    c.mount(t)
    _stop_run(c, t, t.rng.choice(["never started", "SIGKILL at a random instant", "finished"]))
    before = snapshot(t.fs.path)
    t.fs.remount(read_only=True)
    launch = c.launch(t, "read-only")
    t.note(f"read-only run: exit {launch.returncode}: {last_line(launch.stderr or launch.stdout)}")
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
    steps = committed_steps(t.workdir)
    if not steps:
        return "no committed step to delete"
    step = t.rng.choice(steps)
    shutil.rmtree(folder / str(step), ignore_errors=True)
    return f"step {step} of {steps} deleted"


def fault_vanished(c: Campaign, t: Trial) -> None:
    """vanished-checkpoint: a step folder or the whole checkpoints folder deleted, during or between runs."""
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
    """two-runs: the command twice on one workdir, the second 0 to T/2 s after the first."""
    gap = t.rng.uniform(0, c.ref.launch_s / 2)
    first = c.start(t, "first")
    time.sleep(gap)
    second = c.start(t, "second")
    a, b = c.finish(t, first), c.finish(t, second)
    t.note(f"second run {gap:.2f} s after the first: exits {a.returncode} and {b.returncode}")
    for launch in (a, b):
        t.expect(launch.returncode == 0 or (launch.returncode == 2 and "in use by another run" in launch.stderr),
                 f"{launch.role} run: exit {launch.returncode}: {last_line(launch.stderr)}")
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


