"""Tokens/s of the reference LM on 1, 2, 4 and 8 (fake CPU) devices through jaxamp's mesh option.

    python benchmarks/scaling.py                          # reference model, global batch 48, fp16 + dynamic scale
    python benchmarks/scaling.py --layers 1 --width 32 --heads 2 --seq-len 16 --steps 2 --warmup 1 --rounds 1 \\
        --out /tmp/scaling.md                             # smoke test

Each configuration runs in its own process (the device count is fixed when JAX starts; fake CPU devices come from
XLA_FLAGS=--xla_force_host_platform_device_count=N): `jaxamp.lm.setup.build` with `mesh=...`, the global batch of each
step built by `jaxamp.lm.setup.train_batch` (as the training loop does), the jitted, state-donating step. The global
batch
is fixed (48 sequences of 64 tokens by default, divisible by 1, 2, 4 and 8), so every row does the same work and
the tokens per step are the same for every device count (strong scaling). Configurations are run round-robin for
`--rounds` rounds; the table gives the median over rounds of each round's steady-state tokens/s (`--steps` steps
timed after `--warmup` steps, the first of which compiles).

On a CPU the "devices" are threads of one process sharing the machine's cores. With 2 cores nothing can run more
than 2x faster than the cores allow: going from 1 to 2 fake devices may gain by using the second core that one
device's XLA:CPU program leaves partly idle, and beyond that the figures measure the overhead of partitioning
(collectives, per-device dispatch, smaller matmuls), not a speed-up. The commands for real GPUs are in the written
report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks import harness  # noqa: E402
from jaxamp.precision import get_policy  # noqa: E402

REPO = harness.REPO
DEFAULT_OUT = harness.RESULTS / "scaling.md"
# (label, devices, --mesh or None for the plain single-device path)
CONFIGS = [
    ("1 device, no mesh (plain jit)", 1, None),
    ("data=1", 1, "data=1"),
    ("data=2", 2, "data=2"),
    ("data=4", 4, "data=4"),
    ("data=8", 8, "data=8"),
    ("data=2,fsdp=4", 8, "data=2,fsdp=4"),
]


def parse_args(argv=None):
    """The flags, checked (one-line usage errors)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=48, help="global batch (sequences), divisible by 8")
    p.add_argument("--precision", default="fp16")
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-devices", type=int, default=8, choices=(1, 2, 4, 8),
                   help="only the configurations of at most this many devices (default: all)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--child", nargs=2, metavar=("DEVICES", "MESH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    harness.check_sizes(p, args, ("layers", "heads", "width", "seq_len", "batch_size", "steps", "rounds"), ("warmup",))
    if args.batch_size % 8:
        p.error(f"--batch-size must be divisible by 8 (the largest device count), got {args.batch_size}")
    try:
        get_policy(args.precision)
    except ValueError as err:
        p.error(f"--precision: {err}")
    harness.check_output(p, "--out", args.out)
    return args


# ---- child: one configuration ----------------------------------------------------------------------------------


def child(args) -> dict:
    """One configuration in this process (its device count fixed by XLA_FLAGS): steady-state tokens/s."""
    devices, mesh = int(args.child[0]), (None if args.child[1] == "none" else args.child[1])
    import jax  # pylint: disable=import-outside-toplevel

    from jaxamp.lm.config import TrainConfig  # pylint: disable=import-outside-toplevel
    from jaxamp.lm.setup import build, train_batch

    assert jax.device_count() == devices, (jax.device_count(), devices)
    cfg = TrainConfig(layers=args.layers, heads=args.heads, width=args.width, seq_len=args.seq_len,
                      batch_size=args.batch_size, precision=args.precision, mesh=mesh,
                      steps=args.warmup + args.steps)
    run = build(cfg)
    state = run.state
    t0 = time.perf_counter()
    for step in range(args.warmup):
        state, metrics = run.step_fn(state, train_batch(run, step))
        if step == 0:
            jax.block_until_ready(metrics)
            first_call = time.perf_counter() - t0
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for step in range(args.warmup, args.warmup + args.steps):
        state, metrics = run.step_fn(state, train_batch(run, step))
    jax.block_until_ready((state, metrics))
    seconds = time.perf_counter() - t0
    compiled = run.step_fn.compiled_count() if hasattr(run.step_fn, "compiled_count") else run.step_fn._cache_size()
    return {"seconds": seconds, "ms_per_step": 1e3 * seconds / args.steps,
            "tokens_per_s": cfg.tokens_per_step() * args.steps / seconds, "first_call_s": first_call,
            "compiled": compiled, "finite": bool(metrics["grads_finite"]), "loss": float(metrics["loss"]),
            "params": sum(x.size for x in jax.tree.leaves(state.params))}


# ---- parent ----------------------------------------------------------------------------------------------------


def _env(devices: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    return env


def _child_argv(args, devices: int, mesh: str | None) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--layers", str(args.layers), "--heads", str(args.heads),
            "--width", str(args.width), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
            "--precision", args.precision, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--child", str(devices), mesh or "none"]


def _machine() -> str:
    return (f"{harness.machine(backend=False, load=False)} on cpu (fake devices); load average at start "
            f"{harness.load_average()}")


GPU_COMMANDS = [
    "## Prepared commands for real devices (not run here)",
    "",
    "One GPU (no mesh, the single-device path; `--batch-size` is the batch of the one device):",
    "",
    "```sh",
    "python experiments/train_lm.py --precision bf16 --batch-size 64 --workdir runs/1gpu",
    "```",
    "",
    "8 GPUs of one host, data parallel (params replicated; `--batch-size` is the global batch, 64 per GPU here):",
    "",
    "```sh",
    "python experiments/train_lm.py --precision bf16 --mesh data=8 --batch-size 512 --workdir runs/8gpu",
    "# params and optimizer state sharded as well (FSDP) when they do not fit one GPU:",
    "python experiments/train_lm.py --precision bf16 --mesh data=2,fsdp=4 --batch-size 512 --workdir runs/fsdp",
    "```",
    "",
    "2 hosts with 8 GPUs each (16 devices), one command per host; host 0's address must be reachable from host 1, "
    "and `--workdir` must be one shared file system (orbax writes one checkpoint from all processes):",
    "",
    "```sh",
    "# on host 0 (10.0.0.1)",
    "python experiments/train_lm.py --precision bf16 --mesh data=16 --batch-size 1024 --workdir /shared/2h \\",
    "    --coordinator 10.0.0.1:12345 --num-processes 2 --process-id 0",
    "# on host 1",
    "python experiments/train_lm.py --precision bf16 --mesh data=16 --batch-size 1024 --workdir /shared/2h \\",
    "    --coordinator 10.0.0.1:12345 --num-processes 2 --process-id 1",
    "```",
    "",
    "(`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` may replace the three flags. With "
    "`--mesh data=2,fsdp=8` the params are split across the 8 GPUs of each host and replicated across the two "
    "hosts, so the all-gathers stay inside a host.)",
]


def report(args, argv, machine: str, results: dict, wall_s: float) -> str:
    """The markdown report: the table over configurations, then the prepared commands for real devices."""
    tokens = args.batch_size * args.seq_len
    lines = [
        "# jaxamp scaling on fake CPU devices",
        "",
        f"- command: `{harness.command_line(__file__, argv)}`",
        f"- machine: {machine}; at the end {harness.load_average()}",
        f"- date: {harness.now()}; wall time {wall_s:.0f} s",
        f"- model: {args.layers} layer(s), {args.heads} heads, width {args.width}, seq {args.seq_len}; precision "
        f"{args.precision} (DynamicLossScale for fp16), AdamW as experiments/train_lm.py; **fixed global batch "
        f"{args.batch_size}** ({tokens:,} tokens/step, the same for every device count: strong scaling)",
        f"- protocol: one process per configuration (XLA_FLAGS=--xla_force_host_platform_device_count=N), "
        f"{args.rounds} round(s) round-robin; per round {args.warmup} untimed steps (the first compiles), then "
        f"{args.steps} timed steps (dispatch all, block once); batches built per step by `jaxamp.lm.setup.train_batch`",
        "",
        "**These are not speed-ups to expect on accelerators.** The fake devices are threads of one process on a "
        "shared 2-core machine (other jobs were running: see the load averages). A gain from 1 to 2 devices can come "
        "only from the second core, which one device's XLA:CPU program leaves partly idle; with 4 or 8 devices on "
        "2 cores the numbers measure what partitioning costs (collectives, per-device dispatch, smaller per-device "
        "matmuls, building the global batch). Real scaling needs real devices: see the commands at the end.",
        "",
        *harness.table(["configuration", "devices", "median tokens/s", "min-max tokens/s over rounds",
                        "median ms/step", "vs 1 device (plain jit)", "first call s (median)", "compiles"]),
    ]
    base = statistics.median(r["tokens_per_s"] for r in results[CONFIGS[0][0]])
    for label, devices, _ in CONFIGS:
        if label not in results:
            continue
        rs = results[label]
        tps = [r["tokens_per_s"] for r in rs]
        med = statistics.median(tps)
        lines.append(
            f"| {label} | {devices} | {med:,.0f} | {min(tps):,.0f}-{max(tps):,.0f} | "
            f"{statistics.median(r['ms_per_step'] for r in rs):.1f} | {med / base:.2f}x | "
            f"{statistics.median(r['first_call_s'] for r in rs):.1f} | {max(r['compiled'] for r in rs)} |")
    lines += [
        "",
        "\"compiles\" is the number of executables the jitted step holds after the run (1 = no recompile across "
        "steps). Every step's gradients were finite in every configuration: "
        f"{all(r['finite'] for rs in results.values() for r in rs)}.",
        "",
        *GPU_COMMANDS,
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    machine = _machine()
    t0 = time.perf_counter()
    configs = [c for c in CONFIGS if c[1] <= args.max_devices]
    results: dict[str, list[dict]] = {label: [] for label, _, _ in configs}
    for r in range(args.rounds):
        for label, devices, mesh in harness.rotated(configs, r):
            proc = subprocess.run(_child_argv(args, devices, mesh), env=_env(devices), cwd=REPO, capture_output=True,
                                  text=True, timeout=1800)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"{label} failed:\n{proc.stderr[-3000:]}")
            results[label].append(json.loads(lines[-1][len("RESULT "):]))
            print(f"round {r + 1} {label}: {results[label][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
    harness.write_report(args.out, report(args, argv, machine, results, time.perf_counter() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
