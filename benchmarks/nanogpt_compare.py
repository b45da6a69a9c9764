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
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxamp.lm.cli import check_output, check_sizes  # noqa: E402
from jaxamp.lm.config import ConfigError, TrainConfig  # noqa: E402
from jaxamp.lm.data import DataError, batch_at, eval_batches  # noqa: E402
from jaxamp.lm.model import count_params  # noqa: E402
from jaxamp.lm.setup import build

try:  # optional: PyTorch is not a jaxamp dependency
    import torch
    import torch.nn as nn
    from torch.nn import functional as F
except ImportError:  # pragma: no cover - depends on the environment
    torch = None

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "nanogpt_compare.md"
DEFAULT_REFERENCE = REPO / "runs" / "reference2" / "fp32"
REFERENCE_TABLE = REPO / "benchmarks" / "results" / "reference_run.md"
NO_TORCH = "PyTorch not installed"
NANOGPT_VAL = 1.88  # nanoGPT README, shakespeare_char CPU recipe ("gets us a loss of only 1.88")
NANOGPT_WALL = "about 3 minutes (MacBook CPU, per nanoGPT's README)"
SEED = 1337  # nanoGPT's torch.manual_seed(1337 + seed_offset) and jaxamp's default seed

# ---------------------------------------------------------------------------------------------------------------------
# nanoGPT's model.py, compacted (https://github.com/karpathy/nanoGPT): same modules, construction order (so the same
# torch RNG consumption), initialisation, weight tying, optimizer groups. Only flash attention (SDPA) is kept.

if torch is not None:

    class LayerNorm(nn.Module):
        """LayerNorm with an optional bias (PyTorch's nn.LayerNorm has no bias=False before 2.1)."""

        def __init__(self, ndim, bias):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(ndim))
            self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

        def forward(self, input):
            return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)

    class CausalSelfAttention(nn.Module):
        def __init__(self, config):
            super().__init__()
            assert config.n_embd % config.n_head == 0
            self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
            self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
            self.attn_dropout = nn.Dropout(config.dropout)
            self.resid_dropout = nn.Dropout(config.dropout)
            self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
            q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                               dropout_p=self.dropout if self.training else 0, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.resid_dropout(self.c_proj(y))

    class MLP(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
            self.gelu = nn.GELU()  # exact (erf)
            self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
            self.dropout = nn.Dropout(config.dropout)

        def forward(self, x):
            return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

    class Block(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
            self.attn = CausalSelfAttention(config)
            self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
            self.mlp = MLP(config)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            ))
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            self.transformer.wte.weight = self.lm_head.weight  # weight tying
            self.apply(self._init_weights)
            for pn, p in self.named_parameters():  # scaled init of the residual projections (GPT-2)
                if pn.endswith("c_proj.weight"):
                    torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

        def get_num_params(self, non_embedding=True):
            n_params = sum(p.numel() for p in self.parameters())  # parameters() yields the tied matrix once
            if non_embedding:
                n_params -= self.transformer.wpe.weight.numel()
            return n_params

        def _init_weights(self, module):
            if isinstance(module, nn.Linear):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

        def forward(self, idx, targets=None):
            b, t = idx.size()
            pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
            x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
            for block in self.transformer.h:
                x = block(x)
            x = self.transformer.ln_f(x)
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            return logits, loss

        def configure_optimizers(self, weight_decay, learning_rate, betas):
            params = [p for p in self.parameters() if p.requires_grad]
            groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
            return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)  # CPU: no fused=True (nanoGPT: cuda only)


class GPTConfig:
    """nanoGPT's GPTConfig fields."""

    def __init__(self, *, block_size, vocab_size, n_layer, n_head, n_embd, dropout=0.0, bias=False):
        self.block_size, self.vocab_size, self.n_layer, self.n_head, self.n_embd = (
            block_size, vocab_size, n_layer, n_head, n_embd)
        self.dropout, self.bias = dropout, bias


