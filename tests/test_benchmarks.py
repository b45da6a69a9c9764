"""Smoke tests of the benchmark scripts (tiny sizes, as subprocesses) and of the run plotter."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_script, number, table_rows

import jaxamp
from jaxamp.lm.plotting import PlotError, plot_runs

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# CPU only, and XLA's cheapest backend optimisation: the subprocesses' time is almost all compilation.
FAST_ENV = {**os.environ, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()}


def run_script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=FAST_ENV, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_overhead_benchmark_tiny(tmp_path):
    out = tmp_path / "overhead.md"
    proc = run_script("benchmarks/overhead.py", "--layers", "1", "--width", "16", "--heads", "2", "--rounds", "2",
                      "--steps", "2", "--warmup", "1", "--no-flax-default-check", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text in proc.stdout  # printed as well
    assert "os.cpu_count()" in text and "jax " in text and "shared 2-core machine" in text
    rows = table_rows(text)
    labels = {key[:3]: cells for key, cells in rows.items() if key[:4] in {"(a) ", "(b) ", "(c) ", "(d) ", "(e) "}}
    assert sorted(labels) == ["(a)", "(b)", "(c)", "(d)", "(e)"]
    for label, cells in labels.items():
        median_ms, tokens_per_s, first_call, xla_compile, traces = (
            number(cells[0]), number(cells[2]), number(cells[3]), number(cells[7]), number(cells[8]))
        assert median_ms > 0 and tokens_per_s > 0 and first_call > 0 and xla_compile > 0, (label, cells)
        assert traces == 1, f"{label} traced {traces} times"  # every variant compiles once over the run
        assert number(cells[10]) > 0 and number(cells[11]) > 0, (label, cells)  # XLA bytes accessed, GFLOP
    ratios = [key for key in rows if key.startswith(("(a)/(b)", "(a)/(c)", "(d)/(e)"))]
    assert len(ratios) == 3
    for key in ratios:
        assert number(rows[key][0]) > 0 and number(rows[key][1]) > 0, rows[key]  # of medians, of fastest rounds
        assert 0.5 < number(rows[key][3]) < 2 and 0.5 < number(rows[key][4]) < 2, rows[key]  # bytes, flops ratios


@pytest.mark.slow
def test_nnx_overhead_benchmark_tiny(tmp_path):
    out = tmp_path / "nnx.md"
    proc = run_script("benchmarks/nnx_overhead.py", "--layers", "1", "--width", "8", "--heads", "1", "--seq-len", "8",
                      "--batch-size", "2", "--rounds", "2", "--steps", "1", "--warmup", "0", "--probe-rounds", "0",
                      "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text in proc.stdout and "os.cpu_count()" in text and "Not measured (`--probe-rounds 0`)" in text
    rows = table_rows(text)
    for label in ("(a)", "(f)", "(g)", "(h)"):
        cells = next(cells for key, cells in rows.items() if key.startswith(label + " "))
        assert number(cells[0]) > 0 and number(cells[1]) > 0 and number(cells[2]) > 0, (label, cells)
        assert number(cells[3]) == 1 and number(cells[4]) == 1, (label, cells)  # one trace, one compile each
    # XLA cost: the NNX step is the functional step's program (it adds one RNG-count increment: at this tiny width
    # that is 0.05% of the bytes, 1.000x or 1.001x after rounding)
    ratios = re.search(r"\(([0-9.]+)x, ([0-9.]+)x\): the same program", text)
    assert ratios and all(abs(float(r) - 1.0) <= 0.002 for r in ratios.groups()), text
    # The probe table, from synthetic timings: extra ms over (a) and its share of (a)'s reference step.
    module = load_script("benchmarks/nnx_overhead.py")
    args = module.parse_args(["--out", str(tmp_path / "unused.md")])
    per_round = {"a": [0.100, 0.100], "f": [0.110, 0.112], "g": [0.101, 0.103], "h": [0.102, 0.102]}
    res = {"machine": "m", "cfg": module.TransformerConfig(vocab_size=65, seq_len=64, num_layers=4, num_heads=4,
                                                            width=128),
           "n_params": 1, "n_variables": 2, "cost": {"a": {"bytes": 1.0, "flops": 1.0}, "nnx": {"bytes": 1.0,
                                                                                                "flops": 1.0}},
           "median": {n: sum(v) / 2 for n, v in per_round.items()}, "per_round": per_round,
           "first_call": dict.fromkeys("afgh", 1.0), "traces": dict.fromkeys("afgh", 1),
           "compiles": dict.fromkeys("afgh", 1), "skipped": dict.fromkeys("afgh", False),
           "probe": {"a": 0.001, "f": 0.006, "g": 0.002, "h": 0.0015}}
    probe_rows = table_rows(module.report(args, res).split("## Python-side")[1])
    g = next(cells for key, cells in probe_rows.items() if key.startswith("(g) "))
    assert g[1:] == ["+1.00", "+1.0%", "1.010x"], g
    assert "(g) adds +1.0% of (a)'s reference step in Python (within the goal)" in module.report(args, res)


@pytest.mark.slow
def test_gpu_throughput_tiny(tmp_path):
    out = tmp_path / "gpu.md"
    first = ("fp32-highest", "fp32", "bf16", "bf16-fused", "fp16", "fp8")
    proc = run_script("benchmarks/gpu_throughput.py", "--tiny", "--steps", "2", "--precisions", *first, "--out",
                      str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text in proc.stdout
    assert "device: cpu" in text and "jax " in text
    main_rows, memory_rows = (table_rows(part) for part in text.split("## Memory"))
    for precision in first:
        cells = main_rows[precision]
        assert number(cells[0]) > 0 and number(cells[2]) > 0, cells  # step ms, tokens/s
        assert cells[3] == "n/a"  # MFU: no peak for a CPU
        mem = memory_rows[precision]
        assert all(number(c) >= 0 for c in mem), mem
        assert number(mem[-1]) > 0
    # The fused head + loss starts from the same weights and batch: the same first loss (to the table's 3 decimals).
    assert main_rows["bf16-fused"][9].split(" -> ")[0] == main_rows["bf16"][9].split(" -> ")[0]


# An XLA:GPU program's text as `compiled.as_text()` prints it (cut from a deviceless H200 compile): a Triton GEMM
# fusion of FP8 operands, one of bfloat16 operands, a cuBLASLt FP8 call, a cuBLAS call and cuDNN attention.
GPU_HLO = """
%gemm_fusion_dot_general.39_computation (parameter_0: f8e4m3fn[4096,768], parameter_1: f8e4m3fn[768,2304]) -> bf16 {
  %parameter_0 = f8e4m3fn[4096,768]{1,0} parameter(0), metadata={scheduling_name="parameter_0"}
  %parameter_1 = f8e4m3fn[768,2304]{1,0} parameter(1), metadata={scheduling_name="parameter_1"}
  %dot_general.0 = f32[4096,2304]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}
  ROOT %convert.1 = bf16[4096,2304]{1,0} convert(%dot_general.0)
}

%gemm_fusion_dot.12_computation (parameter_0.12: bf16[4096,768], parameter_1.6: f32[50304,768]) -> bf16[4096,50304] {
  %parameter_0.12 = bf16[4096,768]{1,0} parameter(0)
  %parameter_1.6 = f32[50304,768]{1,0} parameter(1)
  %convert.7 = bf16[50304,768]{1,0} convert(%parameter_1.6)
  ROOT %dot.3 = bf16[4096,50304]{1,0} dot(%parameter_0.12, %convert.7), lhs_contracting_dims={1}
}

