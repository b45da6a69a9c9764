"""Every script checks its flags before it runs: a bad one ends with a one-line usage error (exit 2), not a traceback
after minutes of work; `--tiny` runs never overwrite a committed result table."""

from __future__ import annotations

import pytest
from conftest import load_script


def _cases(tmp_path):
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("x")
    a_dir = tmp_path / "a_dir"
    a_dir.mkdir()
    return [
        ("benchmarks/scaling.py", ["--rounds", "0"], "--rounds must be >= 1"),
        ("benchmarks/scaling.py", ["--steps", "0"], "--steps must be >= 1"),
        ("benchmarks/scaling.py", ["--warmup", "-1"], "--warmup must be >= 0"),
        ("benchmarks/scaling.py", ["--width", "30"], "--heads (4) must divide --width (30)"),
        ("benchmarks/scaling.py", ["--precision", "fp7"], "--precision: unknown precision policy 'fp7'"),
        ("benchmarks/scaling.py", ["--out", str(a_dir)], "is a directory"),
        ("benchmarks/nanogpt_compare.py", ["--width", "30"], "--heads (4) must divide --width (30)"),
        ("benchmarks/nanogpt_compare.py", ["--data", str(tmp_path / "missing.txt")], "is not a file"),
        ("benchmarks/nanogpt_compare.py", ["--out", str(a_file / "x.md")], "is a file, so the folder cannot"),
        ("benchmarks/overhead.py", ["--out", str(a_dir)], "is a directory"),
        ("benchmarks/checkpoint_bench.py", ["--out", str(a_dir)], "is a directory"),
        ("benchmarks/checkpoint_bench.py", ["--tmp-dir", str(a_file)], "--tmp-dir"),
        ("experiments/paper_check.py", ["--loss-scale", "1e40"], "float32's maximum"),
        ("experiments/paper_check.py", ["--out-dir", str(a_file)], "is a file"),
        ("experiments/activation_report.py", ["--out", str(a_dir)], "is a directory"),
        ("benchmarks/gpu_throughput.py", ["--data", str(a_dir)], "train.bin not found"),
        ("benchmarks/gpu_throughput.py", ["--model", "gpt3"], "invalid choice: 'gpt3'"),
        ("benchmarks/memmap_rss.py", ["--sizes-mib", "0"], "--sizes-mib must be >= 1"),
        ("benchmarks/memmap_rss.py", ["--tmp-dir", str(a_file)], "--tmp-dir"),
        ("benchmarks/memmap_rss.py", ["--out", str(a_dir)], "is a directory"),
    ]


def test_bad_flags_are_usage_errors(tmp_path, capsys):
    for script, argv, message in _cases(tmp_path):
        module = load_script(script)
        with pytest.raises(SystemExit) as info:
            module.parse_args(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert info.value.code == 2, (script, argv)
        assert ": error: " in err[-1] and message in err[-1], (script, argv, err)


def test_tiny_runs_never_overwrite_committed_tables():
    bench = load_script("benchmarks/checkpoint_bench.py")
    assert bench.parse_args(["--tiny"]).out == bench.TINY_OUT != bench.DEFAULT_OUT
    assert bench.parse_args([]).out == bench.DEFAULT_OUT
    gpu = load_script("benchmarks/gpu_throughput.py")
    assert gpu.parse_args(["--tiny"]).out != gpu.parse_args([]).out
    rss = load_script("benchmarks/memmap_rss.py")
    assert rss.parse_args(["--tiny"]).out == str(rss.TINY_OUT) != str(rss.DEFAULT_OUT) == rss.parse_args([]).out
