"""nanoGPT's model and training step in PyTorch, for `benchmarks/nanogpt_compare.py` and `benchmarks/cpu_step.py`:
a compacted, faithful copy of its `model.py` and `train.py` (https://github.com/karpathy/nanoGPT), and the glue to
jaxamp (sizes, weights, batches, schedule).

PyTorch is optional (not a jaxamp dependency): without it `torch` is None, and the callers print "PyTorch not
installed" where its figures would be.
"""

from __future__ import annotations

import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp.lm.config import TrainConfig
from jaxamp.lm.data import batch_at, eval_batches

try:  # optional: PyTorch is not a jaxamp dependency
    import torch
    import torch.nn as nn
    from torch.nn import functional as F
except ImportError:  # pragma: no cover - depends on the environment
    torch = None

NO_TORCH = "PyTorch not installed"
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
    """`nanogpt_lr`'s keywords for jaxamp's schedule of `cfg` (min_lr lr/10 unless set, decay to --steps)."""
    return dict(lr=cfg.lr, min_lr=cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr, warmup=cfg.warmup_steps,
                decay_iters=cfg.steps if cfg.decay_steps is None else cfg.decay_steps)


def make_optimizer(model, cfg: TrainConfig):
    """nanoGPT's AdamW groups with `cfg`'s weight decay, learning rate and betas."""
    return model.configure_optimizers(cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2))


def to_torch(batch):
    """A jaxamp batch `(inputs, targets)` (int32 arrays) as int64 torch tensors."""
    x, y = batch
    return torch.from_numpy(np.asarray(x, np.int64)), torch.from_numpy(np.asarray(y, np.int64))


def torch_loss_of(model):
    """`loss_of(x, y)`: the model's mean loss on one batch, in eval mode and without gradients."""
    def loss_of(x, y):
        model.eval()
        with torch.no_grad():
            _, loss = model(*to_torch((x, y)))
        model.train()
        return float(loss)

    return loss_of


def torch_windows(run, cfg: TrainConfig, batches: list, threads: list[int]) -> tuple[dict, object]:
    """One nanoGPT model and optimizer per thread count, as `harness.interleaved` windows over `batches`.

    Returns:
      `({"torch@N": window}, model)`: the windows (the caller sets `torch.set_num_threads(N)` before each, outside the
      timing) and the last model built (for its parameter counts).
    """
    torch_batches = [to_torch(b) for b in batches]
    lr_kwargs = jaxamp_lr_kwargs(cfg)
    windows, model = {}, None
    for n in threads:
        torch.manual_seed(SEED)
        model = torch_model(run, cfg)
        model.train()
        optimizer = make_optimizer(model, cfg)

        def window(idx, model=model, optimizer=optimizer):
            for i in idx:
                torch_step(model, optimizer, *torch_batches[i], nanogpt_lr(i, **lr_kwargs), cfg.grad_clip)

        windows[f"torch@{n}"] = window
    return windows, model


def set_threads(name: str) -> None:
    """`harness.interleaved`'s `before` hook: `torch.set_num_threads(N)` before a "torch@N" window."""
    if name.startswith("torch@"):
        torch.set_num_threads(int(name[6:]))


def get_batch(data: np.ndarray, batch_size: int, seq_len: int):
    """nanoGPT's get_batch: `torch.randint` offsets, int64 windows of inputs and targets."""
    ix = torch.randint(len(data) - seq_len, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + seq_len].astype(np.int64)) for i in ix.tolist()])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + seq_len].astype(np.int64)) for i in ix.tolist()])
    return x, y


def estimate_loss(model, splits: dict, batch_size: int, seq_len: int, eval_iters: int) -> dict:
    """nanoGPT's estimate_loss: `eval_iters` batches per split ("train", then "val") from the global torch RNG."""
    out = {}
    model.eval()
    with torch.no_grad():
        for split in ("train", "val"):
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                x, y = get_batch(splits[split], batch_size, seq_len)
                _, loss = model(x, y)
                losses[k] = loss.item()
            out[split] = float(losses.mean())
    model.train()
    return out


def initial_model(run, cfg: TrainConfig, args):
    """The model `--train-steps` starts from: nanoGPT's init under `torch.manual_seed(--train-seed)`, or (`--init
    jaxamp`) jaxamp's initial weights for `--init-seed` (build()'s key derivation)."""
    torch.manual_seed(args.train_seed)
    model = torch_model(run, cfg)
    if args.init == "jaxamp":
        params = run.state.params
        if args.init_seed is not None and args.init_seed != cfg.seed:
            init_key, _ = jax.random.split(jax.random.PRNGKey(args.init_seed))
            params = run.model.init(init_key, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
        load_jaxamp_params(model, params)
    model.train()
    return model


def train_torch(run, cfg: TrainConfig, args, log) -> dict:
    """nanoGPT's train.py CPU recipe in PyTorch, in nanoGPT's own order of RNG use (or jaxamp's batches).

    Returns:
      `{"history": [{"step", "train", "val", "val_fixed50"}], "loss_of": the final model's batch loss, "wall_s",
      "train_s", "tokens_per_s"}`.
    """
    train, val = run.dataset.train, run.dataset.val
    b, t = cfg.batch_size, cfg.seq_len
    model = initial_model(run, cfg, args)
    optimizer = make_optimizer(model, cfg)
    lr_kwargs = dict(lr=cfg.lr, min_lr=cfg.lr / 10, warmup=cfg.warmup_steps, decay_iters=args.train_steps)
    fixed_val = eval_batches(val, batch_size=b, seq_len=t, num_batches=50, seed=cfg.seed)
    loss_of = torch_loss_of(model)

    def next_batch(it):
        if args.data_order == "jaxamp":
            return to_torch(batch_at(train, seed=cfg.seed, step=it, batch_size=b, seq_len=t))
        return get_batch(train, b, t)

    history, train_time, it = [], 0.0, 0
    x, y = next_batch(0)  # nanoGPT fetches the very first batch before the loop
    t_start = time.perf_counter()
    while True:
        lr = nanogpt_lr(it, **lr_kwargs)
        if it % args.eval_interval == 0 or it == args.train_steps:
            losses = estimate_loss(model, {"train": train, "val": val}, b, t, args.eval_iters)
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
    return {"history": history, "loss_of": loss_of, "wall_s": time.perf_counter() - t_start, "train_s": train_time,
            "tokens_per_s": args.train_steps * b * t / max(train_time, 1e-9)}


def torch_versions() -> str:
    """torch's version and CPU threading set-up ("PyTorch not installed" without it)."""
    if torch is None:
        return NO_TORCH
    omp = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME") if k in os.environ}
    return (f"torch {torch.__version__} (eager, ATen parallel backend OpenMP, "
            f"mkldnn={torch.backends.mkldnn.is_available()}, OpenMP environment: {omp or 'defaults'})")
