"""What XLA:GPU compiles for the LM's step on an H200, on a machine without a GPU (deviceless AOT compile).

    pip install "jax[cuda13]==$(python -c 'import jax; print(jax.__version__)')"   # XLA's GPU compiler (the plugin)
    python benchmarks/gpu_compile.py                                        # gpt2-124m, batch 32: every precision
    python benchmarks/gpu_compile.py --model gpt2-xl --batch-size 8 --precisions bf16 fp8-current
    python benchmarks/gpu_compile.py --layers 2 --precisions fp8 fp8-current --out /tmp/c.md   # quick

For each precision (gpu_throughput.py's: the same `build`), the jitted, donating train step is lowered on abstract
arrays placed on a deviceless H200 topology (`jax.experimental.topologies`, sm_90, CUDA 13, cuDNN 9) and compiled by
the JAX CUDA plugin's XLA:GPU compiler: nothing runs, no GPU is needed, only the plugin's libraries. The program is
traced as on a GPU (`jax.default_backend()` answers "gpu" while tracing, so `jaxamp.attention` asks for cuDNN's
fused attention as it does there). Reported from the compiled program's text: cuDNN fused attention calls, GEMMs
with FP8 operands (cuBLASLt FP8 calls and Triton dots of FP8 tensors), all GEMMs, the operand dtypes of the GEMMs
(`f32 x f32` marks a float32 GEMM), and `memory_analysis()` (arguments, temporaries).

What it cannot show: which kernel the autotuner picks (deviceless, XLA takes its default Triton configs where a GPU
run may choose cuBLAS), and any timing. On the 12-04 H200 run the FP8 and GEMM counts of `fp8` and the old
`fp8-current` matched what this script gives for them (144 FP8 GEMMs; none) and bf16's cuDNN count (24) too.

JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 is set (the plugin's version checks load cuPTI, which needs a driver).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks import harness  # noqa: E402
from benchmarks.gpu_step import (  # noqa: E402
    PRECISIONS,
    add_model_flags,
    build,
    custom_calls,
    dot_operand_dtypes,
    fp8_gemm_outputs,
    layout_words,
    matmul_context,
    model_size,
)

DEFAULT_OUT = harness.RESULTS / "gpu_compile.md"
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150754820096 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA" dnn_version_info { major: 9 minor: 28 } runtime_version { major: 13 }
device_description_str: "NVIDIA H200"
"""  # XLA's GpuTargetConfigProto for an H200 (sm_90, 132 SMs, 141 GB); the cuDNN and CUDA versions of the GPU box


def h200_sharding():
    """A replicated sharding on a one-device deviceless H200 topology.

    Raises:
      RuntimeError: the JAX CUDA plugin is not installed (the message says which pip line installs it).
    """
    import jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET, topology="1x1x1")
    except (NotImplementedError, RuntimeError) as e:
        raise RuntimeError(f"no XLA:GPU compiler here ({e}): pip install \"jax[cuda13]=={jax.__version__}\"") \
            from None
    return NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), PartitionSpec())


@contextlib.contextmanager
def traced_as_on_a_gpu():
    """`jax.default_backend()` answers "gpu" inside (what jaxamp reads to pick cuDNN attention)."""
    import jax

    real = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        yield
    finally:
        jax.default_backend = real


def compile_precision(name: str, size: dict, sharding) -> dict:
    """Builds `name`'s step on the CPU, compiles it for the H200 on abstract arrays; counts and memory."""
    import jax

    with matmul_context(name), traced_as_on_a_gpu():
        step, state, batch, info = build(name, size, abstract=True)  # shapes only: no weights allocated
        abstract = lambda tree: jax.tree.map(  # noqa: E731
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)
        t0 = time.perf_counter()
        compiled = step.lower(abstract(state), abstract(batch)).compile()
        compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    memory = None if mem is None else {k: int(getattr(mem, k + "_size_in_bytes"))
                                       for k in ("argument", "output", "alias", "temp")}
    dots = collections.Counter(f"{a} x {b}" for a, b in dot_operand_dtypes(text))
    return {"precision": name, "compile_s": compile_s, "n_params": info["n_params"],
            "calls": custom_calls(text), "dots": dict(dots), "memory": memory,
            "fp8_outputs": fp8_gemm_outputs(text), "traffic": kernel_traffic(text)}


_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "f8e4m3fn": 1, "f8e5m2": 1, "s8": 1, "u8": 1,
          "pred": 1}