def nanogpt_lr(it: int, *, lr: float, min_lr: float, warmup: int, decay_iters: int) -> float:
    """nanoGPT train.py's get_lr."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


# ---------------------------------------------------------------------------------------------------------------------
# jaxamp <-> PyTorch glue


def torch_model(run, cfg: TrainConfig):
    """The nanoGPT copy with jaxamp's sizes (built under the current torch RNG state)."""
    return GPT(GPTConfig(block_size=cfg.seq_len, vocab_size=run.dataset.vocab_size, n_layer=cfg.layers,
                         n_head=cfg.heads, n_embd=cfg.width, dropout=cfg.dropout, bias=cfg.bias))


def load_jaxamp_params(model, params) -> None:
    """Copies a jaxamp parameter tree into the nanoGPT copy (Dense kernels [in, out] -> Linear weights [out, in])."""
    host = jax.tree.map(np.asarray, jax.device_get(params))
    target = dict(model.named_parameters())
    done = set()

    def put(name, value):
        t = target[name]
        value = np.array(value, dtype=np.float32, order="C")  # a writable copy
        assert tuple(t.shape) == value.shape, (name, tuple(t.shape), value.shape)
        with torch.no_grad():
            t.copy_(torch.from_numpy(value))
        done.add(name)

    put("transformer.wte.weight", host["wte"]["embedding"])
    put("transformer.wpe.weight", host["wpe"]["embedding"])
    for i in range(model.config.n_layer):
        h = host[f"h_{i}"]
        for ln in ("ln_1", "ln_2"):
            put(f"transformer.h.{i}.{ln}.weight", h[ln]["scale"])
            if "bias" in h[ln]:
                put(f"transformer.h.{i}.{ln}.bias", h[ln]["bias"])
        for mod, lin in (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj")):
            put(f"transformer.h.{i}.{mod}.{lin}.weight", h[mod][lin]["kernel"].T)
            if "bias" in h[mod][lin]:
                put(f"transformer.h.{i}.{mod}.{lin}.bias", h[mod][lin]["bias"])
    put("transformer.ln_f.weight", host["ln_f"]["scale"])
    if "bias" in host["ln_f"]:
        put("transformer.ln_f.bias", host["ln_f"]["bias"])
    missing = set(target) - done - {"lm_head.weight"}  # lm_head is wte (tied; named_parameters lists it once)
    assert not missing, f"not copied from jaxamp: {sorted(missing)}"


def _copy(tree):
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


def torch_step(model, optimizer, x, y, lr: float, grad_clip: float):
    """One nanoGPT train.py iteration (gradient_accumulation_steps=1, fp32 on CPU: no autocast, no GradScaler)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    _, loss = model(x, y)
    loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def jaxamp_lr_kwargs(cfg: TrainConfig) -> dict:
    return dict(lr=cfg.lr, min_lr=cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr, warmup=cfg.warmup_steps,
                decay_iters=cfg.steps if cfg.decay_steps is None else cfg.decay_steps)


def make_optimizer(model, cfg: TrainConfig):
    return model.configure_optimizers(cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2))


def to_torch(batch):
    x, y = batch
    return torch.from_numpy(np.asarray(x, np.int64)), torch.from_numpy(np.asarray(y, np.int64))


# ---------------------------------------------------------------------------------------------------------------------
# Measurements


def check_equivalence(run, cfg: TrainConfig, steps: int) -> dict:
    """jaxamp's initial weights in the PyTorch copy; `steps` steps of both on the same batches; losses compared."""
    model = torch_model(run, cfg)
    load_jaxamp_params(model, run.state.params)
    model.train()
    optimizer = make_optimizer(model, cfg)
    state = _copy(run.state)
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


def interleaved(windows: dict, *, rounds: int, steps: int, warmup: int, pause: float,
                before=None) -> tuple[dict, dict]:
    """Times several step functions in one process, round-robin, so drifts in the machine's load hit them alike.

    Each `windows[name](idx)` runs the steps whose indices are in `idx` and returns once they are done (it blocks).
    First every window runs step 0 alone (timed: the first call, compile included) and steps 1..warmup-1 untimed;
    then `rounds` rounds time one window of `steps` steps per name, the first name rotating from round to round.

    Args:
      windows: name -> callable(range) running those steps.
      rounds, steps, warmup: timed rounds, steps per timed window, untimed warm-up steps (the first call included).
      pause: seconds idle before each timed window (worker threads of the previous one go quiet).
      before: optional callable(name) run before each of that name's windows, outside the timing.

    Returns:
      `(first_call_s, per_round_s)`: seconds of each name's first call, and its seconds per timed window by round.
    """
    first = {}
    for name, window in windows.items():
        if before is not None:
            before(name)
        t0 = time.perf_counter()
        window(range(0, 1))
        first[name] = time.perf_counter() - t0
        if warmup > 1:
            window(range(1, warmup))
    names = list(windows)
    per_round = {name: [] for name in names}
    for r in range(rounds):
        idx = range(warmup + r * steps, warmup + (r + 1) * steps)
        for name in names[r % len(names):] + names[:r % len(names)]:
            if before is not None:
                before(name)
            time.sleep(pause)  # let the other framework's worker threads go idle (OpenMP/Eigen spin-waits)
            t0 = time.perf_counter()
            windows[name](idx)
            per_round[name].append(time.perf_counter() - t0)
    return first, per_round


def time_throughput(run, cfg: TrainConfig, args) -> dict:
    """Interleaved rounds of `args.steps` steps per framework on the same batches; tokens/s per window."""
    tokens = cfg.batch_size * cfg.seq_len
    total = args.warmup + args.rounds * args.steps
    batches = [batch_at(run.dataset.train, seed=cfg.seed, step=i, batch_size=cfg.batch_size, seq_len=cfg.seq_len)
               for i in range(total)]
    frameworks = {}

    state = {"s": _copy(run.state)}

    def jax_window(idx):
        s = state["s"]
        metrics = None
        for i in idx:
            s, metrics = run.step_fn(s, batches[i])
        jax.block_until_ready((s, metrics))
        state["s"] = s

    frameworks["jaxamp"] = jax_window
    if torch is not None:
        torch_batches = [to_torch(b) for b in batches]
        lr_kwargs = jaxamp_lr_kwargs(cfg)

        def make_torch_window():
            torch.manual_seed(SEED)
            model = torch_model(run, cfg)  # one model and optimizer per thread count
            model.train()
            optimizer = make_optimizer(model, cfg)

            def torch_window(idx):  # the caller sets torch.set_num_threads first, outside the timing
                for i in idx:
                    torch_step(model, optimizer, *torch_batches[i], nanogpt_lr(i, **lr_kwargs), cfg.grad_clip)

            return model, torch_window

        for threads in args.threads:
            model, frameworks[f"torch@{threads}"] = make_torch_window()

    def set_threads(name):
        if name.startswith("torch@"):
            torch.set_num_threads(int(name[6:]))

    first, seconds = interleaved(frameworks, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                                 pause=args.pause, before=set_threads)
    per_round = {name: [args.steps * tokens / s for s in v] for name, v in seconds.items()}
    result = {"tokens_per_step": tokens, "first_step_s": first, "per_round": per_round}
    if torch is not None:
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


def torch_loss_of(model):
    def loss_of(x, y):
        model.eval()
        with torch.no_grad():
            _, loss = model(*to_torch((x, y)))
        model.train()
        return float(loss)

    return loss_of


def train_torch(run, cfg: TrainConfig, args, log) -> dict:
    """nanoGPT's train.py CPU recipe in PyTorch, in nanoGPT's own order of RNG use (or jaxamp's batches)."""
    train, val = run.dataset.train, run.dataset.val
    b, t = cfg.batch_size, cfg.seq_len
    torch.manual_seed(args.train_seed)
    model = torch_model(run, cfg)
    if args.init == "jaxamp":  # jaxamp's initial weights for seed --init-seed (build()'s key derivation)
        params = run.state.params
        if args.init_seed is not None and args.init_seed != cfg.seed:
            init_key, _ = jax.random.split(jax.random.PRNGKey(args.init_seed))
            params = run.model.init(init_key, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
        load_jaxamp_params(model, params)
    model.train()
    optimizer = make_optimizer(model, cfg)
    lr_kwargs = dict(lr=cfg.lr, min_lr=cfg.lr / 10, warmup=cfg.warmup_steps, decay_iters=args.train_steps)

    def get_batch(split):  # nanoGPT: torch.randint offsets, int64 windows
        data = train if split == "train" else val
        ix = torch.randint(len(data) - t, (b,))
        x = torch.stack([torch.from_numpy(data[i:i + t].astype(np.int64)) for i in ix.tolist()])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + t].astype(np.int64)) for i in ix.tolist()])
        return x, y

    @torch.no_grad()
    def estimate_loss():  # nanoGPT's estimate_loss, eval_iters batches per split from the global RNG
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                x, y = get_batch(split)
                _, loss = model(x, y)
                losses[k] = loss.item()
            out[split] = float(losses.mean())
        model.train()
        return out

    fixed_val = eval_batches(val, batch_size=b, seq_len=t, num_batches=50, seed=cfg.seed)
    loss_of = torch_loss_of(model)

    def next_batch(it):
        if args.data_order == "jaxamp":
            return to_torch(batch_at(train, seed=cfg.seed, step=it, batch_size=b, seq_len=t))
        return get_batch("train")

    history = []
    x, y = next_batch(0)  # nanoGPT fetches the very first batch before the loop
    t_start = time.perf_counter()
    train_time = 0.0
    it = 0
    while True:
        lr = nanogpt_lr(it, **lr_kwargs)
        if it % args.eval_interval == 0 or it == args.train_steps:
            losses = estimate_loss()
            ours = float(np.mean([loss_of(xv, yv) for xv, yv in fixed_val]))
            history.append({"step": it, "train": losses["train"], "val": losses["val"], "val_fixed50": ours})
            log(f"torch step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f} "
                f"(nanoGPT estimate, {args.eval_iters} random batches); val loss {ours:.4f} (50 fixed batches)")
        if it == args.train_steps:
            break  # nanoGPT runs one more step after its last evaluation; no reported figure depends on it
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr
        _, loss = model(x, y)
        x, y = next_batch(it + 1)  # nanoGPT prefetches the next batch between forward and backward
        loss.backward()
        if cfg.grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_time += time.perf_counter() - t0
        it += 1
    wall = time.perf_counter() - t_start
    final = estimate(loss_of, val, cfg, groups=args.estimator_draws)
    return {"history": history, "final": final, "wall_s": wall, "train_s": train_time,
            "tokens_per_s": args.train_steps * b * t / max(train_time, 1e-9)}


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


