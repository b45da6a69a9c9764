"""Training throughput, MFU and memory of a GPT-2-124M-sized LM under jaxamp, in five precisions, one command.

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
import contextlib
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from jaxamp.lm.cli import command_line  # noqa: E402
from jaxamp.lm.presets import MODEL_PRESETS, PRESET_FIELDS  # noqa: E402  (imports jax, starts no backend)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu_throughput.md"
TINY_OUT = REPO / "benchmarks" / "results" / "gpu_throughput_tiny.md"  # --tiny never overwrites the real results
FUSED_CHUNK = 4096  # tokens per block of the fused head + cross-entropy in the *-fused rows
PRECISIONS = {  # name -> (jaxamp policy, dynamic loss scale?, matmul precision or None, peak-table key, loss_chunk)
    "fp32-highest": ("fp32", False, "highest", "fp32", 0),
    "fp32": ("fp32", False, None, "tf32", 0),
    "bf16": ("bf16", False, None, "16bit", 0),
    "bf16-fused": ("bf16", False, None, "16bit", FUSED_CHUNK),  # TransformerConfig.loss_chunk: no whole f32 logits
    "fp16": ("fp16", True, None, "16bit", 0),
    "fp8": ("fp8", False, None, "fp8", 0),
}
# Dense peak FLOP/s per device kind (substring of jax.devices()[0].device_kind): 16-bit tensor cores, TF32 tensor
# cores (the default float32 matmul), true float32 (precision="highest"). Sparse figures are not used.
PEAK_FLOPS = {
    "H200": {"fp8": 1979e12, "16bit": 989e12, "tf32": 494e12, "fp32": 67e12},
    "H100": {"fp8": 1979e12, "16bit": 989e12, "tf32": 494e12, "fp32": 67e12},
    "A100": {"16bit": 312e12, "tf32": 156e12, "fp32": 19.5e12},  # no FP8 units
}
def preset_size(model: str, batch_size: int = 16) -> dict:
    """Sizes of train_lm.py's --model preset (layers, heads, width, seq_len, vocab) and a batch size."""
    preset = MODEL_PRESETS[model]
    return {**{k: preset[k] for k in PRESET_FIELDS}, "vocab": preset["vocab_size"], "batch_size": batch_size}


FULL = preset_size("gpt2-124m")  # 12 layers, 12 heads, width 768, seq 1024, vocab 50304, batch 16
TINY = dict(layers=2, heads=4, width=64, seq_len=64, vocab=512, batch_size=4)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def peak_flops(device_kind: str, key: str) -> float | None:
    """The dense peak FLOP/s of this device for a precision key, or None for an unknown device (CPU)."""
    for name, table in PEAK_FLOPS.items():
        if name.lower() in device_kind.lower():
            return table.get(key)
    return None


def custom_calls(hlo_text: str) -> dict:
    """Counts of the compiled step's custom calls that matter here: cuDNN fused attention, FP8 GEMMs, all GEMMs."""
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo_text)
    return {"cudnn_attention": sum("fmha" in t for t in targets), "f8_gemm": sum("f8" in t for t in targets),
            "gemm": sum("matmul" in t or "gemm" in t for t in targets)}


def flops_per_token(n_params_no_pos: int, layers: int, heads: int, head_dim: int, seq_len: int) -> float:
    """nanoGPT's `estimate_mfu`: 6 N (forward + backward of the weights) + 12 L H Q T (attention scores)."""
    return 6 * n_params_no_pos + 12 * layers * heads * head_dim * seq_len


# --------------------------------------------------------------------------------------------------------------------
# One precision, in this process.