_KERNEL_OPS = ("fusion", "custom-call", "copy", "transpose", "reduce", "convert")  # each runs as its own kernel(s)
_ENTRY_LINE = re.compile(r"\s*(?:ROOT )?%(\S+) = (.*?) ([\w-]+)\(([^)]*)\)")


def _nbytes(hlo_type: str) -> int:
    """Bytes of an HLO type such as `(bf16[32768,768]{1,0}, s8[4194304]{0})` (tuples summed)."""
    return sum(_BYTES.get(dt, 0) * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", hlo_type))


def kernel_traffic(hlo_text: str) -> int:
    """Bytes the entry computation's kernels write plus read (outputs and operands of its fusions, custom calls,
    copies...; a cuBLAS call's workspace left out): a proxy of the step's memory traffic, not a timing."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    types, total = {}, 0
    for line in entry.splitlines()[1:]:
        m = _ENTRY_LINE.match(line)
        if not m:
            continue
        name, typ, op, operands = m.groups()
        types[name] = typ
        if op in _KERNEL_OPS:
            out = typ.split(", s8[")[0] if op == "custom-call" else typ  # (result, s8[workspace])
            total += _nbytes(out) + sum(_nbytes(types.get(a.strip().lstrip("%"), "")) for a in operands.split(","))
    return total


def report(rows: list[dict], size: dict, argv) -> str:
    lines = ["# What XLA:GPU compiles for the LM step on an H200 (deviceless: compiled, not run)", "",
             f"- command: `{harness.command_line(__file__, argv)}`", f"- machine: {harness.machine(backend=False)}",
             f"- date: {harness.now()}",
             f"- model: {layout_words(size)}, {size['heads']} heads, width {size['width']}, seq {size['seq_len']}, "
             f"vocab {size['vocab']}, batch {size['batch_size']}", "- counts from the compiled program's text (a "
             "scanned block's GEMMs once); memory from `memory_analysis()` (live at peak is about argument + "
             "temp)", ""]
    table = []
    for r in rows:
        c, m = r["calls"], r["memory"] or {}
        dots = ", ".join(f"{k}: {v}" for k, v in sorted(r["dots"].items(), key=lambda kv: -kv[1]))
        outputs = ", ".join(f"{k}: {v}" for k, v in sorted(r["fp8_outputs"].items())) or "-"
        table.append([r["precision"], str(c["cudnn_attention"]), str(c["f8_gemm"]), str(c["gemm"]), dots or "-",
                      outputs, f"{r['traffic'] / 2**30:,.2f}", harness.mib(m.get("argument")),
                      harness.mib(m.get("temp")), f"{r['compile_s']:.1f}"])
    lines += harness.table(["precision", "cuDNN attention", "FP8 GEMMs", "GEMMs", "Triton/XLA dots by operand dtypes",
                            "cuBLASLt FP8 GEMM outputs", "kernel GiB written + read", "argument MiB", "temp MiB",
                            "compile s"], table, "lrrrllrrrr")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_flags(parser, "gpu_check.sh's xl stage")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=None,
                        help="blocks, the preset's other sizes kept (default: the preset's)")
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS),
                        help="gpu_throughput.py's rows: `bf16` is the cast policy, `bf16-autocast` float32 code "
                             "under autocast, ... (default: all)")
    parser.add_argument("--cublas", action="store_true",
                        help="GEMMs as cuBLAS calls, no Triton GEMM fusions (XLA_FLAGS=--xla_gpu_enable_triton_gemm="
                             "false): what a GPU's autotuner picked on the H100 (12-05), where deviceless XLA takes "
                             "Triton's default configs")
    parser.add_argument("--out", default=str(DEFAULT_OUT),
                        help="the markdown table to write (default: benchmarks/results/gpu_compile.md in the checkout)")
    args = parser.parse_args(argv)
    harness.check_sizes(parser, args, ("batch_size",) + (("layers",) if args.layers is not None else ()))
    harness.check_output(parser, "--out", args.out)
    size = model_size(args, batch_size=args.batch_size)
    if args.layers is not None:
        size["layers"] = args.layers
    if args.cublas:  # read when the CUDA plugin's compiler starts, below
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_enable_triton_gemm=false".strip()
    try:
        sharding = h200_sharding()
    except RuntimeError as e:
        parser.exit(2, f"{parser.prog}: {e}\n")
    rows = []
    for name in args.precisions:
        harness.log(f"{name} ...")
        rows.append(compile_precision(name, size, sharding))
        harness.write_report(args.out, report(rows, size, argv if argv is not None else sys.argv[1:]),
                             echo=name == args.precisions[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
