"""Smoke test of benchmarks/nanogpt_compare.py at a tiny size (a subprocess): jaxamp figures always, PyTorch figures
when torch is importable (else the "PyTorch not installed" line), equal parameter counts and equal losses from equal
initial weights."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import number, table_rows

REPO = Path(__file__).resolve().parents[1]
# CPU only, and XLA's cheapest backend optimisation: the subprocess's time is mostly imports and one compile.
FAST_ENV = {**os.environ, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()}
HAS_TORCH = importlib.util.find_spec("torch") is not None
pytestmark = pytest.mark.slow  # every test reads the report of one tiny run (a subprocess)


@pytest.fixture(scope="module")
def report(tmp_path_factory, text_corpus):
    out = tmp_path_factory.mktemp("nanogpt") / "nanogpt_compare.md"
    proc = subprocess.run(
        [sys.executable, "benchmarks/nanogpt_compare.py", "--data", str(text_corpus), "--layers", "1", "--heads", "2",
         "--width", "32",
         "--seq-len", "16", "--batch-size", "4", "--rounds", "2", "--steps", "2", "--warmup", "1", "--pause", "0",
         "--threads", "1", "--check-steps", "2", "--out", str(out)],
        cwd=REPO, env=FAST_ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text in proc.stdout  # printed as well
    return text


def _lm_params(text_corpus: Path) -> int:
    """jaxamp's own count for the report's model (1 layer, width 32, seq 16, no biases) on this corpus's vocab."""
    import jax
    import jax.numpy as jnp

    from jaxamp.lm.data import CharDataset, load_text
    from jaxamp.lm.model import TransformerConfig, TransformerLM, count_params

    vocab = CharDataset.from_text(load_text(text_corpus), 16).tokenizer.vocab_size
    cfg = TransformerConfig(vocab_size=vocab, seq_len=16, num_layers=1, num_heads=2, width=32, use_bias=False)
    return count_params(TransformerLM(cfg).init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"])


def test_jaxamp_figures_and_context(report, text_corpus):
    rows = table_rows(report)
    jax_row = rows["jaxamp fp32 (jitted step_fn)"]
    tokens_per_s, low, high, ms_per_step, first_step, params = (number(c) for c in jax_row[:6])
    assert 0 < low <= tokens_per_s <= high and ms_per_step > 0 and first_step > 0
    assert params == _lm_params(text_corpus)  # e.g. 14,976 for tinyshakespeare's whole 65-character vocabulary
    assert "shared 2-core box" in report and "jax " in report and "os.cpu_count()" in report
    # The published figure and our reference run (when its summary or table exists) are quoted.
    assert "| nanoGPT README" in report and "| 1.88 |" in report


def test_pytorch_figures_or_not_installed_line(report):
    rows = table_rows(report)
    torch_rows = {k: v for k, v in rows.items() if k.startswith("PyTorch fp32 eager")}
    assert torch_rows, "no PyTorch row"
    if not HAS_TORCH:
        assert any("PyTorch not installed" in cells[0] for cells in torch_rows.values())
        return
    (label, cells), = torch_rows.items()
    assert label == "PyTorch fp32 eager (nanoGPT copy), 1 thread"
    assert number(cells[0]) > 0 and number(cells[3]) > 0
    assert number(rows["PyTorch (1 thread) / jaxamp"][0]) > 0


def test_parameter_counts_and_losses_agree(report, text_corpus):
    pytest.importorskip("torch")
    rows = table_rows(report)
    assert rows["jaxamp fp32 (jitted step_fn)"][5] == rows["PyTorch fp32 eager (nanoGPT copy), 1 thread"][5]
    n = _lm_params(text_corpus)  # the corpus slice's vocabulary sets it (59 characters of tinyshakespeare: 14,784)
    assert f"Parameter counts match: jaxamp {n:,}, PyTorch {n:,}" in report
    diff = re.search(r"max \|difference\| ([0-9.e+-]+) \(loss\), ([0-9.e+-]+) \(any parameter", report)
    assert diff, "no equivalence line"
    assert float(diff.group(1)) < 1e-4 and float(diff.group(2)) < 1e-4, diff.group(0)
