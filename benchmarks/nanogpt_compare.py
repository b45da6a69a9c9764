"""nanoGPT comparison on CPU: jaxamp's fp32 step against the same model in plain PyTorch (nanoGPT's code), and our
reference run's validation loss against nanoGPT's published CPU figure (val loss 1.88, "about 3 minutes").

    python benchmarks/nanogpt_compare.py                          # throughput, reference size (~3 min on 2 cores)
    python benchmarks/nanogpt_compare.py --train-steps 2000       # + nanoGPT's CPU run replicated in PyTorch
    python benchmarks/nanogpt_compare.py --layers 1 --width 32 --heads 2 --rounds 2 --steps 3 --out /tmp/x.md

What it measures:

1. Training throughput, fp32, on the same batches (`jaxamp.lm.data.batch_at`, seed 1337): jaxamp's
   `build(TrainConfig(precision="fp32")).step_fn` (jitted, state donated; one `block_until_ready` per timed window)
   and a compact, faithful copy of nanoGPT's `model.py` / `train.py` step in eager PyTorch (`--compile=False`):
   forward + loss, backward, `clip_grad_norm_(1.0)`, `AdamW.step`, `zero_grad(set_to_none=True)`, with
   `torch.set_num_threads(os.cpu_count())` and, as a second PyTorch row, with 1 thread (`--threads`). All in one
   process, interleaved: each round times `--steps` steps of each (the first one rotates between rounds); medians
   over rounds.
2. Equivalence: jaxamp's initial weights copied into the PyTorch model; both take the same `--check-steps` steps on
   the same batches; the losses must agree to float32 rounding.
3. Validation loss: our reference run (`runs/reference2/fp32/summary.json`, else the fp32 row of
   `benchmarks/results/reference_run.md`) against nanoGPT's published 1.88.
4. `--train-steps N` (default 0: skipped): nanoGPT's CPU recipe replicated in PyTorch: `torch.manual_seed(1337)`,
   nanoGPT's init, `torch.randint` batches and `estimate_loss` (20 random batches per split every 250 steps, from
   the same RNG stream, in nanoGPT's order), lr 1e-3 with warmup 100 (`lr * (it + 1) / (warmup + 1)`) and cosine to
   1e-4 at N. The final weights are then scored with several estimators: nanoGPT's own printed one, jaxamp's
   (mean over 50 fixed batches, `eval_batches(val, 12, 64, 50, seed=1337)`), the whole validation split in
   non-overlapping windows, and the spread of nanoGPT's 20-random-batch estimator over many independent draws. The
   jaxamp reference run's final checkpoint (when present) gets the same estimators.

Without PyTorch (`import torch` fails) the PyTorch rows say "PyTorch not installed" and the rest still runs.
PyTorch is not a jaxamp dependency; install a CPU build by hand to get the side-by-side figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.nanogpt_torch import (  # noqa: E402
    NO_TORCH,
    jaxamp_lr_kwargs,
    load_jaxamp_params,
    make_optimizer,
    nanogpt_lr,
    set_threads,
    to_torch,
    torch,
    torch_model,
    torch_step,
    torch_versions,
    torch_windows,
    train_torch,
)
from jaxamp.lm.config import ConfigError, TrainConfig  # noqa: E402
from jaxamp.lm.data import DataError, batch_at, eval_batches  # noqa: E402
from jaxamp.lm.model import count_params  # noqa: E402
from jaxamp.lm.setup import build  # noqa: E402

REPO = harness.REPO
DEFAULT_DATA = harness.SHAKESPEARE
DEFAULT_OUT = harness.RESULTS / "nanogpt_compare.md"
DEFAULT_REFERENCE = REPO / "runs" / "reference2" / "fp32"
REFERENCE_TABLE = harness.RESULTS / "reference_run.md"
NANOGPT_VAL = 1.88  # nanoGPT README, shakespeare_char CPU recipe ("gets us a loss of only 1.88")
NANOGPT_WALL = "about 3 minutes (MacBook CPU, per nanoGPT's README)"
FULL_SIZE = (4, 4, 128, 64, 12)  # layers, heads, width, seq_len, batch_size of the reference run


# ---------------------------------------------------------------------------------------------------------------------
# Measurements


def check_equivalence(run, cfg: TrainConfig, steps: int) -> dict:
    """jaxamp's initial weights in the PyTorch copy; `steps` steps of both on the same batches; losses compared."""
    model = torch_model(run, cfg)
    load_jaxamp_params(model, run.state.params)
    model.train()
    optimizer = make_optimizer(model, cfg)
    state = harness.copy_tree(run.state)
    jax_losses, torch_losses = [], []
    for i in range(steps):
        batch = batch_at(run.dataset.train, seed=cfg.seed, step=i, batch_size=cfg.batch_size, seq_len=cfg.seq_len)
        state, metrics = run.step_fn(state, batch)
        jax_losses.append(float(metrics["loss"]))
        lr = nanogpt_lr(i, **jaxamp_lr_kwargs(cfg))
        torch_losses.append(torch_step(model, optimizer, *to_torch(batch), lr, cfg.grad_clip).item())
    other = torch_model(run, cfg)  # parameters after `steps` steps, compared leaf by leaf through the same mapping
    load_jaxamp_params(other, state.params)
    theirs = dict(other.named_parameters())
    param_diff = max(float((p.detach() - theirs[n].detach()).abs().max()) for n, p in model.named_parameters())
    return {"steps": steps, "jaxamp": jax_losses, "torch": torch_losses,
            "max_loss_diff": max(abs(a - b) for a, b in zip(jax_losses, torch_losses)), "max_param_diff": param_diff}