def build(name: str, size: dict):
    """The jitted, donating jaxamp step of precision `name` and its first state and batch (on the default device).

    Returns:
      (step, state, batch, info): `step(state, batch) -> (state, metrics)`; batch = (inputs, targets), both
      i32[batch, seq]; info = {"cfg", "n_params", "n_no_pos"}. Call it (and the step) inside `matmul_context(name)`.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from jaxamp import DynamicLossScale, NoOpLossScale, TrainState, train_step
    from jaxamp.lm.model import TransformerConfig, TransformerLM, count_params
    from jaxamp.lm.setup import lm_variables, make_policy
    from jaxamp.precision import uses_fp8

    policy_name, dynamic, _, _, loss_chunk = PRECISIONS[name]
    policy = make_policy(policy_name)  # the experiment's: embedding tables float32 in the compute copy
    cfg = TransformerConfig(vocab_size=size["vocab"], seq_len=size["seq_len"], num_layers=size["layers"],
                            num_heads=size["heads"], width=size["width"], dropout=0.0, fp8=uses_fp8(policy),
                            loss_chunk=loss_chunk)
    model = TransformerLM(cfg)

    def loss_fn(params, batch, rng):
        del rng  # no dropout
        inputs, targets = batch  # i32[batch, seq] each
        return model.apply(lm_variables(params), inputs, targets, deterministic=True)  # f32[] mean cross-entropy

    init_key, data_key, state_key = jax.random.split(jax.random.key(0), 3)
    variables = jax.jit(model.init)(init_key, jnp.zeros((1, cfg.seq_len), jnp.int32))
    params = variables if cfg.fp8 else variables["params"]  # FP8: its scales and amax histories ride along
    n_params = count_params(variables["params"])
    info = {"cfg": cfg, "n_params": n_params, "n_no_pos": n_params - int(variables["params"]["wpe"]["embedding"].size)}
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(learning_rate=6e-4, b1=0.9, b2=0.95, weight_decay=0.1))
    loss_scale = DynamicLossScale(2.0**15) if dynamic else NoOpLossScale()
    state = TrainState.create(params=params, tx=tx, policy=policy, loss_scale=loss_scale, rng=state_key)
    tokens = jax.random.randint(data_key, (size["batch_size"], cfg.seq_len + 1), 0, cfg.vocab_size, jnp.int32)
    batch = (tokens[:, :-1], tokens[:, 1:])  # i32[batch, seq] each
    step = jax.jit(lambda s, b: train_step(s, b, loss_fn), donate_argnums=0)
    return step, state, batch, info


def data_batches(size: dict, n: int) -> list:
    """The training batches of steps 0 .. n-1 from `size["data"]`'s train.bin (seed 0), on the default device."""
    import jax

    from jaxamp.lm.data import batch_at
    from jaxamp.lm.token_files import open_token_dir

    d = open_token_dir(size["data"], vocab_size=size["vocab"], seq_len=size["seq_len"])
    return [jax.device_put(batch_at(d.train, seed=0, step=i, batch_size=size["batch_size"], seq_len=size["seq_len"],
                                    vocab_size=d.vocab_size)) for i in range(n)]


def matmul_context(name: str):
    """`jax.default_matmul_precision` of precision `name` (a null context for the default precision)."""
    import jax

    matmul_precision = PRECISIONS[name][2]
    return jax.default_matmul_precision(matmul_precision) if matmul_precision else contextlib.nullcontext()


