"""Shared test set-up: strict dtype promotion around our code, and the optional tinyshakespeare corpus.

`../shared` (beside the checkout) exists in CI, not on a user's fresh machine. Every test that reads it goes through
the fixtures below, which skip (`shakespeare_path`) or adapt (`text_corpus`) when it is absent, and carries the
`shared_data` marker (added here). `JAXAMP_TEST_WITHOUT_SHARED=1` makes them behave as on a machine without it; CI
runs `pytest -m shared_data` a second time that way (.ci/run).

The `slow` marker (pyproject.toml's addopts leave those tests out of `python -m pytest -q`) is written on the tests
themselves (tests/README.md).
"""

import importlib.util
import math
import os
from pathlib import Path

import jax
import pytest

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
WITHOUT_SHARED = os.environ.get("JAXAMP_TEST_WITHOUT_SHARED") == "1"
SHARED_FIXTURES = ("shakespeare_path", "text_corpus")


def shakespeare() -> Path | None:
    """tinyshakespeare's path, or None where ../shared is absent (or JAXAMP_TEST_WITHOUT_SHARED=1 says so)."""
    return None if WITHOUT_SHARED or not SHAKESPEARE.exists() else SHAKESPEARE


def pytest_itemcollected(item):
    """Marks as each test is collected (before any collection_modifyitems, pytest-xdist's included)."""
    if any(name in getattr(item, "fixturenames", ()) for name in SHARED_FIXTURES):
        item.add_marker(pytest.mark.shared_data)
    group = _module_fixture_group(item)
    if group:  # under `-n 2 --dist loadgroup` (CI), the tests sharing an expensive module fixture share a worker
        item.add_marker(pytest.mark.xdist_group(group))


def _module_fixture_group(item) -> str | None:
    """`file::fixture` of the first module-scoped fixture defined in the test's own file that it uses, or None."""
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in (info.name2fixturedefs.get(name, ()) if info else ()):
            if fixturedef.scope == "module" and str(fixturedef.baseid).endswith(item.path.name):
                return f"{item.path.name}::{name}"
    return None


@pytest.fixture(autouse=True)
def strict_promotion():
    """Silent float16 -> float32 promotion fails inside every test (jax_numpy_dtype_promotion='strict')."""
    with jax.numpy_dtype_promotion("strict"):
        yield


@pytest.fixture(scope="session")
def shakespeare_path() -> Path:
    """tinyshakespeare; skips where it is absent (a test whose expected values are tinyshakespeare's)."""
    path = shakespeare()
    if path is None:
        pytest.skip(f"tinyshakespeare corpus not found at {SHAKESPEARE} (it lives in ../shared/data beside the repo)")
    return path


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory) -> Path:
    """60,000 characters of tinyshakespeare, or of the default corpus (the stdlib's sources) where it is absent."""
    from jaxamp.lm.data import default_corpus_text

    path = shakespeare()
    text = path.read_text(encoding="utf-8")[:60_000] if path else default_corpus_text(60_000)
    out = tmp_path_factory.mktemp("data") / ("shakespeare_slice.txt" if path else "stdlib_slice.txt")
    out.write_text(text, encoding="utf-8")
    return out


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