def time_throughput(run, cfg: TrainConfig, args) -> dict:
    """Interleaved rounds of `args.steps` steps per framework on the same batches; tokens/s per window.

    Args:
      run: `build(cfg)`'s run (its step_fn and dataset).
      cfg: the fp32 training config.
      args: `rounds`, `steps`, `warmup`, `pause` and `threads` (torch thread counts, one PyTorch row each).

    Returns:
      `{"tokens_per_step", "first_step_s": {name: s}, "per_round": {name: [tokens/s]}}`, names "jaxamp" and
      "torch@N"; with PyTorch also the PyTorch model's parameter counts.
    """
    tokens = cfg.batch_size * cfg.seq_len
    total = args.warmup + args.rounds * args.steps
    batches = [batch_at(run.dataset.train, seed=cfg.seed, step=i, batch_size=cfg.batch_size, seq_len=cfg.seq_len)
               for i in range(total)]
    state = {"s": harness.copy_tree(run.state)}

    def jax_window(idx):
        s, metrics = state["s"], None
        for i in idx:
            s, metrics = run.step_fn(s, batches[i])
        jax.block_until_ready((s, metrics))
        state["s"] = s

    frameworks, model = {"jaxamp": jax_window}, None
    if torch is not None:
        windows, model = torch_windows(run, cfg, batches, args.threads)
        frameworks.update(windows)
    first, seconds = harness.interleaved(frameworks, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                                         pause=args.pause, before=set_threads if torch is not None else None)
    result = {"tokens_per_step": tokens, "first_step_s": first,
              "per_round": {name: [args.steps * tokens / s for s in v] for name, v in seconds.items()}}
    if model is not None:
        result["torch_params"] = sum(p.numel() for p in model.parameters())
        result["torch_params_non_embedding"] = model.get_num_params()
    return result


def estimate(loss_of, tokens: np.ndarray, cfg: TrainConfig, *, groups: int) -> dict:
    """Validation loss of one set of weights under several estimators. `loss_of(x, y)` = mean loss of a batch."""
    b, t = cfg.batch_size, cfg.seq_len
    fixed = [loss_of(x, y) for x, y in eval_batches(tokens, batch_size=b, seq_len=t, num_batches=50, seed=cfg.seed)]
    n_win = (len(tokens) - 1) // t  # non-overlapping windows of t inputs + 1 target
    starts = np.arange(n_win) * t
    whole_sum = 0.0
    for a in range(0, n_win, b):
        idx = starts[a:a + b, None] + np.arange(t + 1)[None, :]
        w = tokens[idx].astype(np.int32)
        whole_sum += loss_of(w[:, :-1], w[:, 1:]) * len(idx)
    # nanoGPT's estimator: mean of 20 batches at uniform random offsets; `groups` independent draws of it.
    rng = np.random.default_rng([cfg.seed, 20])
    draws = []
    for _ in range(groups):
        losses = []
        for _ in range(20):
            off = rng.integers(0, len(tokens) - t, size=b)
            w = tokens[off[:, None] + np.arange(t + 1)[None, :]].astype(np.int32)
            losses.append(loss_of(w[:, :-1], w[:, 1:]))
        draws.append(float(np.mean(losses)))
    return {"fixed50": float(np.mean(fixed)), "whole": whole_sum / n_win, "windows": n_win, "draws": draws}


