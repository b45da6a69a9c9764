"""Argparse helpers shared by the scripts in `experiments/` and `benchmarks/`: check outputs before a long run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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
    """Usage errors for `args` attributes that must be >= 1 (`positive`) or >= 0, and for heads not dividing width
    (checked when `args` has both)."""
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in nonnegative:
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    if hasattr(args, "width") and hasattr(args, "heads") and args.width % args.heads:
        parser.error(f"--heads ({args.heads}) must divide --width ({args.width})")


def write_report(path: str | Path, text: str) -> None:
    """Writes a markdown report (creating its folder) and prints it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(text)


def command_line(argv=None) -> str:
    """The command that ran this script, for a report: `python <script relative to the cwd> <args>` (`argv`, else
    `sys.argv[1:]`)."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(Path.cwd().resolve())
    except ValueError:
        pass
    return " ".join(["python", str(script), *(argv if argv is not None else sys.argv[1:])])