def _machine() -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip() + ", "
                break
    except OSError:
        pass
    return f"{platform.platform()} ({platform.machine()}), {cpu}os.cpu_count()={os.cpu_count()}; load average {load}"


def _versions() -> str:
    import flax  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel

    text = (f"python {platform.python_version()}, jax {jax.__version__} ({jax.default_backend()}), "
            f"flax {flax.__version__}, optax {optax.__version__}, numpy {np.__version__}")
    if torch is None:
        return text + f"; {NO_TORCH}"
    omp = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME") if k in os.environ}
    return (text + f", torch {torch.__version__} (eager, ATen parallel backend OpenMP, "
            f"mkldnn={torch.backends.mkldnn.is_available()}, OpenMP environment: {omp or 'defaults'})")


def _fmt_spread(draws: list[float]) -> str:
    d = np.asarray(draws)
    return (f"{d.mean():.4f} ± {d.std(ddof=1):.4f} (min {d.min():.4f}, max {d.max():.4f}; "
            f"{int((d <= NANOGPT_VAL + 0.005).sum())}/{len(d)} draws <= 1.885)") if len(d) > 1 else f"{d.mean():.4f}"


def report(args, cfg, run, n_params, thr, eq, ref, ref_hist, ref_est, trained, command, started) -> str:
    L = []
    L.append("# nanoGPT comparison on CPU: jaxamp fp32 against nanoGPT's model in plain PyTorch")
    L.append("")
    L.append(f"Generated by `benchmarks/nanogpt_compare.py` on {started:%Y-%m-%d %H:%M} (took "
             f"{time.time() - started.timestamp():.0f} s). Command: `{command}`.")
    L.append("")
    L.append(f"- Machine: {_machine()}. **A shared 2-core box**: other jobs were running while this was measured "
             "(see the load averages), so absolute tokens/s move by tens of percent between runs; the interleaved "
             "ratio is the steadier figure. CPU only: nothing here says anything about GPU speed.")
    L.append(f"- Versions: {_versions()}.")
    L.append(f"- Model: {cfg.layers} layer(s), {cfg.heads} heads, width {cfg.width}, seq {cfg.seq_len}, vocab "
             f"{run.dataset.vocab_size}, bias={cfg.bias}, tied head, exact GELU, LayerNorm eps 1e-5, "
             f"causal attention, dropout {cfg.dropout}; AdamW lr {cfg.lr:g} betas ({cfg.beta1}, {cfg.beta2}), weight "
             f"decay {cfg.weight_decay} on 2-D params, grad clip {cfg.grad_clip}; batch {cfg.batch_size} x "
             f"{cfg.seq_len} = {thr['tokens_per_step']} tokens/step; data `{args.data or 'stdlib corpus'}`.")
    L.append("")
    L.append("## Training throughput, fp32, same batches")
    L.append("")
    L.append(f"{args.rounds} interleaved rounds of {args.steps} steps per framework after {args.warmup} warm-up "
             "step(s) (the first framework alternates between rounds); one process. jaxamp: "
             "`build(TrainConfig(precision=\"fp32\")).step_fn(state, batch)`, jitted, state donated, "
             "`block_until_ready` once per window. PyTorch: nanoGPT's step in eager mode (`--compile=False`): "
             "forward + loss, `backward()`, `clip_grad_norm_(1.0)`, `AdamW.step()`, `zero_grad(set_to_none=True)`. "
             "\"First step\": the first call, jaxamp's including tracing and the XLA compile.")
    L.append("")
    L.append("| framework | median tokens/s | min tokens/s | max tokens/s | median ms/step | first step (s) | "
             "parameters |")
    L.append("| --- | --- | --- | --- | --- | --- | --- |")
    med = {}
    labels = {"jaxamp": "jaxamp fp32 (jitted step_fn)"}
    labels.update({f"torch@{n}": f"PyTorch fp32 eager (nanoGPT copy), {n} thread{'s' if n > 1 else ''}"
                   + (" (os.cpu_count())" if n == os.cpu_count() else "") for n in args.threads})
    for name, label in labels.items():
        if name not in thr["per_round"]:
            L.append(f"| {'PyTorch fp32 eager (nanoGPT copy)' if name.startswith('torch') else label} | {NO_TORCH} "
                     "| | | | | |")
            if name.startswith("torch"):
                break
            continue
        v = thr["per_round"][name]
        med[name] = statistics.median(v)
        params = n_params if name == "jaxamp" else thr["torch_params"]
        L.append(f"| {label} | {med[name]:.0f} | {min(v):.0f} | {max(v):.0f} | "
                 f"{1000 * thr['tokens_per_step'] / med[name]:.1f} | {thr['first_step_s'][name]:.2f} | {params:,} |")
    torch_names = [n for n in med if n.startswith("torch@")]
    for name in torch_names:
        paired = [t / j for t, j in zip(thr["per_round"][name], thr["per_round"]["jaxamp"])]
        L.append(f"| PyTorch ({name[6:]} thread{'s' if int(name[6:]) > 1 else ''}) / jaxamp | "
                 f"{med[name] / med['jaxamp']:.2f}x | {min(paired):.2f}x | {max(paired):.2f}x | | | |")
    if torch_names:
        L.append("")
        L.append("The ratio row: ratio of the medians, then the range of the per-round paired ratios. Per-round "
                 "tokens/s: " + "; ".join(f"{n}: " + ", ".join(f"{x:.0f}" for x in v)
                                           for n, v in thr["per_round"].items()) + ".")
        L.append("")
        same = "match" if thr["torch_params"] == n_params else "**DIFFER**"
        L.append(f"Parameter counts {same}: jaxamp {n_params:,}, PyTorch {thr['torch_params']:,} (both with the "
                 f"position embeddings; the tied head counted once). nanoGPT prints `get_num_params()`, which "
                 f"excludes the position embeddings: {thr['torch_params_non_embedding']:,} = "
                 f"\"{thr['torch_params_non_embedding'] / 1e6:.2f}M\".")
    else:
        L.append("")
        L.append(f"{NO_TORCH}: `import torch` failed, so only jaxamp was timed (jaxamp: {n_params:,} parameters). "
                 "Install a CPU build of PyTorch in the venv (it is not a jaxamp dependency) for the side-by-side.")
    if eq is not None:
        L.append("")
        L.append(f"Equivalence check: jaxamp's initial weights copied into the PyTorch model, then {eq['steps']} "
                 "training steps of each on the same batches with the same schedule. Losses jaxamp "
                 + ", ".join(f"{x:.6f}" for x in eq["jaxamp"]) + "; PyTorch "
                 + ", ".join(f"{x:.6f}" for x in eq["torch"])
                 + f"; max |difference| {eq['max_loss_diff']:.2e} (loss), {eq['max_param_diff']:.2e} (any parameter "
                 "after the last step).")
    L.append("")
    L.append("## Validation loss against nanoGPT's published CPU figure")
    L.append("")
    L.append("| run | val loss | estimator | steps | wall time | tokens/s |")
    L.append("| --- | --- | --- | --- | --- | --- |")
    L.append(f"| nanoGPT README, shakespeare_char CPU recipe (PyTorch) | {NANOGPT_VAL:.2f} | nanoGPT `estimate_loss`: "
             f"mean of 20 random val batches (`--eval_iters=20`) | 2000 | {NANOGPT_WALL} | "
             f"~{2000 * 768 / 180:.0f} implied (if the 3 min are all training) |")
    if ref is not None:
        gap = ref["val_loss"] - NANOGPT_VAL
        L.append(f"| jaxamp fp32 reference run (`{ref['source']}`) | {ref['val_loss']:.4f} | jaxamp: mean of 50 fixed "
                 f"val batches | {ref['steps']} | {ref['wall_s']:.0f} s (this shared box) | "
                 f"{ref['tokens_per_s']:.0f} |")
        L.append(f"| difference (jaxamp - nanoGPT) | {gap:+.4f} ({100 * gap / NANOGPT_VAL:+.1f}%) | | | | |")
    else:
        L.append("| jaxamp fp32 reference run | not found (run `bash benchmarks/reference_run.sh`) | | | | |")
    if trained is not None:
        f = trained["final"]
        hist_last = trained["history"][-1]
        L.append(f"| PyTorch nanoGPT copy, this script (`--train-steps {args.train_steps}`, seed {args.train_seed}, "
                 f"{args.data_order} batches, {args.init} init"
                 f"{'' if args.init_seed is None or args.init != 'jaxamp' else f' (seed {args.init_seed})'}, "
                 f"{thr['torch_threads_after']} thread(s)) | "
                 f"{hist_last['val']:.4f} | nanoGPT `estimate_loss` "
                 f"({args.eval_iters} random batches, its RNG stream) | {args.train_steps} | "
                 f"{trained['wall_s']:.0f} s (incl. evals) | {trained['tokens_per_s']:.0f} |")
        L.append(f"| PyTorch nanoGPT copy, same weights | {f['fixed50']:.4f} | jaxamp: mean of 50 fixed val batches | "
                 f"{args.train_steps} | | |")
    elif torch is not None:
        L.append("| PyTorch nanoGPT copy | not run (`--train-steps 0`) | | | | |")
    else:
        L.append(f"| PyTorch nanoGPT copy | {NO_TORCH} | | | | |")
    if trained is not None or isinstance(ref_est, dict):
        L.append("")
        L.append("### Final weights under several estimators")
        L.append("")
        L.append(f"Every estimator on the validation split (last 10% of the text). \"20 random batches\" is nanoGPT's "
                 f"estimator, drawn {args.estimator_draws} independent times (uniform offsets, numpy RNG): mean ± "
                 "standard deviation of one such estimate, and its extremes.")
        L.append("")
        L.append("| weights | 50 fixed batches (jaxamp) | whole split, non-overlapping windows | nanoGPT's printed "
                 "estimate | 20 random batches, over many draws |")
        L.append("| --- | --- | --- | --- | --- |")
        if isinstance(ref_est, dict):
            L.append(f"| jaxamp fp32 reference run, step {ref_est['step']} | {ref_est['fixed50']:.4f} | "
                     f"{ref_est['whole']:.4f} ({ref_est['windows']} windows) | n/a | {_fmt_spread(ref_est['draws'])} |")
        if trained is not None:
            f = trained["final"]
            L.append(f"| PyTorch nanoGPT copy, step {args.train_steps} | {f['fixed50']:.4f} | {f['whole']:.4f} "
                     f"({f['windows']} windows) | {trained['history'][-1]['val']:.4f} | {_fmt_spread(f['draws'])} |")
    if isinstance(ref_est, str):
        L.append("")
        L.append(f"Reference checkpoint not scored: {ref_est}.")
    if trained is not None:
        L.append("")
        L.append("### Validation loss during training")
        L.append("")
        L.append("| step | jaxamp reference (50 fixed batches) | PyTorch copy (50 fixed batches) | PyTorch copy "
                 "(nanoGPT estimate) | PyTorch copy, train (nanoGPT estimate) |")
        L.append("| --- | --- | --- | --- | --- |")
        for h in trained["history"]:
            jv = ref_hist.get(h["step"])
            L.append(f"| {h['step']} | {'' if jv is None else f'{jv:.4f}'} | {h['val_fixed50']:.4f} | {h['val']:.4f} | "
                     f"{h['train']:.4f} |")
    L.append("")
    L.append("## Notes")
    L.append("")
    L.append("- nanoGPT's 1.88 is one estimate from 20 random batches (15,360 tokens) of one seed; ours is the mean "
             "over 50 fixed batches (38,400 tokens)."
             + (" The estimator table above says how far apart single estimates of the same weights fall."
                if trained is not None or isinstance(ref_est, dict) else ""))
    L.append("- The PyTorch model is a compacted copy of nanoGPT's `model.py` (same modules in the same construction "
             "order, so `torch.manual_seed(1337)` gives nanoGPT's initial weights; same init, weight tying, "
             "optimizer groups), and the training loop follows `train.py` (first batch fetched before the loop, "
             "evaluation before the step at multiples of 250, next batch fetched between forward and backward). On "
             "CPU nanoGPT's `dtype` resolves to float16 but its autocast context is a `nullcontext` and its "
             "`GradScaler` disables itself without CUDA, so it trains in float32 as here.")
    L.append("- PyTorch's multi-threaded figure depends on the box's load more than anything else here: its OpenMP "
             "workers spin-wait at every parallel region, and when other jobs hold a core the step waits for a "
             "descheduled worker. On this box, with a load average around 5, 2 threads ran 10-20x slower than 1 "
             "thread in some runs and faster in others; `OMP_WAIT_POLICY=PASSIVE` removes the collapse. The "
             "1-thread row is the stable one; `--train-steps` uses `--train-threads` (default 1).")
    L.append("- Throughput: PyTorch eager runs one op at a time through its CPU kernels (oneDNN/MKL matmuls); "
             "jaxamp's step is one XLA:CPU executable (fused elementwise ops, Eigen matmuls). Neither side was "
             "tuned for CPU.")
    return "\n".join(L) + "\n"