def reference_summary(path: Path) -> dict | None:
    """Our reference run's fp32 figures: RUN/summary.json, else the fp32 row of reference_run.md."""
    summary = path / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        return {"val_loss": s["val_loss"], "wall_s": s["wall_s"], "tokens_per_s": s["tokens_per_s"],
                "steps": s["steps"], "params": s.get("params"), "source": str(summary.relative_to(REPO))
                if summary.is_relative_to(REPO) else str(summary)}
    if REFERENCE_TABLE.exists():
        for line in REFERENCE_TABLE.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("|") and cells[0] == "fp32":
                return {"val_loss": float(cells[2]), "tokens_per_s": float(cells[6]), "wall_s": float(cells[7]),
                        "steps": 2000, "params": None, "source": str(REFERENCE_TABLE.relative_to(REPO))}
    return None


def reference_history(path: Path) -> dict[int, float]:
    """step -> val loss of the reference run's metrics.jsonl ({} without it)."""
    metrics = path / "metrics.jsonl"
    out = {}
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            r = json.loads(line)
            if "val_loss" in r:
                out[int(r["step"])] = float(r["val_loss"])
    return out


def reference_estimates(path: Path, run, cfg: TrainConfig, groups: int) -> dict | str:
    """The reference run's final weights (its newest checkpoint) under the same estimators, or why not."""
    ckpt_dir = path / "checkpoints"
    if not ckpt_dir.is_dir():
        return f"no checkpoint directory {ckpt_dir}"
    try:
        from jaxamp.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel

        with Checkpointer(ckpt_dir) as ckpt:
            state, saved = ckpt.restore(jax.eval_shape(lambda: run.state))
    except Exception as err:  # noqa: BLE001 - report, never fail the benchmark over it
        return f"could not restore {ckpt_dir}: {type(err).__name__}: {str(err)[:300]}"
    fields = ("layers", "heads", "width", "seq_len", "batch_size", "bias", "seed")
    if any(saved.get(k) not in (None, getattr(cfg, k)) for k in fields):  # reference2 saved "bias": null
        return f"{ckpt_dir} holds a different model/data config: " + ", ".join(f"{k}={saved.get(k)}" for k in fields)
    loss_of = lambda x, y: float(run.eval_fn(state, (x, y)))  # noqa: E731
    result = estimate(loss_of, run.dataset.val, cfg, groups=groups)
    result["step"] = int(state.step)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Report


def _fmt_spread(draws: list[float]) -> str:
    d = np.asarray(draws)
    return (f"{d.mean():.4f} ± {d.std(ddof=1):.4f} (min {d.min():.4f}, max {d.max():.4f}; "
            f"{int((d <= NANOGPT_VAL + 0.005).sum())}/{len(d)} draws <= 1.885)") if len(d) > 1 else f"{d.mean():.4f}"


def versions() -> str:
    """The versions line: harness.versions(), then torch's (or the "PyTorch not installed" note)."""
    return harness.versions() + ("; " if torch is None else ", ") + torch_versions()


def _header(args, res: dict) -> list[str]:
    cfg, started = res["cfg"], res["started"]
    return [
        "# nanoGPT comparison on CPU: jaxamp fp32 against nanoGPT's model in plain PyTorch",
        "",
        f"Generated by `benchmarks/nanogpt_compare.py` on {started:%Y-%m-%d %H:%M} (took "
        f"{time.time() - started.timestamp():.0f} s). Command: `{res['command']}`.",
        "",
        f"- Machine: {res['machine']}. **A shared 2-core box**: other jobs were running while this was measured "
        "(see the load averages), so absolute tokens/s move by tens of percent between runs; the interleaved "
        "ratio is the steadier figure. CPU only: nothing here says anything about GPU speed.",
        f"- Versions: {versions()}.",
        f"- Model: {cfg.layers} layer(s), {cfg.heads} heads, width {cfg.width}, seq {cfg.seq_len}, vocab "
        f"{res['vocab']}, bias={cfg.bias}, tied head, exact GELU, LayerNorm eps 1e-5, "
        f"causal attention, dropout {cfg.dropout}; AdamW lr {cfg.lr:g} betas ({cfg.beta1}, {cfg.beta2}), weight "
        f"decay {cfg.weight_decay} on 2-D params, grad clip {cfg.grad_clip}; batch {cfg.batch_size} x "
        f"{cfg.seq_len} = {res['thr']['tokens_per_step']} tokens/step; data `{args.data or 'stdlib corpus'}`.",
        "",
        "## Training throughput, fp32, same batches",
        "",
        f"{args.rounds} interleaved rounds of {args.steps} steps per framework after {args.warmup} warm-up "
        "step(s) (the first framework alternates between rounds); one process. jaxamp: "
        "`build(TrainConfig(precision=\"fp32\")).step_fn(state, batch)`, jitted, state donated, "
        "`block_until_ready` once per window. PyTorch: nanoGPT's step in eager mode (`--compile=False`): "
        "forward + loss, `backward()`, `clip_grad_norm_(1.0)`, `AdamW.step()`, `zero_grad(set_to_none=True)`. "
        "\"First step\": the first call, jaxamp's including tracing and the XLA compile.",
        "",
    ]


