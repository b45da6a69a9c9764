"""Shared test set-up: strict dtype promotion around our code, and the optional tinyshakespeare corpus."""

import importlib.util
import math
from pathlib import Path

import jax
import pytest

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture(autouse=True)
def strict_promotion():
    """Silent float16 -> float32 promotion fails inside every test (jax_numpy_dtype_promotion='strict')."""
    with jax.numpy_dtype_promotion("strict"):
        yield


@pytest.fixture
def shakespeare_path() -> Path:
    if not SHAKESPEARE.exists():
        pytest.skip(f"tinyshakespeare corpus not found at {SHAKESPEARE} (it lives in ../shared/data beside the repo)")
    return SHAKESPEARE


def table_rows(text: str) -> dict[str, list[str]]:
    """Markdown table rows keyed by their first cell (the first row with a key wins)."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.setdefault(cells[0], cells[1:])
    return rows


def number(cell: str) -> float:
    """A table cell as a finite float ("1,234", "0.99x", "**1.02x**", "5%")."""
    value = float(cell.replace(",", "").replace("*", "").rstrip("x%"))
    assert math.isfinite(value), cell
    return value


def load_script(rel: str):
    """Imports a script of the repo (e.g. "benchmarks/checkpoint_bench.py") as a module."""
    path = REPO / rel
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