def _thread_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated thread counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be >= 1, got {text!r}")
    return list(dict.fromkeys(values))  # deduplicated, in order


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default=str(DEFAULT_DATA) if DEFAULT_DATA.exists() else None,
                   help="UTF-8 text (default ../shared/data/tinyshakespeare.txt; the stdlib corpus if it is missing)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--steps", type=int, default=50, help="steps per framework per round")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per framework first (jaxamp compiles)")
    p.add_argument("--pause", type=float, default=0.5, help="seconds idle before each timed window")
    p.add_argument("--check-steps", type=int, default=3, help="steps of the equivalence check (0 = skip)")
    p.add_argument("--threads", type=_thread_list, default=_thread_list(f"{os.cpu_count()},1"),
                   help="comma-separated torch.set_num_threads values, one PyTorch row each (default: all cores,1)")
    p.add_argument("--train-steps", type=int, default=0, help="train the PyTorch copy this many steps (0 = skip)")
    p.add_argument("--train-threads", type=int, default=1,
                   help="torch threads for --train-steps and the equivalence check (default 1: on a loaded shared "
                        "box several OpenMP threads can run 10-20x slower, see the notes)")
    p.add_argument("--train-seed", type=int, default=SEED, help="torch.manual_seed for --train-steps")
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
    check_sizes(p, args, ("layers", "heads", "width", "seq_len", "batch_size", "rounds", "steps", "warmup",
                          "train_threads", "eval_interval", "eval_iters", "estimator_draws"),
                ("train_steps", "check_steps", "pause"))
    if args.data is not None and not Path(args.data).is_file():
        p.error(f"--data {args.data} is not a file")
    check_output(p, "--out", args.out)
    return args