def _throughput_rows(args, res: dict) -> tuple[list[str], dict]:
    """The throughput table's framework rows, and the median tokens/s of each framework timed."""
    thr, n_params = res["thr"], res["n_params"]
    lines, med = [], {}
    labels = {"jaxamp": "jaxamp fp32 (jitted step_fn)"}
    labels.update({f"torch@{n}": f"PyTorch fp32 eager (nanoGPT copy), {n} thread{'s' if n > 1 else ''}"
                   + (" (os.cpu_count())" if n == os.cpu_count() else "") for n in args.threads})
    for name, label in labels.items():
        if name not in thr["per_round"]:
            lines.append(f"| {'PyTorch fp32 eager (nanoGPT copy)' if name.startswith('torch') else label} | "
                         f"{NO_TORCH} | | | | | |")
            if name.startswith("torch"):
                break
            continue
        v = thr["per_round"][name]
        med[name] = statistics.median(v)
        params = n_params if name == "jaxamp" else thr["torch_params"]
        lines.append(f"| {label} | {med[name]:.0f} | {min(v):.0f} | {max(v):.0f} | "
                     f"{1000 * thr['tokens_per_step'] / med[name]:.1f} | {thr['first_step_s'][name]:.2f} | "
                     f"{params:,} |")
    return lines, med


def _throughput_section(args, res: dict) -> list[str]:
    thr, n_params, eq = res["thr"], res["n_params"], res["eq"]
    rows, med = _throughput_rows(args, res)
    lines = [*harness.table(["framework", "median tokens/s", "min tokens/s", "max tokens/s", "median ms/step",
                             "first step (s)", "parameters"]), *rows]
    torch_names = [n for n in med if n.startswith("torch@")]
    for name in torch_names:
        paired = harness.paired_ratios(thr["per_round"][name], thr["per_round"]["jaxamp"])
        lines.append(f"| PyTorch ({name[6:]} thread{'s' if int(name[6:]) > 1 else ''}) / jaxamp | "
                     f"{med[name] / med['jaxamp']:.2f}x | {min(paired):.2f}x | {max(paired):.2f}x | | | |")
    lines.append("")
    if torch_names:
        same = "match" if thr["torch_params"] == n_params else "**DIFFER**"
        lines += ["The ratio row: ratio of the medians, then the range of the per-round paired ratios. Per-round "
                  "tokens/s: " + "; ".join(f"{n}: " + ", ".join(f"{x:.0f}" for x in v)
                                            for n, v in thr["per_round"].items()) + ".", "",
                  f"Parameter counts {same}: jaxamp {n_params:,}, PyTorch {thr['torch_params']:,} (both with the "
                  f"position embeddings; the tied head counted once). nanoGPT prints `get_num_params()`, which "
                  f"excludes the position embeddings: {thr['torch_params_non_embedding']:,} = "
                  f"\"{thr['torch_params_non_embedding'] / 1e6:.2f}M\"."]
    else:
        lines.append(f"{NO_TORCH}: `import torch` failed, so only jaxamp was timed (jaxamp: {n_params:,} parameters). "
                     "Install a CPU build of PyTorch in the venv (it is not a jaxamp dependency) for the side-by-side.")
    if eq is not None:
        lines += ["", f"Equivalence check: jaxamp's initial weights copied into the PyTorch model, then {eq['steps']} "
                  "training steps of each on the same batches with the same schedule. Losses jaxamp "
                  + ", ".join(f"{x:.6f}" for x in eq["jaxamp"]) + "; PyTorch "
                  + ", ".join(f"{x:.6f}" for x in eq["torch"])
                  + f"; max |difference| {eq['max_loss_diff']:.2e} (loss), {eq['max_param_diff']:.2e} (any "
                  "parameter after the last step)."]
    return lines


