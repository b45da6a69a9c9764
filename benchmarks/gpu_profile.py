"""Where a jaxamp step's device time goes: a `jax.profiler` trace of a few steps, summed by kernel and by kind.

    python benchmarks/gpu_profile.py --precisions bf16 fp16 --out benchmarks/results/gpu_profile.md
    python benchmarks/gpu_profile.py --tiny --precisions fp32 --out /tmp/profile.md   # CPU smoke test

For each precision: the step of `gpu_throughput.py` (same model, optimizer and batch) is compiled, run `--warmup`
times, then `--steps` steps are traced with `jax.profiler.trace`. The trace's device plane (`/device:GPU:0`; on a
CPU, the host threads' XLA ops) is read back with `jax.profiler.ProfileData`, and the kernels' durations are summed
per step: by kind (matmul, cuDNN attention, fusion, copy, ...) and the top kernels by name. Durations overlap only
where kernels run concurrently, so the per-kind sum can exceed the step's wall time slightly.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks import gpu_step as gs  # noqa: E402  (imports jax, starts no backend)
from benchmarks import harness  # noqa: E402

KINDS = (  # (kind, substrings of a kernel name, lower case); the first match wins
    ("cuDNN attention", ("fmha", "cudnn", "flash", "sdpa")),
    ("matmul (cuBLAS/cuBLASLt)", ("gemm", "cublas", "cutlass", "sm90_xmma", "xmma", "nvjet", "matmul", "dot")),
    ("reduction / norm / softmax", ("reduce", "reduction", "softmax", "norm")),
    ("copy / transpose / memset", ("copy", "transpose", "memset", "memcpy", "dynamic-update-slice")),
    ("elementwise fusion", ("fusion", "loop_", "input_", "wrapped_", "convert", "add", "multiply")),
)


def kind_of(name: str) -> str:
    """The kind of work of a kernel, by the first of `KINDS` whose substrings its name holds (else "other")."""
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def device_events(trace_dir: Path) -> tuple[str, list[tuple[str, float]], dict]:
    """(plane name, [(kernel name, duration s)], {line name: (events, seconds)}) of the newest trace's device plane.

    On a GPU plane only the stream lines count (each kernel once; the "XLA Ops"/"XLA Modules" lines summarise them
    again); on the CPU, the XLA op events of the host threads, without the ThunkExecutor wrappers.
    """
    from jax.profiler import ProfileData

    files = sorted(trace_dir.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise RuntimeError(f"no .xplane.pb written under {trace_dir}")
    data = ProfileData.from_file(str(files[-1]))
    planes = {p.name: p for p in data.planes}
    gpu = sorted(n for n in planes if n.startswith("/device:GPU"))
    name = gpu[0] if gpu else "/host:CPU"
    events, lines = [], {}
    for line in planes[name].lines:
        line_events = [(e.name, e.duration_ns * 1e-9) for e in line.events]
        lines[line.name] = (len(line_events), sum(s for _, s in line_events))
        if (gpu and "stream" not in line.name.lower()) or (not gpu and line.name == "python"):
            continue
        events += [(n, s) for n, s in line_events if gpu or not n.startswith("ThunkExecutor")]
    return name, events, lines


def profile(name: str, size: dict, warmup: int, steps: int, top: int) -> dict:
    """Precision `name`'s step, traced over `steps` steps: kernel seconds per step by kind and the `top` kernels."""
    import jax

    with gs.matmul_context(name):
        step, state, batch, _ = gs.build(name, size)
        for _ in range(warmup + 1):
            state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            with jax.profiler.trace(tmp):
                for _ in range(steps):
                    state, metrics = step(state, batch)
                jax.block_until_ready((state, metrics))
            wall = (time.perf_counter() - t0) / steps
            plane, events, lines = device_events(Path(tmp))
    by_kind, by_name = collections.Counter(), collections.Counter()
    for kernel, seconds in events:
        by_kind[kind_of(kernel)] += seconds / steps
        by_name[kernel] += seconds / steps
    return {"precision": name, "plane": plane, "wall_s": wall, "busy_s": sum(by_kind.values()),
            "kernels_per_step": len(events) / steps, "by_kind": dict(by_kind.most_common()),
            "top": by_name.most_common(top), "lines": lines}


def report(args, size: dict, results: list[dict]) -> str:
    """One section per precision: kinds, top kernels, the plane's trace lines."""
    lines = ["# Where the step's device time goes (`jax.profiler` trace)", "",
             f"- command: `{harness.command_line(__file__, args.argv)}`",
             f"- model: {gs.layout_words(size)}, width {size['width']}, "
             f"seq {size['seq_len']}, vocab {size['vocab']}, batch {size['batch_size']}; {args.steps} traced steps "
             f"after {args.warmup + 1} untimed ones", ""]
    for r in results:
        ms = lambda s: f"{s * 1e3:,.2f}"  # noqa: E731
        lines += [f"## {r['precision']}: {ms(r['busy_s'])} ms of kernels per step "
                  f"(wall {ms(r['wall_s'])} ms traced; {r['kernels_per_step']:.0f} kernels; plane {r['plane']})", "",
                  "| kind | ms per step | share |", "| --- | --- | --- |"]
        lines += [f"| {k} | {ms(s)} | {100 * s / max(r['busy_s'], 1e-12):.1f}% |" for k, s in r["by_kind"].items()]
        lines += ["", "| kernel | kind | ms per step |", "| --- | --- | --- |"]
        lines += [f"| `{n[:90].replace('|', '/')}` | {kind_of(n)} | {ms(s)} |" for n, s in r["top"]]
        lines += ["", "Trace lines of that plane (all traced steps): "
                  + "; ".join(f"`{n}` {c} events {s * 1e3:,.1f} ms" for n, (c, s) in r["lines"].items()), ""]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked (one-line usage errors)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gs.add_size_flags(p, precisions="+")
    gs.add_model_flags(p)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the trace (default: 2)")
    p.add_argument("--steps", type=int, default=3, help="traced steps (default: 3)")
    p.add_argument("--top", type=int, default=25, help="kernels listed by name (default: 25)")
    p.add_argument("--out", required=True, help="markdown report to write")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    harness.check_sizes(p, args, ("steps",), ("warmup", "top"))
    harness.check_output(p, "--out", args.out)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    size = gs.model_size(args, args.tiny, args.batch_size or None)
    results = []
    for name in args.precisions:
        harness.log(f"[{time.strftime('%H:%M:%S')}] profiling {name} ...")
        results.append(profile(name, size, args.warmup, args.steps, args.top))
        harness.write_report(args.out, report(args, size, results), echo=False)  # partial results survive a cut
    harness.write_report(args.out, report(args, size, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
