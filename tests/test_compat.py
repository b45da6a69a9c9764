"""Runs written by an earlier jaxamp resume bitwise: small workdirs committed under tests/data/pre_layout, made by
jaxamp e8f75fa (before the library and the LM application were split into `jaxamp` and `jaxamp.lm`).

Each workdir was trained to step 2 (checkpoints at step 2); the same command with --steps 4 was run from scratch
by that version, and its step-4 checkpoint digests (sha256 of every array) and metrics records are the expected
values. This version resumes the step-2 workdir to step 4 and must reproduce them exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jaxamp.lm.config import TrainConfig
from jaxamp.lm.train import train

DATA = Path(__file__).resolve().parent / "data" / "pre_layout"
COMMON = dict(layers=1, heads=2, width=16, seq_len=16, batch_size=4, eval_every=2, eval_batches=1, log_every=1,
              sample_tokens=0, checkpoint_every=2, keep=5, warmup_steps=1, progress=False)
RUNS = {
    "fp16": dict(precision="fp16", growth_interval=1, init_scale=2.0**14, accum_steps=2, dropout=0.1, bias=True),
    "fp8": dict(precision="fp8", fp8_amax_history=16),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_workdir_of_the_earlier_layout_resumes_bitwise(tmp_path, name):
    workdir = tmp_path / "run"
    shutil.copytree(DATA / f"{name}_step2", workdir)
    corpus = tmp_path / "corpus.txt"
    shutil.copy(DATA / "corpus.txt", corpus)
    expected = json.loads((DATA / f"{name}_step4_expected.json").read_text())
    summary = train(TrainConfig(data=str(corpus), steps=4, workdir=str(workdir), **COMMON, **RUNS[name]))
    assert summary["steps"] == 4
    leaves = json.loads((workdir / "checkpoints" / "4" / "integrity" / "metadata").read_text())["leaves"]
    assert sorted(leaves) == sorted(expected["step4_leaves"])  # the same leaves first, then the same bytes
    assert leaves == expected["step4_leaves"]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        record.pop("tokens_per_s")
    assert [sorted(r) for r in records] == [sorted(r) for r in expected["records"]]
    assert records == expected["records"]