def _validation_section(args, res: dict) -> list[str]:
    ref, trained = res["ref"], res["trained"]
    lines = ["", "## Validation loss against nanoGPT's published CPU figure", "",
             *harness.table(["run", "val loss", "estimator", "steps", "wall time", "tokens/s"]),
             f"| nanoGPT README, shakespeare_char CPU recipe (PyTorch) | {NANOGPT_VAL:.2f} | nanoGPT `estimate_loss`: "
             f"mean of 20 random val batches (`--eval_iters=20`) | 2000 | {NANOGPT_WALL} | "
             f"~{2000 * 768 / 180:.0f} implied (if the 3 min are all training) |"]
    if ref is not None:
        gap = ref["val_loss"] - NANOGPT_VAL
        lines += [f"| jaxamp fp32 reference run (`{ref['source']}`) | {ref['val_loss']:.4f} | jaxamp: mean of 50 "
                  f"fixed val batches | {ref['steps']} | {ref['wall_s']:.0f} s (this shared box) | "
                  f"{ref['tokens_per_s']:.0f} |",
                  f"| difference (jaxamp - nanoGPT) | {gap:+.4f} ({100 * gap / NANOGPT_VAL:+.1f}%) | | | | |"]
    else:
        lines.append("| jaxamp fp32 reference run | not found (run `bash benchmarks/reference_run.sh`) | | | | |")
    if trained is not None:
        init_seed = '' if args.init_seed is None or args.init != 'jaxamp' else f' (seed {args.init_seed})'
        lines += [f"| PyTorch nanoGPT copy, this script (`--train-steps {args.train_steps}`, seed {args.train_seed}, "
                  f"{args.data_order} batches, {args.init} init{init_seed}, "
                  f"{res['thr']['torch_threads_after']} thread(s)) | "
                  f"{trained['history'][-1]['val']:.4f} | nanoGPT `estimate_loss` "
                  f"({args.eval_iters} random batches, its RNG stream) | {args.train_steps} | "
                  f"{trained['wall_s']:.0f} s (incl. evals) | {trained['tokens_per_s']:.0f} |",
                  f"| PyTorch nanoGPT copy, same weights | {trained['final']['fixed50']:.4f} | jaxamp: mean of 50 "
                  f"fixed val batches | {args.train_steps} | | |"]
    elif torch is not None:
        lines.append("| PyTorch nanoGPT copy | not run (`--train-steps 0`) | | | | |")
    else:
        lines.append(f"| PyTorch nanoGPT copy | {NO_TORCH} | | | | |")
    return lines


def _estimators_section(args, res: dict) -> list[str]:
    ref_est, trained = res["ref_est"], res["trained"]
    lines = []
    if trained is not None or isinstance(ref_est, dict):
        lines += ["", "### Final weights under several estimators", "",
                  f"Every estimator on the validation split (last 10% of the text). \"20 random batches\" is "
                  f"nanoGPT's estimator, drawn {args.estimator_draws} independent times (uniform offsets, numpy RNG): "
                  "mean ± standard deviation of one such estimate, and its extremes.", "",
                  *harness.table(["weights", "50 fixed batches (jaxamp)", "whole split, non-overlapping windows",
                                  "nanoGPT's printed estimate", "20 random batches, over many draws"])]
        if isinstance(ref_est, dict):
            lines.append(f"| jaxamp fp32 reference run, step {ref_est['step']} | {ref_est['fixed50']:.4f} | "
                         f"{ref_est['whole']:.4f} ({ref_est['windows']} windows) | n/a | "
                         f"{_fmt_spread(ref_est['draws'])} |")
        if trained is not None:
            f = trained["final"]
            lines.append(f"| PyTorch nanoGPT copy, step {args.train_steps} | {f['fixed50']:.4f} | {f['whole']:.4f} "
                         f"({f['windows']} windows) | {trained['history'][-1]['val']:.4f} | "
                         f"{_fmt_spread(f['draws'])} |")
    if isinstance(ref_est, str):
        lines += ["", f"Reference checkpoint not scored: {ref_est}."]
    if trained is not None:
        lines += ["", "### Validation loss during training", "",
                  *harness.table(["step", "jaxamp reference (50 fixed batches)", "PyTorch copy (50 fixed batches)",
                                  "PyTorch copy (nanoGPT estimate)", "PyTorch copy, train (nanoGPT estimate)"])]
        for h in trained["history"]:
            jv = res["ref_hist"].get(h["step"])
            lines.append(f"| {h['step']} | {'' if jv is None else f'{jv:.4f}'} | {h['val_fixed50']:.4f} | "
                         f"{h['val']:.4f} | {h['train']:.4f} |")
    return lines


