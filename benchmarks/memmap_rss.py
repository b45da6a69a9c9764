"""Peak resident memory of training on nanoGPT token files as the file grows: the memmap is never read whole.

    python benchmarks/memmap_rss.py                        # train.bin of 64 MiB, 256 MiB and 1 GiB (about a minute)
    python benchmarks/memmap_rss.py --tiny --out /tmp/rss.md   # 16 and 128 MiB, small batches (the test suite's run)

For each size, a synthetic nanoGPT data directory is written to --tmp-dir (train.bin of random uint16 ids below
50304, val.bin a tenth of its size). A fresh Python process per size then runs each reader in turn; for each it
records the resident set (VmRSS), resets the kernel's peak (`/proc/self/clear_refs` 5), reads, and reports the new
peak (VmHWM); then it drops what the reader holds:

  trainer     what `train_lm.py --data DIR` does: `open_token_dir` (size checks, the checksum over 32 sampled blocks
              of 256 KiB, their vocabulary check), `eval_batches` of the validation split, then --steps training
              batches with `batch_at`, whose windows come through fresh memmaps of train.bin, 8 windows each
  one memmap  the same batches from one memmap kept open for the whole run: the pages it touched stay mapped
  np.fromfile the control: train.bin read into memory, then the same batches (the peak grows by the file's size,
              which shows the measurement sees a full read)

Peak RSS increase = VmHWM after - VmRSS before (MiB). A touched window maps its whole page-cache folio: 4 KiB pages,
or up to 2 MiB on kernels with large folios (Linux 6.x on ext4 and xfs), which is why the trainer maps 8 windows at
a time. Writes the table to benchmarks/results/memmap_rss.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks import harness  # noqa: E402

REPO = harness.REPO
DEFAULT_OUT = harness.RESULTS / "memmap_rss.md"
TINY_OUT = harness.RESULTS / "memmap_rss_tiny.md"  # --tiny never overwrites the real results
READERS = ("trainer", "one memmap", "np.fromfile")
VOCAB = 50304  # ids below GPT-2's padded vocabulary
_WRITE_CHUNK = 32 * 2**20  # ids generated and written per chunk (64 MiB)


def write_data(directory: Path, train_mib: int, seed: int = 0) -> None:
    """A nanoGPT data directory: train.bin of `train_mib` MiB and val.bin of a tenth of it, random uint16 ids."""
    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, mib in (("train.bin", train_mib), ("val.bin", max(1, train_mib // 10))):
        remaining = mib * 2**20 // 2  # tokens
        with open(directory / name, "wb") as f:
            while remaining:
                n = min(remaining, _WRITE_CHUNK)
                rng.integers(0, VOCAB, n, dtype=np.uint16).astype("<u2").tofile(f)
                remaining -= n


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(directory: Path, steps: int, batch_size: int, seq_len: int, eval_batches_n: int) -> list[dict]:
    """Runs every reader on `directory` in this (fresh) process, one after the other; returns one dict each."""
    return [_one_reader(directory, reader, steps, batch_size, seq_len, eval_batches_n) for reader in READERS]


def _one_reader(directory: Path, reader: str, steps: int, batch_size: int, seq_len: int, eval_batches_n: int):
    """One reader's open time, ms per batch and peak RSS increase (MiB) in this process."""
    import numpy as np

    from jaxamp.lm.data import batch_at, eval_batches
    from jaxamp.lm.token_files import open_token_dir

    before = _status_kib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # peak := current (Linux >= 4.0)
        reset = True
    except OSError:
        reset = False
    t0 = time.perf_counter()
    d = open_token_dir(directory, vocab_size=VOCAB, seq_len=seq_len)
    val = eval_batches(d.val, batch_size=batch_size, seq_len=seq_len, num_batches=eval_batches_n, vocab_size=VOCAB)
    source = {"trainer": lambda: d.train, "one memmap": d.train.open,
              "np.fromfile": lambda: np.fromfile(d.train.path, dtype="<u2")}[reader]()
    t1 = time.perf_counter()
    checksum = 0
    for step in range(steps):
        x, _ = batch_at(source, seed=0, step=step, batch_size=batch_size, seq_len=seq_len, vocab_size=VOCAB)
        checksum += int(x[:, 0].sum())
    t2 = time.perf_counter()
    peak = _status_kib("VmHWM")
    del val, source  # unmapped / freed before the next reader
    return {"reader": reader, "tokens": len(d.train), "open_s": t1 - t0, "batch_ms": 1e3 * (t2 - t1) / steps,
            "rss_before_mib": before / 1024, "peak_increase_mib": (peak - before) / 1024, "peak_reset": reset,
            "checksum": checksum}