def _brief(estimates: dict) -> str:
    return json.dumps({k: v for k, v in estimates.items() if k != "draws"})


def main(argv=None) -> int:
    args = parse_args(argv)
    started = datetime.datetime.now()
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]))] + (sys.argv[1:] if argv is None
                                                                                         else list(argv)))

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    cfg = TrainConfig(data=args.data, precision="fp32", layers=args.layers, heads=args.heads, width=args.width,
                      seq_len=args.seq_len, batch_size=args.batch_size, steps=max(args.train_steps, 2000),
                      progress=False)
    try:
        run = build(cfg)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n_params = count_params(run.state.params)
    log(f"jaxamp: {n_params:,} parameters; torch: {'n/a' if torch is None else torch.__version__}")
    thr = time_throughput(run, cfg, args)  # first: its first jaxamp step includes the compile
    log("tokens/s per round: " + json.dumps({k: [round(x) for x in v] for k, v in thr["per_round"].items()}))
    eq = None
    if torch is not None:  # the equivalence check and --train-steps (threads change the speed only)
        torch.set_num_threads(args.train_threads)
        thr["torch_threads_after"] = args.train_threads
    if torch is not None and args.check_steps:
        eq = check_equivalence(run, cfg, args.check_steps)
        log(f"equivalence: max |loss diff| {eq['max_loss_diff']:.2e}, max |param diff| {eq['max_param_diff']:.2e}")
    ref_dir = Path(args.reference)
    ref = reference_summary(ref_dir)
    ref_hist = reference_history(ref_dir)
    ref_est = None
    full_size = (cfg.layers, cfg.heads, cfg.width, cfg.seq_len, cfg.batch_size) == (4, 4, 128, 64, 12)
    if not args.no_reference_checkpoint and full_size and (args.train_steps > 0 or (ref_dir / "checkpoints").is_dir()):
        ref_est = reference_estimates(ref_dir, run, cfg, args.estimator_draws)
        log(f"reference checkpoint: {ref_est if isinstance(ref_est, str) else _brief(ref_est)}")
    trained = None
    if torch is not None and args.train_steps > 0:
        trained = train_torch(run, cfg, args, log)
        log(f"torch training: {trained['wall_s']:.0f} s, final {_brief(trained['final'])}")
    text = report(args, cfg, run, n_params, thr, eq, ref, ref_hist, ref_est, trained, command, started)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