def run_precision(name: str, size: dict, warmup: int, steps: int) -> dict:
    """Builds the model and a jaxamp train state for `name`, compiles, times the steps; returns a JSON-ready dict."""
    import jax

    peak_key = PRECISIONS[name][3]
    compiles = [0]

    def on_event(event: str, duration: float, **kwargs) -> None:
        del duration, kwargs
        if event == COMPILE_EVENT:
            compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(on_event)
    device = jax.devices()[0]
    with matmul_context(name):
        step, state, batch, info = build(name, size)
        cfg, n_params, n_no_pos = info["cfg"], info["n_params"], info["n_no_pos"]

        compiles[0] = 0
        t0 = time.perf_counter()
        lowered = step.lower(state, batch)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        calls = custom_calls(compiled.as_text())
        mem = compiled.memory_analysis()
        memory = None if mem is None else {
            k: int(getattr(mem, k + "_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
        if memory is not None and getattr(mem, "peak_memory_in_bytes", None):
            memory["peak"] = int(mem.peak_memory_in_bytes)
        aot_compiles = compiles[0]

        compiles[0] = 0
        times, losses, skipped = [], [], 0
        batches = data_batches(size, warmup + steps) if size.get("data") else [batch] * (warmup + steps)
        for i in range(warmup + steps):
            t = time.perf_counter()
            state, metrics = step(state, batches[i])
            jax.block_until_ready((state, metrics))
            if i >= warmup:
                times.append(time.perf_counter() - t)
            losses.append(float(metrics["loss"]))
            skipped += not bool(metrics["grads_finite"])
        step_compiles = compiles[0]

    stats = device.memory_stats() or {}
    step_s = statistics.median(times)
    tokens_per_step = size["batch_size"] * cfg.seq_len
    fpt = flops_per_token(n_no_pos, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.seq_len)
    peak = peak_flops(device.device_kind, peak_key)
    return {
        "precision": name, "device_kind": device.device_kind, "platform": device.platform,
        "jax_version": jax.__version__, "n_params": n_params, "n_params_no_pos": n_no_pos,
        "flops_per_token": fpt, "tokens_per_step": tokens_per_step,
        "step_s": step_s, "step_s_min": min(times), "step_s_max": max(times), "tokens_per_s": tokens_per_step / step_s,
        "mfu": None if peak is None else tokens_per_step / step_s * fpt / peak, "peak_flops": peak,
        "mfu_16bit": None if peak_flops(device.device_kind, "16bit") is None
        else tokens_per_step / step_s * fpt / peak_flops(device.device_kind, "16bit"), "custom_calls": calls,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit"),
        "lower_s": t1 - t0, "compile_s": t2 - t1, "aot_compiles": aot_compiles, "step_compiles": step_compiles,
        "memory": memory, "first_loss": losses[0], "last_loss": losses[-1], "skipped": skipped,
        "final_loss_scale": float(state.loss_scale.loss_scale), "timed_steps": len(times),
    }


# --------------------------------------------------------------------------------------------------------------------
# Report.

def _mib(x) -> str:
    return "n/a" if x is None else f"{x / 2**20:,.1f}"


def report(args, size: dict, results: dict, argv=None) -> str:
    done = [r for r in results.values() if "error" not in r]
    first = done[0] if done else {}
    device_kind = first.get("device_kind", "n/a")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head_dim = size["width"] // size["heads"]
    lines = [
        "# jaxamp training throughput" + (" (--tiny, CPU smoke test)" if args.tiny else ""),
        "",
        f"- command: `{command_line(argv)}`",
        f"- device: {device_kind} ({first.get('platform', 'n/a')}); jax {first.get('jax_version', 'n/a')}; "
        f"host {platform.platform()}, os.cpu_count()={os.cpu_count()}",
        f"- date: {date}",
        f"- model: {'--tiny' if args.tiny else args.model}: {size['layers']} layers, {size['heads']} heads, width "
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
        "other devices. Custom calls: cuDNN fused attention, FP8 GEMMs, all cuBLAS GEMMs in the compiled step.",
    ]
    if first.get("platform") == "cpu":
        lines.append("- CPU timings on a shared 2-core machine with other jobs running; XLA:CPU upcasts "
                     "float16/bfloat16 "
                     "dots to float32, so these figures test the script, not the precisions.")
    lines += [
        "",
        "| precision | step ms (median) | step ms min-max | tokens/s | MFU | peak bytes in use MiB | lower s | "
        "compile s | compiles in steps | loss first -> last | skipped steps | final loss scale | "
        "cuDNN attention / FP8 GEMM / GEMM calls |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in PRECISIONS:
        r = results.get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} |" + " |" * 11)
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        if name == "fp8" and r.get("mfu_16bit") is not None:
            mfu += f" ({100 * r['mfu_16bit']:.1f}%)"
        calls = r.get("custom_calls") or {}
        lines.append(
            f"| {name} | {r['step_s'] * 1e3:,.1f} | {r['step_s_min'] * 1e3:,.1f}-{r['step_s_max'] * 1e3:,.1f} | "
            f"{r['tokens_per_s']:,.0f} | {mfu} | {_mib(r['peak_bytes_in_use'])} | {r['lower_s']:.2f} | "
            f"{r['compile_s']:.2f} | {r['step_compiles']} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} | "
            f"{r['skipped']} | {r['final_loss_scale']:g} | {calls.get('cudnn_attention', 'n/a')} / "
            f"{calls.get('f8_gemm', 'n/a')} / {calls.get('gemm', 'n/a')} |")
    lines += [
        "",
        "## Memory: the compiled step's `memory_analysis()`",
        "",
        "Argument = state + batch in; output = new state + metrics; alias = bytes of donated inputs reused for "
        "outputs; temp = activations and other scratch. Live at peak is about argument + output - alias + temp.",
        "",
        "| precision | argument MiB | output MiB | alias MiB | temp MiB | argument + output - alias + temp MiB |",
        "| --- | --- | --- | --- | --- | --- |",
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
        lines.append(f"| {name} | {_mib(m['argument'])} | {_mib(m['output'])} | {_mib(m['alias'])} | "
                     f"{_mib(m['temp'])} | {_mib(total)} |")
    if not args.isolate and any(r.get("peak_bytes_in_use") is not None for r in done):
        lines += ["", "peak bytes in use is the process's high-water mark so far (all precisions in one process)."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="2 layers, width 64, seq 64, vocab 512, batch 4: a CPU test")
    p.add_argument("--steps", type=int, default=None, help="timed steps per precision (default: 10, --tiny: 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after compiling (default: 3, --tiny: 1)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: 16, --tiny: 4)")
    p.add_argument("--model", choices=list(MODEL_PRESETS), default="gpt2-124m",
                   help="size preset of train_lm.py's --model (default: gpt2-124m; --tiny overrides it)")
    p.add_argument("--data", default=None, help="directory of nanoGPT's train.bin/val.bin: time real tokens (the "
                   "vocabulary from its meta.pkl, else 50304)")
    p.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS),
                   help="which precisions to run (default: all five)")
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
    size = dict(TINY) if args.tiny else preset_size(args.model)
    if args.batch_size is not None:
        size["batch_size"] = args.batch_size
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


def main(argv=None) -> int:
    args = parse_args(argv)
    size = _size(args)
    if args.only:  # child mode
        result = run_precision(args.only, size, args.warmup, args.steps)
        Path(args.result_json).write_text(json.dumps(result))
        return 0

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results, failed = {}, False
    for name in args.precisions:
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
        if args.isolate:
            results[name] = _child(args, name, argv)
        else:
            try:
                results[name] = run_precision(name, size, args.warmup, args.steps)
            except Exception as err:  # noqa: BLE001 - record the failure (e.g. out of memory), go on
                results[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}".replace("|", "/")}
        failed |= "error" in results[name]
        out.write_text(report(args, size, results, argv), encoding="utf-8")  # partial results survive a cut
        if args.json:
            Path(args.json).write_text(json.dumps({"command": command_line(argv), "size": size, "results": results},
                                                  indent=1), encoding="utf-8")
    table = report(args, size, results, argv)
    out.write_text(table, encoding="utf-8")
    print(table, end="")
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
