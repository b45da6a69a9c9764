"""What the benchmark scripts share, written once: flag checks, the report's command, machine and date lines,
markdown tables, interleaved A/B timing and its ratios, and writing the report (markdown, JSON).

A script starts with

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
    from benchmarks import harness  # noqa: E402

Nothing here imports jax at import time; only `machine()` (without `backend=False`) and `versions()` start its
backend, so a parent process that leaves the accelerator to its children can use the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"  # the corpus of the reference runs
SHARED_BOX = ("a shared 2-core machine with other jobs running: absolute figures move by tens of percent from run to "
              "run; the interleaved ratios are the steadier figures")

# ---------------------------------------------------------------------------------------------------------------------
# Flags: checked before the run, one-line usage errors (exit 2). check_output and check_sizes are copies of
# jaxamp.lm.cli's, so that the benchmarks and the experiments can change apart.


def check_output(parser: argparse.ArgumentParser, flag: str, path: str | Path, *, directory: bool = False) -> None:
    """Ends the script with a one-line usage error now, not after the run, if `path` cannot be written.

    Args:
      parser: the script's parser (its `error` prints the message and exits with status 2).
      flag: the flag's name for the message, e.g. "--out".
      path: a file to write (or, with `directory`, a folder to create and write into).
      directory: `path` is a folder.
    """
    path = Path(path)
    if path.exists() and path.is_dir() != directory:
        parser.error(f"{flag} {path} is {'a file' if directory else 'a directory'}; pass "
                     f"{'a folder' if directory else 'a file name'}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                parser.error(f"{flag} {path}: {parent} is a file, so the folder cannot be created")
            break


def check_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace, positive: tuple[str, ...],
                nonnegative: tuple[str, ...] = ()) -> None:
    """Usage errors for `args` attributes that must be >= 1 (`positive`) or >= 0 (`nonnegative`), and for heads not
    dividing width (checked when `args` has both)."""
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in nonnegative:
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    if hasattr(args, "width") and hasattr(args, "heads") and args.width % args.heads:
        parser.error(f"--heads ({args.heads}) must divide --width ({args.width})")


def check_file(parser: argparse.ArgumentParser, flag: str, path: str | Path | None, hint: str = "") -> None:
    """A usage error when `path` is given and is not a file (`hint` ends the message, e.g. "; pass ...")."""
    if path is not None and not Path(path).is_file():
        parser.error(f"{flag} {path} is not a file{hint}")


def thread_counts(text: str) -> list[int]:
    """An argparse type: comma-separated thread counts (each >= 1), deduplicated in order; "2,1" -> [2, 1]."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated thread counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def add_model_flags(parser: argparse.ArgumentParser, *, layers: int = 4, heads: int = 4, width: int = 128,
                    seq_len: int = 64, batch_size: int = 12) -> None:
    """The LM's size flags (`--layers --heads --width --seq-len --batch-size`); the defaults are nanoGPT's
    shakespeare_char CPU recipe."""
    parser.add_argument("--layers", type=int, default=layers, help="Transformer blocks (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=heads, help="attention heads (default: %(default)s)")
    parser.add_argument("--width", type=int, default=width, help="model width, channels (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=seq_len, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=batch_size, help="sequences per step (default: %(default)s)")


def add_timing_flags(parser: argparse.ArgumentParser, *, rounds: int, steps: int, warmup: int,
                     pause: float | None = None, first_call_included: bool = True) -> None:
    """The interleaved measurement's flags: `--rounds --steps --warmup`, and `--pause` when it has a default.

    Args:
      parser: the script's parser.
      rounds: `--rounds`' default.
      steps: `--steps`' default (timed steps per variant per round).
      warmup: `--warmup`'s default (untimed steps per variant before the rounds).
      pause: `--pause`'s default in seconds (None: no such flag).
      first_call_included: `--warmup` counts the first call (the compile); else it counts the steps after it.
    """
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved timing rounds (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per variant per round (default: "
                        "%(default)s)")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps per variant first, "
                        + ("the first call (its compile) included" if first_call_included else "after the first call")
                        + " (default: %(default)s)")
    if pause is not None:
        parser.add_argument("--pause", type=float, default=pause, help="seconds idle before each timed window "
                            "(default: %(default)s)")


def command_line(script: str | Path, argv: Sequence[str] | None = None) -> str:
    """The command for a report: `python benchmarks/x.py ARGS` (`script`: the script's `__file__`; `argv`: its
    arguments, default `sys.argv[1:]`; shell-quoted)."""
    path = Path(script).resolve()
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return " ".join(["python", str(rel), shlex.join(sys.argv[1:] if argv is None else list(argv))]).rstrip()


# ---------------------------------------------------------------------------------------------------------------------
# The machine and the date.


def load_average() -> str:
    """The 1, 5 and 15-minute load averages, "1.23, 1.00, 0.90" ("n/a" where the OS has none)."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except (OSError, AttributeError):
        return "n/a"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(*, backend: bool = True, when: str = "", load: bool = True) -> str:
    """The machine line: OS, CPU model, cores, Python and jax versions, load average.

    Args:
      backend: name jax's default backend (starts it: a parent that leaves the accelerator to its children passes
        False).
      when: words after "load average", e.g. "at the start".
      load: end with the load average.
    """
    import jax

    jax_text = f"jax {jax.__version__}" + (f" on {jax.default_backend()}" if backend else "")
    text = (f"{platform.platform()} ({platform.machine()}), {cpu_model()}, os.cpu_count()={os.cpu_count()}, "
            f"python {platform.python_version()}, {jax_text}")
    return text + (f"; load average{' ' + when if when else ''} {load_average()}" if load else "")


def versions() -> str:
    """python, jax (with its backend), flax, optax and numpy versions."""
    import flax
    import jax
    import numpy as np
    import optax

    return (f"python {platform.python_version()}, jax {jax.__version__} ({jax.default_backend()}), "
            f"flax {flax.__version__}, optax {optax.__version__}, numpy {np.__version__}")


def now() -> str:
    """The date line's date: "2025-01-31 12:34 UTC"."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ---------------------------------------------------------------------------------------------------------------------
# Markdown.


def row(cells: Iterable) -> str:
    """One markdown table row: `| a | b | |` (an empty cell is one space)."""
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def table(header: Sequence[str], rows: Iterable[Iterable] = (), align: str = "") -> list[str]:
    """A markdown table's lines: header, separator, rows.

    Args:
      header: the column names.
      rows: each a sequence of cells (formatted already).
      align: one letter per column, "l" or "r" ("r": `---:`); default all `---`.
    """
    seps = ["---:" if a == "r" else "---" for a in (align or "l" * len(header))]
    return [row(header), row(seps), *(row(r) for r in rows)]


def mib(n: float | None, digits: int = 1) -> str:
    """Bytes as MiB, "1,234.5" ("n/a" for None)."""
    return "n/a" if n is None else f"{n / 2**20:,.{digits}f}"


# ---------------------------------------------------------------------------------------------------------------------
# Interleaved timing.


def rotated(items: Sequence, r: int) -> list:
    """`items` starting at position `r` (mod its length): round r's order in an interleaved measurement."""
    k = r % len(items)
    return list(items[k:]) + list(items[:k])


def interleaved(windows: dict[str, Callable], *, rounds: int, steps: int, warmup: int, pause: float = 0.0,
                before: Callable[[str], None] | None = None) -> tuple[dict, dict]:
    """Times several step functions in one process, round-robin, so drifts in the machine's load hit them alike.

    Each `windows[name](idx)` runs the steps whose indices are in `idx` and returns once they are done (it blocks),
    with None or its own measure of the window in seconds (recorded instead of the wall time, e.g. the median of
    its per-step times). First every window runs step 0 alone (timed: the first call, compile included) and steps
    1..warmup-1 untimed; then `rounds` rounds time one window of `steps` steps per name, the first name rotating
    from round to round.

    Args:
      windows: name -> callable(range) running those steps.
      rounds: timed rounds.
      steps: steps per timed window.
      warmup: untimed warm-up steps, the first call included.
      pause: seconds idle before each timed window (worker threads of the previous one go quiet).
      before: optional callable(name) run before each of that name's windows, outside the timing.

    Returns:
      `(first_call_s, per_round_s)`: seconds of each name's first call, and its seconds per timed window by round.
    """
    first = {}
    for name, window in windows.items():
        if before is not None:
            before(name)
        first[name] = _timed(window, range(0, 1))
        if warmup > 1:
            window(range(1, warmup))
    per_round = {name: [] for name in windows}
    for r in range(rounds):
        idx = range(warmup + r * steps, warmup + (r + 1) * steps)
        for name in rotated(list(windows), r):
            if before is not None:
                before(name)
            time.sleep(pause)  # let the other side's worker threads go idle (OpenMP/Eigen spin-waits)
            per_round[name].append(_timed(windows[name], idx))
    return first, per_round


def _timed(window: Callable, idx: range) -> float:
    t0 = time.perf_counter()
    own = window(idx)
    return time.perf_counter() - t0 if own is None else own


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """a/b round by round (the rounds of one interleaved measurement)."""
    return [x / y for x, y in zip(a, b)]


def ratio_of_medians(a: Sequence[float], b: Sequence[float]) -> float:
    """median(a) / median(b)."""
    return statistics.median(a) / statistics.median(b)


def ratio_cells(a: Sequence[float], b: Sequence[float]) -> str:
    """Two table cells: the ratio of medians a/b (bold), then the paired ratios' median (min-max)."""
    pairs = sorted(paired_ratios(a, b))
    return (f"**{ratio_of_medians(a, b):.3f}x** | {statistics.median(pairs):.3f}x "
            f"({pairs[0]:.3f}-{pairs[-1]:.3f})")


def spread(values: Sequence[float], scale: float = 1.0, fmt: str = ".1f") -> str:
    """"min-max" of `values` times `scale`."""
    return f"{min(values) * scale:{fmt}}-{max(values) * scale:{fmt}}"


def uncached_compiles() -> None:
    """Every XLA compile of this process is a compile, never a read of a persistent compilation cache: benchmarks
    time and count compiles, and a `JAX_COMPILATION_CACHE_DIR` set by the user (or by `.ci/run` for the tests and
    the scripts they start) would turn them into cache reads. Call it before the first compile."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)


class CompileEvents:
    """jax.monitoring's trace, lowering and XLA backend-compile events, counted and timed per label (the label set
    by `attribute` while they happen). One per process: `compile_events()`."""

    KINDS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
             "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
             "/jax/core/compile/backend_compile_duration": "compile"}

    def __init__(self):
        import jax

        uncached_compiles()
        self.label: str | None = None
        self.counts: dict[tuple[str, str], int] = {}
        self.seconds: dict[tuple[str, str], float] = {}
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        del kwargs
        kind = self.KINDS.get(event)
        if kind is not None and self.label is not None:
            key = (self.label, kind)
            self.counts[key] = self.counts.get(key, 0) + 1
            self.seconds[key] = self.seconds.get(key, 0.0) + duration

    @contextlib.contextmanager
    def attribute(self, label: str | None):
        """Events inside the block count towards `label` (None: towards nothing)."""
        previous, self.label = self.label, label
        try:
            yield
        finally:
            self.label = previous

    def count(self, label: str, kind: str = "compile") -> int:
        """Events of `kind` ("trace", "lower" or "compile") attributed to `label` so far."""
        return self.counts.get((label, kind), 0)

    def secs(self, label: str, kind: str) -> float:
        """Their summed duration in seconds."""
        return self.seconds.get((label, kind), 0.0)


_EVENTS: list[CompileEvents] = []


def compile_events() -> CompileEvents:
    """The process's `CompileEvents` (registered with jax.monitoring on the first call)."""
    if not _EVENTS:
        _EVENTS.append(CompileEvents())
    return _EVENTS[0]