NOTES = [
    "- The PyTorch model is a compacted copy of nanoGPT's `model.py` (same modules in the same construction "
    "order, so `torch.manual_seed(1337)` gives nanoGPT's initial weights; same init, weight tying, "
    "optimizer groups), and the training loop follows `train.py` (first batch fetched before the loop, "
    "evaluation before the step at multiples of 250, next batch fetched between forward and backward). On "
    "CPU nanoGPT's `dtype` resolves to float16 but its autocast context is a `nullcontext` and its "
    "`GradScaler` disables itself without CUDA, so it trains in float32 as here.",
    "- PyTorch's multi-threaded figure depends on the box's load more than anything else here: its OpenMP "
    "workers spin-wait at every parallel region, and when other jobs hold a core the step waits for a "
    "descheduled worker. On this box, with a load average around 5, 2 threads ran 10-20x slower than 1 "
    "thread in some runs and faster in others; `OMP_WAIT_POLICY=PASSIVE` removes the collapse. The "
    "1-thread row is the stable one; `--train-steps` uses `--train-threads` (default 1).",
    "- Throughput: PyTorch eager runs one op at a time through its CPU kernels (oneDNN/MKL matmuls); "
    "jaxamp's step is one XLA:CPU executable (fused elementwise ops, Eigen matmuls). Neither side was "
    "tuned for CPU.",
]