ENTRY %main (p0: bf16[4096,768], p1: f8e4m3fn[768,2304]) -> bf16[4096,2304] {
  %cublas-lt-matmul.2 = (bf16[64,64]{1,0}, s8[8]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8"
  %cublas-gemm.1 = (f32[64,64]{1,0}, s8[8]{0}) custom-call(%c, %d), custom_call_target="__cublas$gemm"
  %fmha = (bf16[4,1024,12,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax"
}
"""


def test_gemm_census_counts_fp8_operands_in_triton_fusions_and_cublas_calls():
    """gpu_throughput's and gpu_compile's GEMM census: dots by their operands' types (a convert inside the fusion
    counts as what the dot reads), FP8 cuBLASLt calls, every GEMM once, cuDNN attention."""
    from benchmarks.gpu_step import custom_calls, dot_operand_dtypes

    assert dot_operand_dtypes(GPU_HLO) == [("f8e4m3fn", "f8e4m3fn"), ("bf16", "bf16")]
    assert custom_calls(GPU_HLO) == {"cudnn_attention": 1, "f8_gemm": 2, "gemm": 4}


@pytest.mark.parametrize("name", ["fp8", "fp8-moments"])
def test_an_abstract_build_has_the_concrete_builds_shapes_and_counts(name):
    """gpu_step.build(abstract=True) (what gpu_compile.py compiles: no weights allocated) gives the state and batch
    of the concrete build as ShapeDtypeStructs, tree for tree, and the same parameter counts."""
    import jax

    from benchmarks.gpu_step import TINY, build

    _, state, batch, info = build(name, TINY)
    _, abstract_state, abstract_batch, abstract_info = build(name, TINY, abstract=True)
    paths = lambda tree: [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]  # noqa: E731 (tx differs)
    assert paths((abstract_state, abstract_batch)) == paths((state, batch))
    assert all(isinstance(a, jax.ShapeDtypeStruct) and (a.shape, a.dtype) == (c.shape, c.dtype)
               for a, c in zip(jax.tree.leaves((abstract_state, abstract_batch)), jax.tree.leaves((state, batch))))
    assert (abstract_info["n_params"], abstract_info["n_no_pos"]) == (info["n_params"], info["n_no_pos"]) != (0, 0)


COMPILED = """HloModule m

%c (p: bf16[4,8]) -> f8e4m3fn[4,8] {
  %p = bf16[4,8]{1,0} parameter(0)
  ROOT %r = f8e4m3fn[4,8]{1,0} convert(%p)
}

ENTRY %main (x: bf16[4,8], w: f8e4m3fn[8,2]) -> bf16[4,2] {
  %x = bf16[4,8]{1,0} parameter(0)
  %w = f8e4m3fn[8,2]{1,0} parameter(1)
  %fusion = f8e4m3fn[4,8]{1,0} fusion(%x), kind=kLoop, calls=%c
  %cublas-gemm = (bf16[4,2]{1,0}, s8[1024]{0}) custom-call(%fusion, %w), custom_call_target="__cublas$lt$matmul$f8"
  %gte = bf16[4,2]{1,0} get-tuple-element(%cublas-gemm), index=0
  ROOT %copy = bf16[4,2]{1,0} copy(%gte)
}
"""


def test_kernel_traffic_and_fp8_gemm_outputs_read_the_compiled_text():
    """gpu_compile's traffic proxy: each entry kernel's output and operand bytes (the fusion 32 + 64, the GEMM 16 +
    32 + 16 without its workspace, the copy 16 + 16; the fused computation's own lines not counted again)."""
    from benchmarks.gpu_compile import kernel_traffic
    from benchmarks.gpu_step import fp8_gemm_outputs
    assert kernel_traffic(COMPILED) == 96 + 64 + 32
    assert fp8_gemm_outputs(COMPILED) == {"bf16": 1}
    assert fp8_gemm_outputs(COMPILED.replace("(bf16[4,2]{1,0}, s8", "(f32[4,2]{1,0}, s8")) == {"f32": 1}


@pytest.mark.slow
def test_gpu_compile_for_an_h200_without_a_gpu(tmp_path):
    """benchmarks/gpu_compile.py, where the JAX CUDA plugin is installed (`pip install "jax[cuda13]"`; CI has none):
    one block, batch 1, compiled for an H200: cuDNN attention forward and backward, and fp8-current's 12 weight GEMMs
    (4 Dense x forward, dgrad, wgrad) on FP8 operands, bf16's on none."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="needs the JAX CUDA plugin: pip install \"jax[cuda13]\"")
    out = tmp_path / "compile.md"
    proc = run_script("benchmarks/gpu_compile.py", "--layers", "1", "--batch-size", "1", "--precisions", "bf16",
                      "fp8-current", "--out", str(out), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = table_rows(out.read_text())
    assert [number(c) for c in rows["bf16"][:3]] == [2, 0, 15], rows
    assert [number(c) for c in rows["fp8-current"][:3]] == [2, 12, 15], rows
    proc = run_script("benchmarks/gpu_compile.py", "--cublas", "--layers", "1", "--batch-size", "1", "--precisions",
                      "fp8-current", "fp8-current-pow2", "--out", str(out), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = table_rows(out.read_text())  # forward and dgrad write bf16 with power-of-2 scales, wgrad float32
    assert rows["fp8-current"][4] == "f32: 12" and rows["fp8-current-pow2"][4] == "bf16: 8, f32: 4", rows
    assert number(rows["fp8-current-pow2"][5]) < number(rows["fp8-current"][5]), rows  # kernel bytes


MOE_HLO = """\
%gemm_fusion (p0: bf16[4096,8192], p1: bf16[8192,4096]) -> bf16[4096,4096] {
  %p0 = bf16[4096,8192]{1,0} parameter(0)
  %p1 = bf16[8192,4096]{1,0} parameter(1)
  ROOT %dot.1 = bf16[4096,4096]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%batched (q0: f8e4m3fn[8,4096,1024], q1: f8e5m2[8,4096,64]) -> f32[8,1024,64] {
  %q0 = f8e4m3fn[8,4096,1024]{2,1,0} parameter(0)
  %q1 = f8e5m2[8,4096,64]{2,1,0} parameter(1)
  ROOT %dot.2 = f32[8,1024,64]{2,1,0} dot(%q0, %q1), lhs_batch_dims={0}, lhs_contracting_dims={1}, BATCH_RHS
}
""".replace("BATCH_RHS", "rhs_batch_dims={0}, rhs_contracting_dims={1}")


def test_gpu_compile_moe_counts_the_compiled_dots_flops():
    """gpu_compile_moe's FLOPs of the compiled program: 2 x output elements x contracted size per dot, operand
    shapes read from each computation's header (a ragged_dot expanded to one GEMM over 8 experts' weights: 8192)."""
    from benchmarks.gpu_compile_moe import dot_flops
    assert dot_flops(MOE_HLO) == 2 * 4096 * 4096 * 8192 + 2 * 8 * 1024 * 64 * 4096


@pytest.mark.slow
def test_gpu_compile_moe_for_an_h200_without_a_gpu(tmp_path):
    """benchmarks/gpu_compile_moe.py where the JAX CUDA plugin is installed (CI has none): both MoE forms compile for
    an H200 under fp8-current with FP8 GEMMs; the batched einsum's compiled FLOPs are the audit's, XLA's ragged_dot
    (jax 0.10.2) computes every expert's GEMM over all tokens (4 experts: about 4x)."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="needs the JAX CUDA plugin: pip install \"jax[cuda13]\"")
    out = tmp_path / "moe.md"
    proc = run_script("benchmarks/gpu_compile_moe.py", "--policies", "fp8-current", "--tokens", "512", "--width",
                      "128", "--hidden", "256", "--experts", "4", "--capacity", "256", "--out", str(out), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {tuple(r[:2]): r for r in (line.strip("|").split("|") for line in out.read_text().splitlines()
                                       if line.startswith("| einsum") or line.startswith("| ragged_dot"))}
    rows = {(k[0].strip(), k[1].strip()): [c.strip() for c in v] for k, v in rows.items()}
    einsum, ragged = rows[("einsum", "fp8-current")], rows[("ragged_dot", "fp8-current")]
    assert number(einsum[3]) >= 6 and number(ragged[3]) >= 6, rows  # FP8 GEMMs: the experts' forward and gradients
    assert number(einsum[7]) == 1.0 and 3.0 < number(ragged[7]) <= 4.0, rows


@pytest.mark.slow
def test_gpu_check_moe_stage_times_both_forms_against_bf16_autocast(tmp_path):
    """benchmarks/gpu_check.sh's opt-in moe stage (benchmarks/gpu_moe.py) as a CPU dry run: a row per form and
    policy, bf16 autocast's speed-up 1.00x, the others' ratio and the audit's FP8 share (the ragged_dot experts in
    FP8 under fp8-current, not under fp8-block)."""
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", str(tmp_path)], cwd=REPO,
                          env={**FAST_ENV, "PYTHON": sys.executable, "GPU_CHECK_STAGES": "moe"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == {"env.txt", "check.log", "gpu_moe.md"}
    rows = {(c[0], c[1]): c for c in ([x.strip() for x in line.strip("|").split("|")]
                                       for line in (tmp_path / "gpu_moe.md").read_text().splitlines()
                                       if line.startswith("| einsum") or line.startswith("| ragged_dot"))}
    assert sorted(rows) == sorted((f, p) for f in ("einsum", "ragged_dot")
                                  for p in ("bf16;autocast", "fp8-current", "fp8-current-pow2", "fp8-block")), rows
    assert all(rows[(f, "bf16;autocast")][3] == "1.00x" for f in ("einsum", "ragged_dot")), rows
    assert all(number(r[2]) > 0 and number(r[3]) > 0 for r in rows.values()), rows
    assert number(rows[("ragged_dot", "fp8-current")][4]) > 50 > number(rows[("ragged_dot", "fp8-block")][4]), rows
    assert number(rows[("einsum", "bf16;autocast")][4]) == 0, rows


@pytest.mark.slow
def test_gpu_throughput_tiny_autocast_fp8_recipes_and_bf16_moments(tmp_path):
    """The rows for the next GPU run: the LM under autocast, the stateless FP8 recipes, bf16 Adam moments (bf16's
    own row: test_gpu_throughput_tiny)."""
    out = tmp_path / "gpu.md"
    rows = ("bf16-autocast", "fp8-current", "fp8-block", "bf16-moments")
    proc = run_script("benchmarks/gpu_throughput.py", "--tiny", "--steps", "1", "--warmup", "1", "--precisions", *rows,
                      "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    main_rows, memory_rows = (table_rows(part) for part in out.read_text().split("## Memory"))
    for precision in rows:
        cells = main_rows[precision]
        assert number(cells[0]) > 0 and number(cells[2]) > 0, cells
    # One model, one batch, the same weights: every row starts from about the same loss.
    first_losses = [float(main_rows[p][9].split(" -> ")[0]) for p in rows]
    assert max(first_losses) - min(first_losses) < 0.05, first_losses


@pytest.mark.slow
def test_gpu_throughput_tiny_on_token_files(tmp_path):
    """--data DIR times real tokens: the batches of batch_at on its train.bin, with meta.pkl's vocabulary."""
    import pickle

    import numpy as np
    from conftest import load_script

    from jaxamp.lm.data import batch_at

    data = tmp_path / "data"
    data.mkdir()
    for name, seed in (("train.bin", 0), ("val.bin", 1)):
        np.random.default_rng(seed).integers(0, 40, 3000, dtype=np.uint16).tofile(data / name)
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 40, "itos": {i: chr(65 + i) for i in range(40)}}))
    gpu = load_script("benchmarks/gpu_throughput.py")
    size = gpu._size(gpu.parse_args(["--tiny", "--data", str(data)]))
    assert (size["vocab"], size["data"]) == (40, str(data))
    ids = np.fromfile(data / "train.bin", "<u2")
    for i, (x, y) in enumerate(gpu.data_batches(size, 2)):
        ref = batch_at(ids, seed=0, step=i, batch_size=size["batch_size"], seq_len=size["seq_len"])
        assert np.array_equal(x, ref[0]) and np.array_equal(y, ref[1])
    out = tmp_path / "gpu.md"
    proc = run_script("benchmarks/gpu_throughput.py", "--tiny", "--steps", "1", "--warmup", "1", "--precisions",
                      "bf16", "--data", str(data), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert f"real tokens of {data}/train.bin" in text and "vocab 40," in text
    assert number(table_rows(text.split("## Memory")[0])["bf16"][2]) > 0  # tokens/s


@pytest.mark.slow
def test_memmap_rss_tiny(tmp_path):
    """Training batches from nanoGPT token files keep the peak resident set flat as train.bin grows 8x; reading the
    file into memory (the control) grows it by the file's size, so the measurement does see a full read."""
    out = tmp_path / "rss.md"
    proc = run_script("benchmarks/memmap_rss.py", "--tiny", "--tmp-dir", str(tmp_path), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text in proc.stdout and "os.cpu_count()" in text
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| 16 ") or
            line.startswith("| 128 ")]
    peak = {(int(r[0]), r[2].strip()): number(r[5]) for r in rows}
    assert len(peak) == 6, rows
    assert peak[(128, "np.fromfile")] > 0.9 * 128 and peak[(16, "np.fromfile")] > 0.9 * 16  # the control
    assert peak[(128, "trainer")] < 16 and abs(peak[(128, "trainer")] - peak[(16, "trainer")]) < 2, peak
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rss.md"]  # the synthetic files are gone


def _write_run(run_dir: Path, *, steps: int, skipped_at: int | None, precision: str | None, seed: int) -> None:
    run_dir.mkdir(parents=True)
    records, skipped, scale = [], 0, 2.0**15
    for step in range(1, steps + 1):
        finite = step != skipped_at
        skipped += not finite
        record = {"step": step, "loss": 4.2 * math.exp(-step / 40) + 0.3 * math.sin(step * seed) ** 2 + 1.0,
                  "loss_scale": scale, "grads_finite": finite,
                  "grad_norm": float("inf") if not finite else 1.0 + 0.5 * math.cos(step),
                  "lr": 1e-3 * min(1.0, step / 10), "tokens_per_s": 5000.0 + 100 * math.sin(step),
                  "skipped_steps": skipped}
        if step % 10 == 0:
            record["val_loss"] = 4.2 * math.exp(-step / 40) + 1.1
        records.append(record)
        if not finite:
            scale /= 2
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if precision is not None:
        (run_dir / "summary.json").write_text(json.dumps({"precision": precision, "steps": steps}))


def test_plot_runs_png(tmp_path):
    _write_run(tmp_path / "run_fp16", steps=60, skipped_at=7, precision="fp16", seed=1)
    _write_run(tmp_path / "run_b", steps=60, skipped_at=None, precision=None, seed=2)
    out = plot_runs([tmp_path / "run_fp16", tmp_path / "run_b"], tmp_path / "plots" / "curves.png")
    assert out == tmp_path / "plots" / "curves.png"
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 10_000


def test_plot_runs_errors(tmp_path):
    with pytest.raises(PlotError, match="not found"):
        plot_runs([tmp_path / "missing"], tmp_path / "x.png")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(PlotError, match="no metrics"):
        plot_runs([tmp_path / "empty"], tmp_path / "x.png")
    _write_run(tmp_path / "ok", steps=5, skipped_at=None, precision=None, seed=1)
    with pytest.raises(PlotError, match="labels"):
        plot_runs([tmp_path / "ok"], tmp_path / "x.png", labels=["a", "b"])
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(PlotError, match="is a directory"):
        plot_runs([tmp_path / "ok"], tmp_path / "empty")


@pytest.mark.slow
def test_plot_cli_missing_dir(tmp_path):
    proc = run_script("experiments/plot.py", str(tmp_path / "nope"), "--out", str(tmp_path / "p.png"), timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nope" in lines[0], proc.stderr
    assert not (tmp_path / "p.png").exists()


@pytest.mark.slow
def test_fidelity_benchmark_tiny(tmp_path, text_corpus):
    out = tmp_path / "fidelity.md"
    proc = run_script("benchmarks/fidelity.py", "--tiny", "--precisions", "bf16", "--data", str(text_corpus),
                      "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.read_text().splitlines()
             if line.startswith("| bf16")]
    rows = {(c[0], c[1], c[3]): c for c in lines}
    assert len(rows) == 4
    before, after = rows[("bf16", "skewed", "before")], rows[("bf16", "skewed", "after")]
    assert number(before[6]) > 5 * number(after[6])  # the worst leaf: a half-precision sum, then fixed
    assert number(before[7]) > 5 * number(after[7])  # the most frequent token's embedding row
    assert all(number(r[6]) < 2 for key, r in rows.items() if key[2] == "after")  # every leaf within 2%


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    """benchmarks/gpu_check.sh --dry-run: the GPU check's stages at --tiny sizes on the CPU, so it cannot rot. Its
    throughput stage runs two precisions here (`GPU_CHECK_PRECISIONS`; test_gpu_throughput_tiny runs every one
    through the same script), its xl stage one, scanned with --remat elementwise; all five stages, the two opt-in
    ones included: the 8 files the device tool can return."""
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", str(tmp_path)], cwd=REPO,
                          env={**FAST_ENV, "PYTHON": sys.executable, "GPU_CHECK_PRECISIONS": "bf16 fp8",
                               "GPU_CHECK_XL_PRECISIONS": "fp8-current",
                               "GPU_CHECK_STAGES": "tests throughput xl paired profile"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == {"env.txt", "check.log", "gpu_throughput.md",
                                                    "gpu_throughput.json", "gpu_throughput_xl.md",
                                                    "gpu_throughput_xl.json", "gpu_paired.md", "gpu_profile.md"}
    xl = json.loads((tmp_path / "gpu_throughput_xl.json").read_text())
    assert set(xl["results"]) == {"fp8-current"} and xl["size"]["scan_layers"] is True
    assert xl["size"]["remat"] == "elementwise"
    assert "layers (scanned), remat elementwise" in (tmp_path / "gpu_throughput_xl.md").read_text()
    assert "backend cpu" in (tmp_path / "env.txt").read_text()
    # The cuDNN and FP8 GEMM checks need a GPU; the 20-step comparison is left to the GPU run.
    assert "3 passed, 6 skipped, 1 deselected" in (tmp_path / "check.log").read_text()
    results = json.loads((tmp_path / "gpu_throughput.json").read_text())["results"]
    assert set(results) == {"bf16", "fp8"}
    assert all("error" not in r for r in results.values())
    assert "## fp16:" in (tmp_path / "gpu_profile.md").read_text()
    paired = (tmp_path / "gpu_paired.md").read_text()
    assert "fp16 / bf16 step time: median over rounds" in paired and "| fp16 |" in paired


@pytest.mark.slow
def test_gpu_check_runs_only_the_stages_asked_for(tmp_path):
    """GPU_CHECK_STAGES picks stages (a short device loan measures what is new first): "none" runs none of them."""
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", str(tmp_path)], cwd=REPO,
                          env={**FAST_ENV, "PYTHON": sys.executable, "GPU_CHECK_STAGES": "none"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == {"env.txt", "check.log"}
    assert "===" not in (tmp_path / "check.log").read_text()


def test_plot_ends_the_loss_scale_at_the_summarys_final_scale(tmp_path):
    """Records hold the scale each step was computed with; a growth at the last step is in summary.json only."""
    from jaxamp.lm.plotting import final_scale, load_run

    _write_run(tmp_path / "run", steps=60, skipped_at=None, precision="fp16", seed=1)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    (tmp_path / "run" / "summary.json").write_text(json.dumps({**summary, "final_loss_scale": 2.0**16}))
    records = load_run(tmp_path / "run")
    assert {r["loss_scale"] for r in records} == {2.0**15}
    assert final_scale(tmp_path / "run", records) == (60, 2.0**16)
    (tmp_path / "run" / "summary.json").write_text(json.dumps({**summary, "steps": 30, "final_loss_scale": 2.0}))
    assert final_scale(tmp_path / "run", records) is None  # a summary of another step: not plotted
    assert plot_runs([tmp_path / "run"], tmp_path / "p.png").read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.slow
def test_cpu_step_tiny(tmp_path, text_corpus):
    """benchmarks/cpu_step.py at a tiny size: every section, the same-math Flax model agreeing with jaxamp's."""
    out = tmp_path / "cpu_step.md"
    proc = run_script("benchmarks/cpu_step.py", "--data", str(text_corpus), "--layers", "1", "--heads", "2",
                      "--width", "32", "--seq-len", "16", "--batch-size", "4", "--rounds", "2", "--steps", "1",
                      "--warmup", "1", "--pause", "0", "--threads", "1", "--gelu-points", "2001", "--profile",
                      "--profile-steps", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text in proc.stdout and "jax " in text and "load average at the end" in text
    rows = table_rows(text)
    jaxamp, flax = rows["jaxamp `TransformerLM`"], rows["plain Flax, same math (two-pass LayerNorm, exact GELU)"]
    assert number(jaxamp[0]) > 0 and number(jaxamp[2]) > 0 and number(flax[3]) == 1.0
    assert number(flax[6]) < 1e-5 and number(flax[5]) < 1e-5  # the same function: gradients and loss agree
    assert "Goal (issue 14)" in text
    assert number(rows["jaxamp fp32"][0]) > 0
    torch_rows = [k for k in rows if k.startswith("PyTorch")]
    assert torch_rows and ("PyTorch not installed" in rows[torch_rows[0]][0] or number(rows[torch_rows[0]][0]) > 0)
    exact = next(v for k, v in rows.items() if k.startswith("`nn.gelu(approximate=False)`"))
    erf = next(v for k, v in rows.items() if k.startswith("0.5 x (1 + erf"))
    assert [number(c) for c in exact[:3]] == [0, 0, 0] and number(erf[2]) > 1000  # erf form: wrong in the tail
    shares = [number(v[1]) for k, v in rows.items() if k.startswith(("matmuls", "GELU", "attention core"))]
    assert len(shares) == 3 and all(0 <= s <= 100 for s in shares)


@pytest.mark.slow
def test_fused_loss_tiny():
    """benchmarks/fused_loss.py at a tiny size: 64-token blocks hold under half the whole-logits temporary memory,
    give the same loss, and their gradient error against float32 is the whole-logits path's."""
    proc = run_script("benchmarks/fused_loss.py", "--tiny", "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = table_rows(proc.stdout)
    whole, fused = rows["0 (whole logits)"], rows["64"]
    assert number(whole[1]) == 1.0 and number(fused[1]) < 0.5  # temp / whole
    assert number(fused[4]) < 1e-5 and number(fused[5].split()[0]) < 0.01  # loss and gradient against whole
    err32 = [number(r[6].split()[0]) for r in (whole, fused)]
    assert 0 < err32[1] < 1.5 * err32[0], err32  # bf16's own error, not more


def _results_bytes() -> dict[str, bytes]:
    """Every committed file under benchmarks/results, by path: its bytes."""
    return {str(p.relative_to(REPO)): p.read_bytes() for p in sorted((REPO / "benchmarks" / "results").rglob("*"))
            if p.is_file()}


def _git_status_of_results() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--", "benchmarks/results"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout


@pytest.mark.slow
def test_gpu_check_dry_run_writes_a_temporary_folder_not_the_committed_results(tmp_path):
    """`gpu_check.sh --dry-run` without OUTDIR writes a fresh temporary folder: the committed H200 results in
    benchmarks/results/gpu_check/ (and everything else under benchmarks/results) keep their bytes."""
    before, status = _results_bytes(), _git_status_of_results()
    env = {**FAST_ENV, "PYTHON": sys.executable, "TMPDIR": str(tmp_path), "GPU_CHECK_STAGES": "throughput",
           "GPU_CHECK_PRECISIONS": "bf16"}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _results_bytes() == before and _git_status_of_results() == status
    outdir = Path(re.search(r"gpu_check: results in (\S+); exit 0", proc.stdout).group(1))
    assert outdir.parent == tmp_path and outdir.name.startswith("jaxamp-gpu-check-dry-run.")
    assert {p.name for p in outdir.iterdir()} == {"env.txt", "check.log", "gpu_throughput.md", "gpu_throughput.json"}
    assert set(json.loads((outdir / "gpu_throughput.json").read_text())["results"]) == {"bf16"}


@pytest.mark.slow
def test_scaling_tiny(tmp_path):
    """benchmarks/scaling.py on fake CPU devices, up to 2 (`--max-devices 2`: the three configurations of 1 and 2)."""
    out = tmp_path / "scaling.md"
    proc = run_script("benchmarks/scaling.py", "--layers", "1", "--width", "16", "--heads", "2", "--seq-len", "8",
                      "--batch-size", "8", "--steps", "1", "--warmup", "1", "--rounds", "1", "--max-devices", "2",
                      "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text in proc.stdout and "os.cpu_count()" in text and "## Prepared commands for real devices" in text
    rows = table_rows(text)
    assert {k for k in rows if k.startswith(("1 device", "data="))} == {"1 device, no mesh (plain jit)", "data=1",
                                                                        "data=2"}
    for label in ("data=1", "data=2"):
        assert number(rows[label][1]) > 0 and number(rows[label][6]) == 1, rows[label]  # tokens/s; one compile
    assert "every configuration: True" in text


def _summary(run: Path, precision: str, val_loss: float, **extra) -> Path:
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({
        "precision": precision, "loss_scale_kind": "dynamic" if precision == "fp16" else "none", "val_loss": val_loss,
        "train_loss": val_loss - 0.2, "skipped_steps": 3 if precision == "fp16" else 0, "final_loss_scale": 2.0**14,
        "tokens_per_s": 5000.0, "wall_s": 120.0, "steps": 2000, **extra}))
    return run


def test_reference_tables(tmp_path, capsys):
    """reference_table.py and reference_bpe_table.py on summary.json files: one row per run, the fp32 comparison;
    a run without its files is one error line (exit 2)."""
    ref = load_script("benchmarks/reference_table.py")
    runs = [_summary(tmp_path / "char" / p.replace(";", "_"), p, v) for p, v in (
        ("fp32", 1.89), ("fp16", 1.8905), ("fp8", 1.95), ("fp8-current", 1.8945), ("bf16;opt_state=bf16", 1.896))]
    assert ref.main([*map(str, runs), "--out", str(tmp_path / "ref.md")]) == 0
    text = (tmp_path / "ref.md").read_text()
    rows = table_rows(text)
    assert rows["fp8-current"][8] == "0.24% yes" and rows["bf16;opt_state=bf16"][8] == "0.32% NO"  # 0.3% targets
    assert "--precision 'bf16;opt_state=bf16'" in text and "runs/reference/bf16-moments" in text
    assert rows["fp16"][1] == "1.8905" and rows["fp16"][7] == "yes" and rows["fp16"][8] == "0.03% yes"
    assert rows["fp8"][7] == "NO" and rows["fp8"][8] == "3.17% NO"  # outside the seed spread and 1% of fp32
    bpe = load_script("benchmarks/reference_bpe_table.py")
    bpe_runs = []
    for p, v in (("fp32", 4.0), ("bf16", 4.02)):
        run = _summary(tmp_path / "bpe" / p, p, v, val_loss_per_char=v / 2.25)
        (run / "tokenizer").mkdir()
        (run / "tokenizer" / "tokenizer.json").write_text("{}")
        (run / "tokenizer" / "meta.json").write_text(json.dumps(
            {"tokenizer_vocab_size": 1024, "train_tokens": 9000, "val_tokens": 1000, "train_chars": 20250,
             "val_chars": 2250}))
        bpe_runs.append(run)
    assert bpe.main([*map(str, bpe_runs), "--out", str(tmp_path / "bpe.md")]) == 0
    text = (tmp_path / "bpe.md").read_text()
    assert "2.250 characters per validation token" in text and "in every run" in text
    assert table_rows(text)["bf16"][2] == "1.7867" and table_rows(text)["bf16"][8] == "0.50% yes"
    capsys.readouterr()
    assert bpe.main([str(runs[0]), "--out", str(tmp_path / "x.md")]) == 2  # no tokenizer/ there
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no summary.json or tokenizer/ in" in err[0] and not (tmp_path / "x.md").exists()


def test_harness_tables_ratios_and_rotation():
    """The shared harness: markdown rows and tables, interleaved rounds (rotating order), ratio cells, the command."""
    harness = load_script("benchmarks/harness.py")
    assert harness.row(["a", 1, ""]) == "| a | 1 | |"
    assert harness.table(["x", "y"], [["1", "2"]], align="lr") == ["| x | y |", "| --- | ---: |", "| 1 | 2 |"]
    order = []
    first, per_round = harness.interleaved({n: (lambda idx, n=n: order.append((n, list(idx))) or 0.5) for n in "ab"},
                                           rounds=2, steps=2, warmup=2)
    assert order == [("a", [0]), ("a", [1]), ("b", [0]), ("b", [1]), ("a", [2, 3]), ("b", [2, 3]), ("b", [4, 5]),
                     ("a", [4, 5])]
    assert first == {"a": 0.5, "b": 0.5} and per_round == {"a": [0.5, 0.5], "b": [0.5, 0.5]}  # the windows' own
    assert harness.ratio_cells([2.0, 4.0, 3.0], [1.0, 2.0, 2.0]) == "**1.500x** | 2.000x (1.500-2.000)"
    assert harness.rotated([1, 2, 3], 4) == [2, 3, 1]
    assert harness.command_line(REPO / "benchmarks" / "x.py", ["--out", "a b"]) == "python benchmarks/x.py --out 'a b'"
    assert "os.cpu_count()=" in harness.machine(backend=False) and "load average" in harness.machine(backend=False)


@pytest.mark.slow
def test_autocast_speed_tiny(tmp_path):
    """benchmarks/autocast_speed.py at a tiny size: both sides train the same weights to nearly the same loss, the
    autocast side runs every matmul in half precision, and the table holds every figure the issue asks for."""
    out = tmp_path / "autocast.md"
    proc = run_script("benchmarks/autocast_speed.py", "--tiny", "--rounds", "2", "--steps", "2", "--warmup", "2",
                      "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = table_rows(out.read_text())
    for name in ("step time (median, ms)", "trace + compile (s)", "XLA bytes accessed (MB)", "temporary memory (MiB)"):
        assert number(rows[name][0]) > 0 and number(rows[name][1]) > 0 and number(rows[name][2]) > 0, name
    assert rows["matmul FLOPs in half precision (audit)"][0] == "100.0%"
    losses = [number(x) for x in rows["last loss"][:2]]
    assert abs(losses[0] - losses[1]) < 0.01 * losses[1], losses


@pytest.mark.slow
def test_autocast_models_tiny(tmp_path):
    """benchmarks/autocast_models.py on one outside model for 3 steps: the cast policy runs its matmuls in float32
    and names where, autocast runs them all in half precision, every leaf's gradient is within its bound; one
    signed-rounding noise run gives the spread cells (min = median = max), and two data seeds the paired cells (the
    first seed's ratio the one-draw ratio)."""
    pytest.importorskip("transformers")
    out = tmp_path / "models.md"
    proc = run_script("benchmarks/autocast_models.py", "--trials", "gpt2_hf", "--steps", "3", "--noise-samples", "1",
                      "--seeds", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    audit = next(line for line in text.splitlines() if line.startswith("| gpt2_hf | hf |"))
    cells = [c.strip() for c in audit.strip("|").split("|")]
    assert cells[2] == "0.0%" and "gpt2.py:" in cells[3] and cells[4:6] == ["100.0%", "100.0%"], cells
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| gpt2_hf | bf16;autocast |")]
    assert len(rows) == 2 and rows[0][2] == "28/28", rows  # the gradient table, then the steps table
    assert rows[0][5].split()[0] == "28" and len(rows[0][5].split()) == 2, rows  # per data seed
    cells = rows[1]
    assert cells[2] == "0", cells  # bf16 with no loss scale skips nothing
    spread = [number(x) for x in cells[7].split("/")]
    assert len(spread) == 3 and spread[0] == spread[1] == spread[2] > 0, cells
    assert abs(number(cells[8]) - number(cells[3]) / spread[1]) < 0.01 + 0.01 * number(cells[8]), cells
    per_seed = [number(x) for x in cells[10].split()]
    assert len(per_seed) == 2 and abs(per_seed[0] - number(cells[5])) < 0.006 and per_seed[1] > 0, cells
    assert abs(number(cells[11]) - sum(per_seed) / 2) < 0.006, cells  # the median of two: their mean
    assert cells[12] == ("yes" if number(cells[11]) <= 1.5 else "no") and number(cells[13]) > 0, cells


@pytest.mark.slow
@pytest.mark.parametrize("trial", ["imagenet_resnet", "mnist_cnn_nnx"])  # linen with batch_stats; NNX
def test_autocast_models_float32_run_skips_the_steps_it_is_told(trial):
    """The float32 run set against a float16 run that skipped a step skips it too: params and the optax state after
    steps 0-1 with step 1 skipped are bitwise those after step 0 alone (structure first); the losses of step 0 agree,
    and nothing skips on its own in float32."""
    from outside_models import SourceUnavailable

    from benchmarks.autocast_models import Runner

    def after(steps, skip=()):
        try:
            runner = Runner(trial, "fp32", jaxamp.NoOpLossScale())
        except SourceUnavailable as err:
            pytest.skip(str(err))
        losses = runner.losses(steps, skip=skip)
        assert runner.skipped == [], runner.skipped
        if runner.trial.kind == "nnx":
            from flax import nnx

            return losses, jax.tree.map(np.asarray, (nnx.state(runner.trial.model, nnx.Param),
                                                     nnx.state(runner.opt)["opt_state"]))
        return losses, jax.tree.map(np.asarray, (runner.state.params, runner.state.opt_state))

    (one, tree_one), (two, tree_two), (free, tree_free) = after(1), after(2, skip={1}), after(2)
    assert jax.tree.structure(tree_one) == jax.tree.structure(tree_two)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(tree_one), jax.tree.leaves(tree_two)))
    assert one[0] == two[0] == free[0]
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(tree_one), jax.tree.leaves(tree_free)))


def test_autocast_models_pairs_each_mixed_run_with_the_float32_run_on_its_data_that_skips_its_steps(monkeypatch):
    """`measure` with runs whose losses encode (policy, rounded, data seed, skipped steps): each mixed run of a data
    seed is set against the float32 run of the same seed that skips what it skipped, the noise against that seed's
    float32 run, and the raw gap against float32 skipping nothing."""
    import benchmarks.autocast_models as am

    class Fake:
        def __init__(self, name, policy, loss_scale, rounded_to=None, rounding_key=None):
            self.policy, self.rounded = policy, rounded_to is not None

        def audit(self):
            return "audit"

        def fidelity(self, seed=0):
            return {"rel_err": {"w": 0.01}, "noise_floor": {"w": 0.01}, "near_zero": {"w": False}}

        def losses(self, steps, skip=(), seed=0):
            self.skipped = [1] if self.policy.startswith("fp16") and seed == 1 else []
            base = {"fp32": 0.0, "bf16;autocast": 0.5, "fp16;autocast": 0.25}[self.policy]
            return [10 * seed + base + 0.125 * self.rounded + (i in skip) + 2 * (i in self.skipped)
                    for i in range(steps)]

    monkeypatch.setattr(am, "Runner", Fake)
    monkeypatch.setattr(am, "TRIALS", {"t": lambda: type("T", (), {"kind": "linen"})()})
    row = am.measure("t", steps=4, noise_samples=0, seeds=2)
    assert row["policies"]["bf16;autocast"]["seed_gaps"] == [0.5, 0.5]
    assert row["policies"]["bf16;autocast"]["seed_noise"] == [0.125, 0.125]
    # fp16 skips step 1 on seed 1: the float32 run it is set against skips it too (1 + 2 - 1 at step 1)
    assert row["policies"]["fp16;autocast"]["seed_gaps"] == [0.25, (0.25 * 3 + 1.25) / 4]
    assert row["policies"]["fp16;autocast"]["raw_gap"] == 0.25 and row["policies"]["fp16;autocast"]["skipped"] == []


@pytest.mark.slow
def test_fp8_models_tiny(tmp_path):
    """benchmarks/fp8_models.py on Hugging Face's GPT-2 for one step: its weight matmuls in FP8 but lm_head, which
    the default exclusions keep in bf16 by its whole name, and a loss that stays near bf16's."""
    pytest.importorskip("transformers")
    out = tmp_path / "fp8_models.md"
    proc = run_script("benchmarks/fp8_models.py", "--trials", "gpt2_hf", "--recipes", "fp8-current", "--steps", "1",
                      "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in out.read_text().splitlines() if x.startswith("| gpt2_hf |"))
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))][1:]  # (a cell's \| is a |)
    assert cells[:3] == ["hf", "fp8-current", "100.0%"] and 50 < number(cells[3]) < 100, cells
    assert cells[4:6] == ["transformer.wte.embedding (lm_head)", "-"] and number(cells[6]) < 1, cells  # tied


def test_reference_seeds_table(tmp_path, capsys):
    """reference_seeds_table.py: one row per seed with both runs (seed 1337 from the committed reference_recipes
    table), the gap to fp32 against the 0.3% target, and the spread of the gaps and of fp32 itself."""
    seeds = load_script("benchmarks/reference_seeds_table.py")
    for precision, seed, val in (("fp32", 1, 1.90), ("fp8-current", 1, 1.9055), ("fp32", 2, 1.92),
                                 ("fp8-current", 2, 1.9248), ("fp32", 3, 1.91)):  # seed 3: no pair, no row
        _summary(tmp_path / "runs" / f"{precision}-s{seed}", precision, val)
    assert seeds.main([str(tmp_path / "runs"), "--out", str(tmp_path / "seeds.md")]) == 0
    text = (tmp_path / "seeds.md").read_text()
    rows = table_rows(text)
    assert rows["1"] == ["1.9000", "1.9055", "+0.289%", "yes"] and rows["2"][2:] == ["+0.250%", "yes"]
    committed = seeds.committed_1337()
    assert set(committed) == {"fp32", "fp8-current"} and "3" not in rows  # the committed seed-1337 pair
    assert rows["1337"][:2] == [f"{committed['fp32']:.4f}", f"{committed['fp8-current']:.4f}"]
    gaps = [1.9055 / 1.90 - 1, 1.9248 / 1.92 - 1, committed["fp8-current"] / committed["fp32"] - 1]
    assert f"over 3 seeds: mean {sum(gaps) / 3:+.3%}" in text
    assert "fp32 itself from seed to seed: " in text and "Seed 1337: the runs of reference_recipes.md" in text
    for precision, val in (("fp32", 1.8996), ("fp8-current", 1.9049)):  # RUNS_DIR's own seed-1337 pair wins
        _summary(tmp_path / "runs" / f"{precision}-s1337", precision, val)
    assert seeds.main([str(tmp_path / "runs"), "--out", str(tmp_path / "seeds.md")]) == 0
    text = (tmp_path / "seeds.md").read_text()
    assert table_rows(text)["1337"] == ["1.8996", "1.9049", "+0.279%", "yes"] and "Seed 1337: RUNS_DIR's own" in text
    _summary(tmp_path / "runs" / "fp8-current-pow2-s1", "fp8-current-pow2", 1.9095)  # --recipe: another recipe
    assert seeds.main([str(tmp_path / "runs"), "--recipe", "fp8-current-pow2", "--out", str(tmp_path / "p.md")]) == 0
    text = (tmp_path / "p.md").read_text()
    assert text.startswith("# fp8-current-pow2 against fp32") and table_rows(text)["1"] == ["1.9000", "1.9095",
                                                                                          "+0.500%", "NO"]
    with pytest.raises(SystemExit):
        seeds.main([str(tmp_path / "missing"), "--out", str(tmp_path / "x.md")])
    assert "run benchmarks/reference_seeds.sh first" in capsys.readouterr().err


def test_fp8_fidelity_kinds_cover_the_lm():
    """Every leaf of the LM (with biases) falls in a layer kind of fp8_fidelity.py's table; none is left to
    "other"."""
    import jax

    from jaxamp.lm.model import TransformerConfig
    from jaxamp.lm.setup import init_variables
    from jaxamp.precision import leaf_path

    fid = load_script("benchmarks/fp8_fidelity.py")
    cfg = TransformerConfig(vocab_size=65, seq_len=32, num_layers=2, num_heads=2, width=64)
    shapes = jax.eval_shape(lambda: init_variables(cfg, jax.random.key(0)))["params"]
    kinds = {leaf_path(p): fid.kind_of(leaf_path(p)) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]}
    assert "other" not in kinds.values() and set(kinds.values()) == {name for name, _ in fid.KINDS}
    assert kinds["h_1/mlp/c_fc/kernel"] == "mlp in" and kinds["ln_f/scale"] == "LayerNorm scales"
    assert kinds["h_0/ln_1/bias"] == kinds["h_0/attn/c_proj/bias"] == "biases"


@pytest.mark.slow
def test_fp8_fidelity_benchmark_tiny(tmp_path, text_corpus):
    """fp8_fidelity.py --tiny: a row per precision and weights; FP8's gradient errors well above bf16's."""
    out = tmp_path / "fp8_fidelity.md"
    proc = run_script("benchmarks/fp8_fidelity.py", "--tiny", "--precisions", "bf16", "fp8-current", "--warmup", "1",
                      "--data", str(text_corpus), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rel = out.read_text().split("## share")[0]
    rows = {(c[0], c[1]): c for c in (
        [x.strip() for x in line.strip().strip("|").split("|")] for line in rel.splitlines()
        if line.startswith(("| bf16", "| fp8")))}
    assert set(rows) == {(p, w) for p in ("bf16", "fp8-current") for w in ("init", "after 1 steps")}
    for weights in ("init", "after 1 steps"):
        bf16, fp8 = (list(map(number, rows[(p, weights)][2:])) for p in ("bf16", "fp8-current"))
        assert len(bf16) == 8 and all(0 < b < 2 for b in bf16)  # 7 kinds and the global error
        assert fp8[-1] > 3 * bf16[-1]  # e4m3/e5m2 round ~8x coarser than bf16


@pytest.mark.slow  # 6 s on 2 cores
def test_autocast_variants_round_the_gradients_and_results_they_say():
    """benchmarks/autocast_variants.py's rules, on x @ w under bf16 autocast: `autocast` gives dw rounded to bfloat16;
    `f32-grads` the float32 sum of the bfloat16 products, unrounded; `f32-results` also a float32 result;
    `operands-only` also an output gradient that is not rounded. jaxamp's own rule is back after each block."""
    variants = load_script("benchmarks/autocast_variants.py")
    shipped = {op: variants.autocast_rules.FIRST_ORDER_RULES[op] for op in variants.OPS}
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((512, 64)), jnp.float32)
    f = jaxamp.autocast(lambda w, x: x @ w, jnp.bfloat16)
    xb = x.astype(jnp.bfloat16).astype(jnp.float32)
    c = jnp.asarray(rng.standard_normal((512, 16)), jnp.float32)  # the output gradient, not bfloat16-valued
    cb = c.astype(jnp.bfloat16).astype(jnp.float32)
    exact = jnp.dot(xb.T, cb, precision="highest")  # d sum(c * (x @ w)) / dw, c rounded to bf16, f32 sum
    unrounded = jnp.dot(xb.T, c, precision="highest")  # c as it is
    got = {}
    for name in variants.VARIANTS:
        with variants.variant(name):
            out = f(w, x)
            got[name] = (out.dtype, jax.grad(lambda w: jnp.sum(f(w, x).astype(jnp.float32) * c))(w))
        assert all(variants.autocast_rules.FIRST_ORDER_RULES[op] is rule for op, rule in shipped.items())
    assert [d for d, _ in got.values()] == [jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32]
    np.testing.assert_array_equal(got["autocast"][1], exact.astype(jnp.bfloat16).astype(jnp.float32))
    for name in ("f32-grads", "f32-results"):
        np.testing.assert_allclose(got[name][1], exact, rtol=1e-5, atol=1e-5)
        assert not np.array_equal(got[name][1], got["autocast"][1]), name  # the rounding is gone
    np.testing.assert_allclose(got["operands-only"][1], unrounded, rtol=1e-5, atol=1e-4)
    assert float(jnp.max(jnp.abs(got["operands-only"][1] - exact))) > 1e-3  # c's rounding is gone too
    conv = jaxamp.autocast(lambda k, img: jax.lax.conv(img, k, (1, 1), "SAME"), jnp.bfloat16)  # NCHW, OIHW
    k, img = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((4, 3, 3, 3), (8, 3, 16, 16)))
    conv_grads = {}
    for name in variants.VARIANTS:
        with variants.variant(name):
            assert conv(k, img).dtype == (jnp.float32 if name in ("f32-results", "operands-only") else
                                          jnp.bfloat16), name
            conv_grads[name] = jax.grad(lambda k: jnp.sum(conv(k, img).astype(jnp.float32)))(k)
    assert np.array_equal(conv_grads["autocast"], conv_grads["autocast"].astype(jnp.bfloat16).astype(jnp.float32))
    assert not np.array_equal(conv_grads["f32-grads"], conv_grads["f32-grads"].astype(jnp.bfloat16).astype(
        jnp.float32))  # a float32 kernel gradient, not a bfloat16 one


@pytest.mark.slow
def test_autocast_variants_tiny(tmp_path):
    """benchmarks/autocast_variants.py on Hugging Face's GPT-2 for 2 steps: four rows, every leaf within its bound,
    and each rule gives its own gradients (had the swap of the matmul rule done nothing, the worst-leaf cells
    would be one: autocast 0.74% on ln_1's scale, f32-grads 0.68%, f32-results 0.74% on ln_1's bias). With the
    float32 head in every row the variants no longer move the worst leaf down (0.85% -> 0.61% with bf16 logits)."""
    pytest.importorskip("transformers")
    out = tmp_path / "variants.md"
    proc = run_script("benchmarks/autocast_variants.py", "--trials", "gpt2_hf", "--steps", "2", "--seeds", "2",
                      "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.read_text().splitlines()
            if line.startswith("| gpt2_hf |")]
    assert [r[1] for r in rows] == ["autocast", "f32-grads", "f32-results", "operands-only"]
    assert all(r[2] == "28/28" and r[3].split()[0] == "28" and len(r[3].split()) == 2 for r in rows), rows
    worst = {r[1]: number(r[4].split()[1]) for r in rows}
    assert len({r[4] for r in rows[:3]}) == 3 and max(worst.values()) < 1.0, rows  # 1%: every leaf near float32


def test_autocast_models_audit_only_writes_the_audits_table_alone(monkeypatch, tmp_path):
    """`--audit-only` traces the audits (cast policy and each autocast policy) and writes their table alone: no
    training run, no gradient or steps tables."""
    import types

    import benchmarks.autocast_models as am

    audit = lambda share, fallbacks=(): types.SimpleNamespace(half_fraction=share, fallbacks=fallbacks)  # noqa: E731
    row = {"kind": "hf", "cast": audit(0.0, [{"source": "gpt2.py:65", "cause": "its wpe promoted"}]),
           "policies": {p: {"audit": audit(1.0)} for p in am.POLICIES}}
    monkeypatch.setattr(am, "measure_audit", lambda name: row)
    monkeypatch.setattr(am, "measure", lambda *a: pytest.fail("--audit-only ran the steps"))
    out = tmp_path / "audit.md"
    assert am.main(["--trials", "gpt2_hf", "--audit-only", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| gpt2_hf | hf | 0.0% | gpt2.py:65: its wpe promoted | 100.0% | 100.0% |" in text, text
    assert "## Gradients" not in text and "steps against" not in text


def test_autocast_models_batch_option_builds_every_trial_at_that_size(monkeypatch, tmp_path, capsys):
    """`--batch N` builds every trial with N sequences or images (`TRIALS[name](batch=N)`) and says so in the report's
    header; without it the trials' own; a size below 1 is refused in one line."""
    import benchmarks.autocast_models as am

    built = []
    monkeypatch.setattr(am, "TRIALS", {"gpt2_hf": lambda **options: built.append(options) or pytest.skip("built")})
    monkeypatch.setattr(am, "each_trial", lambda names, measure: {"seen": dict(am.TRIAL_OPTIONS)})
    monkeypatch.setattr(am, "report", lambda rows, steps, argv: f"{rows} {am.batch_words()}")
    for argv, options, words in [(["--batch", "32"], {"batch": 32}, "batches of 32 sequences or images"),
                                 ([], {}, "the trials' own batches (4 sequences or images)")]:
        out = tmp_path / "m.md"
        assert am.main(["--trials", "gpt2_hf", *argv, "--out", str(out)]) == 0
        assert out.read_text().startswith(f"{{'seen': {options}}} {words}"), out.read_text()
        with pytest.raises(pytest.skip.Exception):
            am.Runner("gpt2_hf", "fp32", jaxamp.NoOpLossScale())
        assert built.pop() == options
    with pytest.raises(SystemExit):
        am.main(["--batch", "0", "--out", str(tmp_path / "z.md")])
    assert "--batch 0: give a positive number of sequences or images per batch" in capsys.readouterr().err
    assert not (tmp_path / "z.md").exists()



def test_autocast_models_dropout_option_reaches_gpt2_and_is_refused_for_trials_without_dropout(monkeypatch, tmp_path,
                                                                                                capsys):
    """`--dropout P` builds GPT-2 with that rate (its GPT2Config's three pdrops) and says so in the header; a trial
    that takes no rate (the ResNet) is refused in one line naming it, and nothing is written."""
    import benchmarks.autocast_models as am
    from tests.outside_models import gpt2

    monkeypatch.setattr(am, "each_trial", lambda names, measure: {"seen": dict(am.TRIAL_OPTIONS)})
    monkeypatch.setattr(am, "report", lambda rows, steps, argv: f"{rows} {am.batch_words()}")
    out = tmp_path / "m.md"
    assert am.main(["--trials", "gpt2_hf", "--dropout", "0", "--out", str(out)]) == 0
    assert out.read_text() == ("{'seen': {'dropout': 0.0}} the trials' own batches (4 sequences or images); "
                               "dropout 0.0 (--dropout)")
    config = gpt2.trial(dropout=0.0).model.config
    assert (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) == (0.0, 0.0, 0.0)
    assert gpt2.trial().model.config.resid_pdrop == 0.1
    with pytest.raises(SystemExit):
        am.main(["--trials", "gpt2_hf", "imagenet_resnet", "--dropout", "0", "--out", str(tmp_path / "z.md")])
    assert "--dropout: imagenet_resnet take no dropout rate" in capsys.readouterr().err
    assert not (tmp_path / "z.md").exists()

def test_autocast_models_seed_counts_show_the_leaves_counted_where_they_differ():
    """The per-seed leaf counts: "26 14" where each batch counts the same leaves, "9/10 12/14" where the near-zero
    leaves (not counted) differ between the batches (a ResNet at 32 images: 10 to 14 counted)."""
    from benchmarks.autocast_models import seed_counts

    rows = lambda *pairs: {"per_seed": [{"within": w, "counted": c} for w, c in pairs]}  # noqa: E731
    assert seed_counts(rows((26, 29), (14, 29))) == "26 14"
    assert seed_counts(rows((9, 10), (12, 14))) == "9/10 12/14"
    assert seed_counts({}) == "-"


def test_autocast_models_runs_the_policies_it_is_given(monkeypatch, tmp_path):
    """`--policies` replaces bf16;autocast and fp16;autocast (a float16 policy with a dynamic scale from 2^15)."""
    import benchmarks.autocast_models as am

    seen = {}
    monkeypatch.setattr(am, "POLICIES", dict(am.POLICIES))
    monkeypatch.setattr(am, "each_trial", lambda names, measure: seen.update({p: f() for p, f in am.POLICIES.items()})
                        or {})
    monkeypatch.setattr(am, "report", lambda rows, steps, argv: "")
    am.main(["--trials", "gpt2_hf", "--policies", "bf16;autocast;float32_results=.", "fp16;autocast",
             "--out", str(tmp_path / "m.md")])
    assert list(seen) == ["bf16;autocast;float32_results=.", "fp16;autocast"]
    assert isinstance(seen["bf16;autocast;float32_results=."], jaxamp.NoOpLossScale)
    fp16 = seen["fp16;autocast"]
    assert isinstance(fp16, jaxamp.DynamicLossScale) and float(fp16.loss_scale) == 2**15
