"""Argparse helpers shared by the scripts in `experiments/` and `benchmarks/`: check outputs before a long run."""

from __future__ import annotations

import argparse
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
