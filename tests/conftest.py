"""Shared test set-up: strict dtype promotion around our code, and the optional tinyshakespeare corpus."""

from pathlib import Path

import jax
import pytest

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
