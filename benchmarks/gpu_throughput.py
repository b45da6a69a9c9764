"""Training throughput, MFU and memory of a GPT-2-124M-sized LM under jaxamp, in 11 precisions, one command.

    python benchmarks/gpu_throughput.py                           # 12 layers, 12 heads, width 768, seq 1024, batch 16
    python benchmarks/gpu_throughput.py --batch-size 32 --steps 20
    python benchmarks/gpu_throughput.py --model gpt2-medium --data nanoGPT/data/openwebtext   # on real tokens
    python benchmarks/gpu_throughput.py --tiny --steps 2 --out /tmp/gpu.md   # 2-layer width-64 model on CPU (a test)

Precisions (each one its own jaxamp `TrainState.create` + `train_step`, jitted with the state donated, optax AdamW
with global-norm clipping, as a user writes it):

  fp32-highest  fp32 policy, no loss scale, under `jax.default_matmul_precision("highest")` (true float32 matmuls)
  fp32          fp32 policy, no loss scale, default matmul precision (TF32 tensor cores on Ampere/Hopper)
  bf16          bf16 policy (float32 master weights), no loss scale
  bf16-fused    bf16, with the fused head + cross-entropy (`TransformerConfig.loss_chunk` = 4096 tokens): the
                f32[tokens, vocab] logits are never held whole (they cost ~15 ms of memory traffic per bf16 step)
  fp16          fp16 policy (float32 master weights), jaxamp `DynamicLossScale`
  fp8           fp8 policy: bf16 compute with the Dense matmuls through Flax's FP8 ops (e4m3/e5m2, delayed scaling;
                head and attention in bf16), no loss scale; MFU against the FP8 peak and, in brackets, the bf16 peak
  bf16-autocast "bf16;autocast": the params float32 into the model, `jaxamp.autocast` casts at each matmul
  fp8-current   "fp8-current": autocast with the weight matmuls through per-tensor current-scaled FP8 (stateless)
  fp8-block     "fp8-block": the same with DeepSeek-V3's 1x128 / 128x128 block scales (numerics: float32 GEMMs)
  bf16-moments  "bf16;opt_state=bf16": bf16 with Adam's moments stored in bfloat16 (8 bytes per parameter)
  fp8-moments   "fp8-current;opt_state=bf16": fp8-current with bfloat16 Adam moments (DeepSeek-V3's pairing)

For each: the step is lowered and compiled ahead of time (`jax.jit(step).lower(state, batch).compile()`, whose
`memory_analysis()` gives the argument, output, temp and aliased bytes; the later jitted calls hit the same cache),
then `--warmup` untimed steps and `--steps` timed steps, each followed by `block_until_ready`. `--model` picks the
size from the experiment's presets (`jaxamp.lm.presets`, default gpt2-124m). The batch is one fixed batch of random
tokens; with `--data DIR` (nanoGPT's train.bin/val.bin) it is real tokens instead: the batches of steps 0, 1, ...
of `jaxamp.lm.data.batch_at(train.bin, seed=0)`, all put on the device before timing, with the vocabulary of the
data. Reported: median step
time, tokens/s, MFU = tokens/s * (6 N + 12 L H Q T) / peak (nanoGPT's estimate; N = parameters without the
position embedding) against the device's dense peak for that precision, and `memory_stats()["peak_bytes_in_use"]`.

By default each precision runs in its own subprocess, so its peak memory and caches are its own (the parent never
initialises the accelerator); `--tiny` runs them in-process unless `--isolate` is given. The markdown table is
rewritten after every precision, so a run cut short still leaves the finished rows.

On a machine without jmp (e.g. a bare GPU box), install its pure-Python wheel first:
`pip download --no-deps jmp==0.0.4 -d wheels` here, then `pip install --no-index --no-deps --target deps wheels/*`
there and run with `PYTHONPATH=deps`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks import harness  # noqa: E402
from benchmarks.gpu_step import (  # noqa: E402  (imports jax, starts no backend)
    PRECISIONS,
    add_model_flags,
    build,
    custom_calls,
    data_batches,
    flops_per_token,
    layout_words,
    matmul_context,
    model_size,
    peak_flops,
)

REPO = harness.REPO
DEFAULT_OUT = harness.RESULTS / "gpu_throughput.md"
TINY_OUT = harness.RESULTS / "gpu_throughput_tiny.md"  # --tiny never overwrites the real results


# --------------------------------------------------------------------------------------------------------------------
# One precision, in this process.


def _compile(step, state, batch, label: str) -> tuple[dict, dict]:
    """AOT lowering and compile of the step: timings, compile events, custom calls and `memory_analysis()`."""
    with harness.compile_events().attribute(label):
        t0 = time.perf_counter()
        lowered = step.lower(state, batch)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    memory = None if mem is None else {
        k: int(getattr(mem, k + "_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    if memory is not None and getattr(mem, "peak_memory_in_bytes", None):
        memory["peak"] = int(mem.peak_memory_in_bytes)
    info = {"lower_s": t1 - t0, "compile_s": t2 - t1, "aot_compiles": harness.compile_events().count(label),
            "custom_calls": custom_calls(compiled.as_text()), "memory": memory}
    return info, compiled


def _timed_steps(step, state, batches: list, warmup: int, label: str) -> tuple[object, dict]:
    """`warmup` untimed then timed steps over `batches`, each followed by `block_until_ready`."""
    import jax

    times, losses, skipped = [], [], 0
    with harness.compile_events().attribute(label):
        for i, batch in enumerate(batches):
            t = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready((state, metrics))
            if i >= warmup:
                times.append(time.perf_counter() - t)
            losses.append(float(metrics["loss"]))
            skipped += not bool(metrics["grads_finite"])
    return state, {"times": times, "first_loss": losses[0], "last_loss": losses[-1], "skipped": skipped,
                   "step_compiles": harness.compile_events().count(label)}


def run_precision(name: str, size: dict, warmup: int, steps: int) -> dict:
    """Builds the model and a jaxamp train state for `name`, compiles, times the steps; returns a JSON-ready dict."""
    import jax

    device = jax.devices()[0]
    with matmul_context(name):
        step, state, batch, info = build(name, size)
        aot, _ = _compile(step, state, batch, f"{name}/aot")
        batches = data_batches(size, warmup + steps) if size.get("data") else [batch] * (warmup + steps)
        state, timed = _timed_steps(step, state, batches, warmup, f"{name}/steps")
    cfg, times = info["cfg"], timed.pop("times")
    stats = device.memory_stats() or {}
    step_s = statistics.median(times)
    tokens_per_step = size["batch_size"] * cfg.seq_len
    fpt = flops_per_token(info["n_no_pos"], cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.seq_len)
    peak, peak16 = peak_flops(device.device_kind, PRECISIONS[name][3]), peak_flops(device.device_kind, "16bit")
    return {
        "precision": name, "device_kind": device.device_kind, "platform": device.platform,
        "jax_version": jax.__version__, "n_params": info["n_params"], "n_params_no_pos": info["n_no_pos"],
        "flops_per_token": fpt, "tokens_per_step": tokens_per_step,
        "step_s": step_s, "step_s_min": min(times), "step_s_max": max(times), "tokens_per_s": tokens_per_step / step_s,
        "mfu": None if peak is None else tokens_per_step / step_s * fpt / peak, "peak_flops": peak,
        "mfu_16bit": None if peak16 is None else tokens_per_step / step_s * fpt / peak16,
        "custom_calls": aot["custom_calls"],
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit"),
        "lower_s": aot["lower_s"], "compile_s": aot["compile_s"], "aot_compiles": aot["aot_compiles"],
        "step_compiles": timed["step_compiles"], "memory": aot["memory"], "first_loss": timed["first_loss"],
        "last_loss": timed["last_loss"], "skipped": timed["skipped"],
        "final_loss_scale": float(state.loss_scale.loss_scale), "timed_steps": len(times),
    }


# --------------------------------------------------------------------------------------------------------------------
# Report.


def _header(args, size: dict, first: dict, argv) -> list[str]:
    head_dim = size["width"] // size["heads"]
    lines = [
        "# jaxamp training throughput" + (" (--tiny, CPU smoke test)" if args.tiny else ""),
        "",
        f"- command: `{harness.command_line(__file__, argv)}`",
        f"- device: {first.get('device_kind', 'n/a')} ({first.get('platform', 'n/a')}); host "
        f"{harness.machine(backend=False)}",
        f"- date: {harness.now()}",
        f"- model: {'--tiny' if args.tiny else args.model}: {layout_words(size)}, {size['heads']} heads, width "
        f"{size['width']} (head dim {head_dim}), "
        f"seq {size['seq_len']}, vocab {size['vocab']}, batch {size['batch_size']} "
        f"({size['batch_size'] * size['seq_len']:,} tokens/step); "
        + (f"{first['n_params']:,} params ({first['n_params_no_pos']:,} without position embedding); "
           f"{first['flops_per_token'] / 1e6:,.1f} MFLOP/token (6N + 12LHQT)" if first else "no precision finished"),
        f"- protocol: per precision, AOT lower + compile, {args.warmup} warmup + {args.steps} timed steps, each "
        f"`block_until_ready`; median step time; "
        + (f"real tokens of {size['data']}/train.bin, one batch per step, all on device before timing"
           if size.get("data") else "one fixed random-token batch already on device") + " (no input pipeline); "
        f"{'each precision in its own subprocess' if args.isolate else 'all precisions in one process'}",
        "- MFU against the dense peak of the precision's matmul unit (H100/H200: 1979 TFLOP/s FP8, 989 16-bit, "
        "494 TF32, 67 float32; A100: 312 / 156 / 19.5); fp8 also against the 16-bit peak, in brackets; n/a on "
        "other devices. GEMM counts from the compiled step's text: cuDNN fused attention calls; GEMMs with FP8 "
        "operands (cuBLASLt FP8 calls and Triton dots of FP8 tensors); all GEMMs (cuBLAS calls and Triton/XLA dots).",
    ]
    if first.get("platform") == "cpu":
        lines.append("- CPU timings on a shared 2-core machine with other jobs running; XLA:CPU upcasts "
                     "float16/bfloat16 dots to float32, so these figures test the script, not the precisions.")
    return lines + [""]


def _main_rows(results: dict) -> list[str]:
    lines = harness.table(["precision", "step ms (median)", "step ms min-max", "tokens/s", "MFU",
                           "peak bytes in use MiB", "lower s", "compile s", "compiles in steps", "loss first -> last",
                           "skipped steps", "final loss scale", "cuDNN attention / FP8 GEMMs / GEMMs"])
    for name in PRECISIONS:
        r = results.get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} |" + " |" * 11)
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        if name.startswith("fp8") and r.get("mfu_16bit") is not None:
            mfu += f" ({100 * r['mfu_16bit']:.1f}%)"
        calls = r.get("custom_calls") or {}
        lines.append(
            f"| {name} | {r['step_s'] * 1e3:,.1f} | {r['step_s_min'] * 1e3:,.1f}-{r['step_s_max'] * 1e3:,.1f} | "
            f"{r['tokens_per_s']:,.0f} | {mfu} | {harness.mib(r['peak_bytes_in_use'])} | {r['lower_s']:.2f} | "
            f"{r['compile_s']:.2f} | {r['step_compiles']} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} | "
            f"{r['skipped']} | {r['final_loss_scale']:g} | {calls.get('cudnn_attention', 'n/a')} / "
            f"{calls.get('f8_gemm', 'n/a')} / {calls.get('gemm', 'n/a')} |")
    return lines


def _memory_rows(args, results: dict, done: list) -> list[str]:
    mib = harness.mib
    lines = [
        "",
        "## Memory: the compiled step's `memory_analysis()`",
        "",
        "Argument = state + batch in; output = new state + metrics; alias = bytes of donated inputs reused for "
        "outputs; temp = activations and other scratch. Live at peak is about argument + output - alias + temp.",
        "",
        *harness.table(["precision", "argument MiB", "output MiB", "alias MiB", "temp MiB",
                        "argument + output - alias + temp MiB"]),
    ]
    for name in PRECISIONS:
        r = results.get(name)
        if r is None or "error" in r:
            continue
        m = r["memory"]
        if m is None:
            lines.append(f"| {name} | n/a | n/a | n/a | n/a | n/a |")
            continue
        total = m["argument"] + m["output"] - m["alias"] + m["temp"]
        lines.append(f"| {name} | {mib(m['argument'])} | {mib(m['output'])} | {mib(m['alias'])} | "
                     f"{mib(m['temp'])} | {mib(total)} |")
    if not args.isolate and any(r.get("peak_bytes_in_use") is not None for r in done):
        lines += ["", "peak bytes in use is the process's high-water mark so far (all precisions in one process)."]
    return lines


def report(args, size: dict, results: dict, argv=None) -> str:
    """The markdown tables of the precisions finished so far (`results`: name -> run_precision's dict or error)."""
    done = [r for r in results.values() if "error" not in r]
    lines = [*_header(args, size, done[0] if done else {}, argv), *_main_rows(results),
             *_memory_rows(args, results, done)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    """The flags, checked (one-line usage errors); `--data` is opened now, not after a compile."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="2 layers, width 64, seq 64, vocab 512, batch 4: a CPU test")
    p.add_argument("--steps", type=int, default=None, help="timed steps per precision (default: 10, --tiny: 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after compiling (default: 3, --tiny: 1)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: 16, --tiny: 4)")
    add_model_flags(p, "train_lm.py's --scan-layers: one compiled block, a shorter compile at gpt2-xl's 48 layers")
    p.add_argument("--data", default=None, help="directory of nanoGPT's train.bin/val.bin: time real tokens (the "
                   "vocabulary from its meta.pkl, else 50304)")
    p.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS),
                   help="which precisions to run (default: all)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="run each precision in its own subprocess (default: on, off with --tiny)")
    p.add_argument("--out", default=None, help=f"markdown table to write (default: {DEFAULT_OUT.relative_to(REPO)}, "
                   f"--tiny: {TINY_OUT.relative_to(REPO)})")
    p.add_argument("--json", default=None, help="also write the raw results (one dict per precision) to this file")
    p.add_argument("--only", choices=list(PRECISIONS), help=argparse.SUPPRESS)  # child mode: one precision
    p.add_argument("--result-json", help=argparse.SUPPRESS)  # child mode: where to write its result
    args = p.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (3 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.isolate = args.isolate if args.isolate is not None else not args.tiny
    args.out = args.out if args.out is not None else str(TINY_OUT if args.tiny else DEFAULT_OUT)
    if args.steps < 1 or args.warmup < 0 or (args.batch_size is not None and args.batch_size < 1):
        p.error("--steps and --batch-size must be >= 1, --warmup >= 0")
    if args.data is not None:
        from jaxamp.lm.data import DataError
        from jaxamp.lm.token_files import open_token_dir

        try:  # checked now, not after a compile
            opened = open_token_dir(args.data, vocab_size=None, seq_len=_size(args, data=False)["seq_len"])
            args.data_vocab = opened.vocab_size
        except DataError as err:
            p.error(f"--data: {err}")
    return args


def _size(args, data: bool = True) -> dict:
    """The model and batch sizes of `args`; with --data, its vocabulary and path too."""
    size = model_size(args, args.tiny, args.batch_size)
    if data and args.data is not None:
        size.update(vocab=args.data_vocab, data=str(args.data))
    return size


def _child(args, name: str, argv) -> dict:
    """Runs one precision in a fresh Python process; returns its result or {"error": one line}."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:]),
               "--only", name, "--result-json", str(result)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode == 0 and result.exists():
            return json.loads(result.read_text())
        tail = [line for line in proc.stdout.strip().splitlines() if line.strip()]
        msg = tail[-1] if tail else f"exit status {proc.returncode}"
        print(proc.stdout[-4000:], file=sys.stderr)
        return {"error": f"exit {proc.returncode}: {msg[:200]}".replace("|", "/")}


def _one(name: str, args, size: dict, argv) -> dict:
    """One precision's result: in a subprocess with `--isolate`, else here (a failure recorded, not raised)."""
    if args.isolate:
        return _child(args, name, argv)
    try:
        return run_precision(name, size, args.warmup, args.steps)
    except Exception as err:  # noqa: BLE001 - record the failure (e.g. out of memory), go on
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}".replace("|", "/")}


def main(argv=None) -> int:
    args = parse_args(argv)
    size = _size(args)
    if args.only:  # child mode
        Path(args.result_json).write_text(json.dumps(run_precision(args.only, size, args.warmup, args.steps)))
        return 0
    results = {}
    for name in args.precisions:
        harness.log(f"[{time.strftime('%H:%M:%S')}] {name} ...")
        results[name] = _one(name, args, size, argv)
        harness.write_report(args.out, report(args, size, results, argv), echo=False)  # partial results survive a cut
        if args.json:
            harness.write_json(args.json, {"command": harness.command_line(__file__, argv), "size": size,
                                           "results": results})
    harness.write_report(args.out, report(args, size, results, argv))
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
