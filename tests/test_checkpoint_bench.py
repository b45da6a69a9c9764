"""Smoke test of benchmarks/checkpoint_bench.py (tiny states, one repetition, in-process)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_checkpoint_bench_tiny(tmp_path, capsys):
    bench = load_script("benchmarks/checkpoint_bench.py")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a small corpus for the checkpoint benchmark smoke test.\n" * 20)
    out = tmp_path / "checkpoint.md"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert bench.main(["--tiny", "--reps", "1", "--data", str(corpus), "--tmp-dir", str(scratch),
                       "--out", str(out)]) == 0
    text = out.read_text()
    assert text in capsys.readouterr().out
    assert "Command: `python benchmarks/checkpoint_bench.py --tiny" in text and "Machine:" in text
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| reference") or line.startswith("| synthetic-tiny")]
    assert [(r[0], r[3]) for r in rows] == [("reference", "on"), ("reference", "off"), ("synthetic-tiny", "on"),
                                           ("synthetic-tiny", "off")]
    for r in rows:
        blocking, complete, cold, warm, disk = map(float, r[4:9])
        assert 0 < blocking <= complete and cold > 0 and warm > 0 and disk > 0
    assert list(scratch.iterdir()) == []  # the checkpoints are deleted afterwards