def copy_tree(tree):
    """A copy of every jax array in `tree` (a state can then be donated without losing the original)."""
    import jax

    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


# ---------------------------------------------------------------------------------------------------------------------
# Writing.


def log(message: str) -> None:
    """A progress line on stderr (the report goes to stdout)."""
    print(message, file=sys.stderr, flush=True)


def write_report(path: str | Path, text: str, *, echo: bool = True) -> None:
    """Writes a markdown report (creating its folder) and, with `echo`, prints it (and "wrote PATH" on stderr)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    if echo:
        print(text, end="" if text.endswith("\n") else "\n", flush=True)
        log(f"wrote {path}")


def write_or_print(path: str | Path | None, text: str) -> None:
    """`write_report(path, text)`, or the report on stdout when there is no path (a `--tiny` run without `--out`)."""
    if path:
        write_report(path, text)
    else:
        print(text, end="")


def write_json(path: str | Path, data) -> None:
    """Writes `data` as indented JSON (creating the folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def run_table(doc: str, table: Callable[[list[Path]], str], default_out: Path, argv=None, *,
              needs: tuple[str, ...] = (), hint: str = "") -> int:
    """The command line of a script that tabulates run directories (`RUN ... [--out FILE]`): each RUN must hold
    summary.json and the folders `needs`; else one error line naming the missing ones (with `hint`), exit 2.

    Args:
      doc: the script's docstring (its first line describes it).
      table: the runs -> the markdown report.
      default_out: `--out`'s default.
      argv: the arguments (default `sys.argv[1:]`).
      needs: folders each run must hold besides summary.json.
      hint: what to do about a missing one.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=default_out.relative_to(REPO))
    args = parser.parse_args(argv)
    check_output(parser, "--out", args.out)
    missing = [str(r) for r in args.runs
               if not (r / "summary.json").exists() or not all((r / n).is_dir() for n in needs)]
    if missing:
        what = " or ".join(["summary.json", *(f"{n}/" for n in needs)])
        print(f"error: no {what} in {', '.join(missing)}; {hint}", file=sys.stderr)
        return 2
    write_report(args.out, table(args.runs))
    return 0