def measure(directory: Path, args) -> list[dict]:
    """`child` in a fresh process (no earlier allocation or mapping counts towards its peaks)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(directory), "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--eval-batches", str(args.eval_batches)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if proc.returncode:
        raise RuntimeError(f"reading {directory} failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(args, rows: list[dict], argv) -> str:
    """The markdown table: one row per size and reader, then the trainer's growth line."""
    lines = [
        "# Peak resident memory of nanoGPT token files read by memmap" + (" (--tiny)" if args.tiny else ""),
        "",
        f"- command: `{harness.command_line(__file__, argv)}`",
        f"- machine: {harness.machine(backend=False)}; date: {harness.now()}",
        f"- per reader: checksum and vocabulary check of train.bin and val.bin, {args.eval_batches} validation "
        f"batches, {args.steps} training batches of {args.batch_size} x {args.seq_len} tokens (seed 0); one fresh "
        "process per size; peak RSS increase = VmHWM after (peak reset before) - VmRSS before",
        "- the files were just written, so they sit in the page cache: times are not disk reads",
        "- readers: `trainer` = what `train_lm.py --data DIR` does (open_token_dir, eval_batches, batch_at through "
        "fresh memmaps of 8 windows each); `one memmap` = the same batches from one memmap kept open (the pages it "
        "touched stay mapped: nanoGPT's reason to re-create its memmap per batch); `np.fromfile` = the control, the "
        "file read into memory",
        "- a touched window maps its whole page-cache folio (4 KiB, or up to 2 MiB with large folios), so a batch "
        "costs the trainer at most 8 folios at a time, whatever the file's size",
        "",
        *harness.table(["train.bin MiB", "tokens", "reader", "open + checksum (+ load) s", "ms per batch",
                        "peak RSS increase MiB"]),
    ]
    for r in rows:
        lines.append(f"| {r['mib']:,} | {r['tokens']:,} | {r['reader']} | {r['open_s']:.3f} | {r['batch_ms']:.3f} | "
                     f"{r['peak_increase_mib']:.1f} |")
    if not all(r["peak_reset"] for r in rows):
        lines += ["", "(/proc/self/clear_refs could not be written: peaks include the imports' own peak)"]
    trainer = [r for r in rows if r["reader"] == "trainer"]
    if len(trainer) > 1:
        lines += ["", f"trainer: the file grew {trainer[-1]['mib'] / trainer[0]['mib']:.0f}x "
                  f"({trainer[0]['mib']:,} -> {trainer[-1]['mib']:,} MiB); the peak RSS increase went from "
                  f"{trainer[0]['peak_increase_mib']:.1f} to {trainer[-1]['peak_increase_mib']:.1f} MiB."]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    """The flags, checked (one-line usage errors); `--tiny` fills in the small sizes."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="16 and 128 MiB, 20 batches of 4 x 256: a quick test")
    p.add_argument("--sizes-mib", type=int, nargs="+", default=None, help="train.bin sizes (default 64 256 1024)")
    p.add_argument("--steps", type=int, default=None, help="training batches per run (default 500, --tiny 20)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per batch (default 12, nanoGPT's GPT-2 "
                   "recipe; --tiny 4)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 1024, --tiny 256)")
    p.add_argument("--eval-batches", type=int, default=20, help="validation batches built at the start")
    p.add_argument("--tmp-dir", default=None, help="where the synthetic files go (default: the system's temp dir)")
    p.add_argument("--out", default=None, help=f"markdown table (default {DEFAULT_OUT.relative_to(REPO)}, --tiny "
                   f"{TINY_OUT.relative_to(REPO)})")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes_mib = args.sizes_mib or ([16, 128] if args.tiny else [64, 256, 1024])
    args.steps = args.steps or (20 if args.tiny else 500)
    args.batch_size = args.batch_size or (4 if args.tiny else 12)
    args.seq_len = args.seq_len or (256 if args.tiny else 1024)
    args.out = args.out or str(TINY_OUT if args.tiny else DEFAULT_OUT)
    harness.check_sizes(p, args, ("steps", "batch_size", "seq_len", "eval_batches"))
    if min(args.sizes_mib) < 1:
        p.error("--sizes-mib must be >= 1")
    harness.check_output(p, "--out", args.out)
    if args.tmp_dir is not None and not Path(args.tmp_dir).is_dir():
        p.error(f"--tmp-dir {args.tmp_dir} is not a directory")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(Path(args.child), args.steps, args.batch_size, args.seq_len, args.eval_batches)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
        for mib in sorted(args.sizes_mib):
            directory = Path(tmp) / f"{mib}mib"
            write_data(directory, mib)
            for row in measure(directory, args):
                rows.append({"mib": mib, **row})
                print(f"{mib} MiB {row['reader']}: +{row['peak_increase_mib']:.1f} MiB", file=sys.stderr)
            checksums = {r["checksum"] for r in rows if r["mib"] == mib}
            if len(checksums) != 1:
                raise RuntimeError(f"the readers gathered different batches on {mib} MiB: {checksums}")
    harness.write_report(args.out, report(args, rows, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
