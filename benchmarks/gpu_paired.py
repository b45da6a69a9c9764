"""Two precisions' steps timed in one process, interleaved round by round: their speed ratio without run-to-run drift.

    python benchmarks/gpu_paired.py --precisions bf16 fp16 --out benchmarks/results/gpu_paired.md
    python benchmarks/gpu_paired.py --tiny --rounds 2 --out /tmp/paired.md        # CPU smoke test

`gpu_throughput.py` runs each precision in its own process, minutes apart; clocks and thermals move in between, which
matters for a goal like "fp16 + dynamic loss scale within 3% of bf16". Here both steps of `gpu_throughput.build` are
compiled first, then each round times `--steps` steps of the first precision and `--steps` of the second (each step
followed by `block_until_ready`), alternating which goes first. Reported: the median step time of each, and the
median over rounds of the per-round ratio (second / first).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_throughput as gt  # noqa: E402  (puts the repo on sys.path too)

from jaxamp.lm.cli import command_line  # noqa: E402


def _timed_steps(step, state, batch, n: int):
    import jax

    times = []
    for _ in range(n):
        t = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t)
    return state, times


def paired(names: list[str], size: dict, rounds: int, steps: int, warmup: int) -> dict:
    """`{name: [per-round median step s]}` and the per-round ratios of the second precision to the first."""
    runs = {}
    for name in names:
        with gt.matmul_context(name):
            step, state, batch, _ = gt.build(name, size)
            state, _ = _timed_steps(step, state, batch, warmup + 1)  # compile and warm up
        runs[name] = [step, state, batch]
    medians = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            step, state, batch = runs[name]
            with gt.matmul_context(name):
                runs[name][1], times = _timed_steps(step, state, batch, steps)
            medians[name].append(statistics.median(times))
    ratios = [b / a for a, b in zip(medians[names[0]], medians[names[1]])]
    return {"medians": medians, "ratios": ratios}


def report(args, size: dict, result: dict) -> str:
    a, b = args.precisions
    tokens = size["batch_size"] * size["seq_len"]
    med = {n: statistics.median(v) for n, v in result["medians"].items()}
    import jax

    lines = [f"# {b} against {a}, interleaved in one process", "",
             f"- command: `{command_line()}`",
             f"- device: {jax.devices()[0].device_kind}; jax {jax.__version__}",
             f"- model: {size['layers']} layers, width {size['width']}, seq {size['seq_len']}, vocab {size['vocab']}, "
             f"batch {size['batch_size']} ({tokens:,} tokens/step); {args.rounds} rounds of {args.steps} steps each, "
             "alternating which precision goes first", "",
             "| precision | median step ms | tokens/s |", "| --- | --- | --- |"]
    lines += [f"| {n} | {med[n] * 1e3:,.2f} | {tokens / med[n]:,.0f} |" for n in (a, b)]
    ratios = result["ratios"]
    lines += ["", f"{b} / {a} step time: median over rounds {statistics.median(ratios):.4f} (min {min(ratios):.4f}, "
              f"max {max(ratios):.4f}), i.e. {b} is {100 * (statistics.median(ratios) - 1):+.2f}% "
              f"{'slower' if statistics.median(ratios) > 1 else 'faster'}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="gpu_throughput.py's --tiny sizes (a CPU test)")
    p.add_argument("--precisions", nargs=2, choices=list(gt.PRECISIONS), default=["bf16", "fp16"])
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: gpu_throughput's)")
    p.add_argument("--rounds", type=int, default=8, help="alternations (default: 8)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per precision per round (default: 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling (default: 2)")
    p.add_argument("--out", required=True, help="markdown report to write")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--rounds and --steps must be >= 1, --warmup >= 0")
    size = dict(gt.TINY if args.tiny else gt.FULL)
    if args.batch_size:
        size["batch_size"] = args.batch_size
    text = report(args, size, paired(args.precisions, size, args.rounds, args.steps, args.warmup))
    Path(args.out).write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
