"""Two precisions' steps timed in one process, interleaved round by round: their speed ratio without run-to-run drift.

    python benchmarks/gpu_paired.py --precisions bf16 fp16 --out benchmarks/results/gpu_paired.md
    python benchmarks/gpu_paired.py --tiny --rounds 2 --out /tmp/paired.md        # CPU smoke test

`gpu_throughput.py` runs each precision in its own process, minutes apart; clocks and thermals move in between, which
matters for a goal like "fp16 + dynamic loss scale within 3% of bf16". Here both steps of `gpu_step.build` are
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks import gpu_step as gs  # noqa: E402  (imports jax, starts no backend)
from benchmarks import harness  # noqa: E402


def _timed_steps(step, state, batch, n: int):
    import jax

    times = []
    for _ in range(n):
        t = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t)
    return state, times


def _window(name: str, size: dict):
    """Precision `name`'s step as a `harness.interleaved` window: runs len(idx) steps, returns their median."""
    with gs.matmul_context(name):
        step, state, batch, _ = gs.build(name, size)
    carry = {"state": state}

    def window(idx: range) -> float:
        with gs.matmul_context(name):
            carry["state"], times = _timed_steps(step, carry["state"], batch, len(idx))
        return statistics.median(times)

    return window


def paired(names: list[str], size: dict, rounds: int, steps: int, warmup: int) -> dict:
    """`{name: [per-round median step s]}` and the per-round ratios of the second precision to the first."""
    windows = {name: _window(name, size) for name in names}
    _, medians = harness.interleaved(windows, rounds=rounds, steps=steps, warmup=warmup + 1)  # compile, warm up
    return {"medians": medians, "ratios": harness.paired_ratios(medians[names[1]], medians[names[0]])}


def report(args, size: dict, result: dict) -> str:
    """The two precisions' median step times and tokens/s, and the ratio over rounds."""
    import jax

    a, b = args.precisions
    tokens = size["batch_size"] * size["seq_len"]
    med = {n: statistics.median(v) for n, v in result["medians"].items()}
    lines = [f"# {b} against {a}, interleaved in one process", "",
             f"- command: `{harness.command_line(__file__, args.argv)}`",
             f"- device: {jax.devices()[0].device_kind}; jax {jax.__version__}",
             f"- model: {size['layers']} layers, width {size['width']}, seq {size['seq_len']}, vocab {size['vocab']}, "
             f"batch {size['batch_size']} ({tokens:,} tokens/step); {args.rounds} rounds of {args.steps} steps each, "
             "alternating which precision goes first", "",
             *harness.table(["precision", "median step ms", "tokens/s"],
                            [[n, f"{med[n] * 1e3:,.2f}", f"{tokens / med[n]:,.0f}"] for n in (a, b)])]
    ratios = result["ratios"]
    lines += ["", f"{b} / {a} step time: median over rounds {statistics.median(ratios):.4f} (min {min(ratios):.4f}, "
              f"max {max(ratios):.4f}), i.e. {b} is {100 * (statistics.median(ratios) - 1):+.2f}% "
              f"{'slower' if statistics.median(ratios) > 1 else 'faster'}."]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked (one-line usage errors)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gs.add_size_flags(p, precisions=2)
    harness.add_timing_flags(p, rounds=8, steps=5, warmup=2, first_call_included=False)  # rounds alternate
    p.add_argument("--out", required=True, help="markdown report to write")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    harness.check_sizes(p, args, ("rounds", "steps"), ("warmup",))
    harness.check_output(p, "--out", args.out)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    size = gs.sizes(args.tiny, args.batch_size or None)
    harness.write_report(args.out, report(args, size, paired(args.precisions, size, args.rounds, args.steps,
                                                                args.warmup)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