def report(args, res: dict) -> str:
    """The markdown report of `main`'s measurements `res`."""
    scored = res["trained"] is not None or isinstance(res["ref_est"], dict)
    lines = [*_header(args, res), *_throughput_section(args, res), *_validation_section(args, res),
             *_estimators_section(args, res), "", "## Notes", "",
             "- nanoGPT's 1.88 is one estimate from 20 random batches (15,360 tokens) of one seed; ours is the mean "
             "over 50 fixed batches (38,400 tokens)."
             + (" The estimator table above says how far apart single estimates of the same weights fall."
                if scored else ""), *NOTES]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    """The comparison's flags, checked (one-line usage errors)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default=str(DEFAULT_DATA) if DEFAULT_DATA.exists() else None,
                   help="UTF-8 text (default ../shared/data/tinyshakespeare.txt; the stdlib corpus if it is missing)")
    harness.add_model_flags(p)
    harness.add_timing_flags(p, rounds=5, steps=50, warmup=5, pause=0.5)  # a variant is a framework
    p.add_argument("--check-steps", type=int, default=3, help="steps of the equivalence check (0 = skip)")
    p.add_argument("--threads", type=harness.thread_counts, default=harness.thread_counts(f"{os.cpu_count()},1"),
                   help="comma-separated torch.set_num_threads values, one PyTorch row each (default: all cores,1)")
    p.add_argument("--train-steps", type=int, default=0, help="train the PyTorch copy this many steps (0 = skip)")
    p.add_argument("--train-threads", type=int, default=1,
                   help="torch threads for --train-steps and the equivalence check (default 1: on a loaded shared "
                        "box several OpenMP threads can run 10-20x slower, see the notes)")
    p.add_argument("--train-seed", type=int, default=1337, help="torch.manual_seed for --train-steps")
    p.add_argument("--data-order", choices=("nanogpt", "jaxamp"), default="nanogpt",
                   help="--train-steps batches: nanoGPT's torch.randint stream, or jaxamp's batch_at(seed 1337)")
    p.add_argument("--init", choices=("torch", "jaxamp"), default="torch",
                   help="--train-steps initial weights: nanoGPT's (torch RNG) or jaxamp's initial state")
    p.add_argument("--init-seed", type=int, default=None,
                   help="with --init jaxamp: jaxamp's initial weights for this seed (default: the run seed, 1337)")
    p.add_argument("--eval-interval", type=int, default=250, help="nanoGPT's eval_interval for --train-steps")
    p.add_argument("--eval-iters", type=int, default=20, help="nanoGPT's eval_iters (the CPU recipe's 20)")
    p.add_argument("--estimator-draws", type=int, default=50,
                   help="independent 20-random-batch estimates of the final weights")
    p.add_argument("--reference", default=str(DEFAULT_REFERENCE),
                   help="our reference run's workdir (summary.json, metrics.jsonl, checkpoints)")
    p.add_argument("--no-reference-checkpoint", action="store_true",
                   help="do not score the reference run's final checkpoint")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="markdown report (also printed)")
    args = p.parse_args(argv)
    harness.check_sizes(p, args, ("layers", "heads", "width", "seq_len", "batch_size", "rounds", "steps", "warmup",
                                  "train_threads", "eval_interval", "eval_iters", "estimator_draws"),
                        ("train_steps", "check_steps", "pause"))
    harness.check_file(p, "--data", args.data)
    harness.check_output(p, "--out", args.out)
    return args


def _brief(estimates: dict) -> str:
    return json.dumps({k: v for k, v in estimates.items() if k != "draws"})


def _equivalence(run, cfg: TrainConfig, args, res: dict) -> None:
    """The equivalence check (PyTorch's threads set to `--train-threads` from here on: speed only)."""
    torch.set_num_threads(args.train_threads)
    res["thr"]["torch_threads_after"] = args.train_threads
    if args.check_steps:
        eq = res["eq"] = check_equivalence(run, cfg, args.check_steps)
        harness.log(f"equivalence: max |loss diff| {eq['max_loss_diff']:.2e}, max |param diff| "
                    f"{eq['max_param_diff']:.2e}")


def _train(run, cfg: TrainConfig, args, res: dict) -> None:
    """`--train-steps`: nanoGPT's recipe in PyTorch, its final weights under the estimators."""
    trained = res["trained"] = train_torch(run, cfg, args, harness.log)
    trained["final"] = estimate(trained.pop("loss_of"), run.dataset.val, cfg, groups=args.estimator_draws)
    harness.log(f"torch training: {trained['wall_s']:.0f} s, final {_brief(trained['final'])}")


def _reference_parts(run, cfg: TrainConfig, args, res: dict) -> None:
    """Our reference run's figures, and its final checkpoint under the estimators (at the reference size)."""
    ref_dir = Path(args.reference)
    res.update(ref=reference_summary(ref_dir), ref_hist=reference_history(ref_dir), ref_est=None)
    full_size = (cfg.layers, cfg.heads, cfg.width, cfg.seq_len, cfg.batch_size) == FULL_SIZE
    if not args.no_reference_checkpoint and full_size and (args.train_steps > 0 or (ref_dir / "checkpoints").is_dir()):
        ref_est = res["ref_est"] = reference_estimates(ref_dir, run, cfg, args.estimator_draws)
        harness.log(f"reference checkpoint: {ref_est if isinstance(ref_est, str) else _brief(ref_est)}")


def main(argv=None) -> int:
    args = parse_args(argv)
    res = {"started": datetime.datetime.now(), "command": harness.command_line(__file__, argv),
           "machine": harness.machine(), "eq": None, "trained": None}
    cfg = res["cfg"] = TrainConfig(data=args.data, precision="fp32", layers=args.layers, heads=args.heads,
                                   width=args.width, seq_len=args.seq_len, batch_size=args.batch_size,
                                   steps=max(args.train_steps, 2000), progress=False)
    try:
        run = build(cfg)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    res.update(n_params=count_params(run.state.params), vocab=run.dataset.vocab_size)
    harness.log(f"jaxamp: {res['n_params']:,} parameters; torch: {'n/a' if torch is None else torch.__version__}")
    thr = res["thr"] = time_throughput(run, cfg, args)  # first: its first jaxamp step includes the compile
    harness.log("tokens/s per round: " + json.dumps({k: [round(x) for x in v] for k, v in thr["per_round"].items()}))
    if torch is not None:
        _equivalence(run, cfg, args, res)
    _reference_parts(run, cfg, args, res)
    if torch is not None and args.train_steps > 0:
        _train(run, cfg, args, res)
    harness.write_report(args.out, report(args, res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
