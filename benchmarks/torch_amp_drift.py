"""torch.amp's bf16 autocast on three of the outside models, with the same weights and data: its 40-step drift over
float32's own noise, the yardstick issue 21 sets jaxamp's `bf16;autocast`.

The three models whose `bf16;autocast` 40-step drift stays over 1.5x float32's own noise in
`benchmarks/autocast_models.py` (GPT-2, ESM2, the ImageNet ResNet), rebuilt in PyTorch with their JAX trial's initial
weights copied in, and trained on the JAX trial's batches (`tests/outside_models`, `make_batch(key(1000 k + i))` for
step i of data draw k):
- gpt2: transformers' `GPT2LMHeadModel` (the PyTorch twin of the Flax model the trial trains, same `GPT2Config`,
  dropout 0.1; weights by transformers' `load_flax_weights_in_pytorch_model`); eager attention (matmul, softmax,
  matmul, as the Flax model), and `--gpt2-sdpa` for transformers' default (fused SDPA, whose scores never round).
- esm2: transformers' `EsmForMaskedLM` in esm2quinox's configuration (rotary, token dropout, tied logit head, no
  dropout), weights copied leaf by leaf from the Equinox model.
- resnet: Flax's `examples/imagenet/models.py` ResNet ([1, 1] basic blocks, 8 filters) ported line for line to
  `torch.nn.functional` (Flax's SAME padding is asymmetric, so it is padded by hand), weights transposed in.
The loss is the JAX trial's (shifted next-token cross-entropy; masked-LM cross-entropy over masked positions;
cross-entropy plus 1e-4/2 x the sum of squares of the ndim > 1 weights). Adam 1e-3, as the JAX trials. Each model's
float32 loss at the first step is printed beside the JAX trial's: the twin is the same function.

Runs, each 40 steps, on each of `--seeds` draws of the data (seed k's dropout masks from `torch.manual_seed(k)`, the
same in every run of that draw: PyTorch draws the same mask for a bf16 tensor as for a float32 one):
- fp32: float32.
- fp32, rounded: float32 from the weights rounded once to bfloat16: float32's own noise.
- `torch.autocast("cpu", bfloat16)`: torch.amp as it ships for the CPU. Its CPU op lists keep softmax, layer_norm,
  exp, sum and pow in bfloat16 when their input is.
- the same plus CUDA's float32 list: torch.amp's CUDA lists emulated on the CPU by a `TorchFunctionMode` that runs
  the ops of CUDA autocast's float32 list (softmax, log_softmax, layer_norm, group_norm, exp, log, pow, sum, cumsum,
  rsqrt, norm, the losses: `CUDA_FLOAT32`) on float32 inputs, as CUDA autocast does; matmuls and convolutions go
  through torch's autocast (the same lower-precision list on both devices). This is what jaxamp's `bf16;autocast`
  follows.
The table: each draw's mixed gap (mean |loss difference| to fp32 over the steps) over its own float32 noise (the
rounded run's gap), the median of those ratios (the yardstick: at most 1.5), as `autocast_models.py`'s last columns.

PyTorch is optional (not a jaxamp dependency); run with it installed: `python benchmarks/torch_amp_drift.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness  # noqa: E402
from tests.outside_models import TRIALS  # noqa: E402

try:  # optional: PyTorch is not a jaxamp dependency
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode
except ImportError:  # pragma: no cover - depends on the environment
    torch = None
    TorchFunctionMode = object

DEFAULT_OUT = Path(__file__).parent / "results" / "torch_amp_drift.md"
TRIAL_OPTIONS: dict = {}  # `--dropout`: {"dropout": rate} for the JAX trial (GPT-2), which the twin copies
MODES = ("fp32", "fp32, rounded", "autocast cpu", "autocast + CUDA float32 list")


def _cuda_float32_ops() -> set:
    """CUDA autocast's float32 list (torch.amp docs, "CUDA Ops that can autocast to float32"), as the Python
    functions and Tensor methods these models reach."""
    if torch is None:
        return set()
    T = torch.Tensor
    return {F.softmax, T.softmax, torch.softmax, F.log_softmax, T.log_softmax, torch.log_softmax, F.softmin,
            F.layer_norm, F.group_norm, torch.layer_norm, F.normalize, torch.exp, T.exp, torch.expm1, torch.log,
            T.log, torch.log1p, torch.log2, torch.log10, torch.pow, T.pow, T.__pow__, T.__rpow__, torch.sum, T.sum,
            torch.prod, T.prod, torch.cumsum, T.cumsum, torch.cumprod, torch.rsqrt, T.rsqrt, torch.reciprocal,
            T.reciprocal, T.__rtruediv__, torch.norm, T.norm, torch.erfinv, torch.sinh, torch.cosh, torch.tan,
            torch.acos, torch.asin, F.softplus, F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.kl_div,
            F.smooth_l1_loss, F.binary_cross_entropy_with_logits}


CUDA_FLOAT32 = _cuda_float32_ops()


class CudaFloat32List(TorchFunctionMode):
    """Under CPU autocast, the ops of CUDA autocast's float32 list run on float32 inputs (floating tensors cast up,
    autocast off for the op) and return float32, as `torch.autocast("cuda")` runs them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in CUDA_FLOAT32 and torch.is_autocast_enabled("cpu"):
            up = lambda x: x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
            args, kwargs = torch.utils._pytree.tree_map(up, (args, kwargs))
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _t(x, dtype=None) -> torch.Tensor:
    """A JAX or NumPy array as a torch tensor (copied)."""
    out = torch.from_numpy(np.array(x))
    return out if dtype is None else out.to(dtype)


# --- the three twins: (model, batch converter, loss) ----------------------------------------------------------------

def gpt2_twin(trial, sdpa: bool = False):
    """transformers' GPT2LMHeadModel with the Flax trial's config and weights."""
    from transformers import GPT2LMHeadModel
    from transformers.modeling_flax_pytorch_utils import load_flax_weights_in_pytorch_model

    model = GPT2LMHeadModel._from_config(trial.model.config, attn_implementation="sdpa" if sdpa else "eager")
    model = load_flax_weights_in_pytorch_model(model, jax.device_get(trial.params))

    def batch(b):
        return {"input_ids": _t(b["input_ids"], torch.long), "attention_mask": _t(b["attention_mask"], torch.long)}

    def loss(model, b):  # run_clm_flax's loss: shifted logits / labels, mean cross-entropy
        logits = model(**b).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), b["input_ids"][:, 1:].reshape(-1))

    return model, batch, loss


def esm2_twin(trial):
    """transformers' EsmForMaskedLM in esm2quinox's configuration, the Equinox model's weights copied in."""
    from transformers import EsmConfig, EsmForMaskedLM

    eq = trial.model
    config = EsmConfig(vocab_size=33, hidden_size=eq.embed_size, num_hidden_layers=eq.num_layers,
                       num_attention_heads=eq.num_heads, intermediate_size=4 * eq.embed_size,
                       position_embedding_type="rotary", token_dropout=True, mask_token_id=32, pad_token_id=1,
                       emb_layer_norm_before=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       layer_norm_eps=1e-5, hidden_act="gelu", tie_word_embeddings=True)
    model = EsmForMaskedLM._from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, value in _esm2_weights(eq).items():
            model.get_parameter(name).copy_(_t(value))

    def batch(b):
        tokens = _t(b["tokens"], torch.long)
        return {"input_ids": tokens, "attention_mask": (tokens != 1).long(), "labels": _t(b["labels"], torch.long),
                "weights": _t(b["weights"], torch.float32)}

    def loss(model, b):  # the JAX trial's: cross-entropy over the masked positions, their mean
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        each = F.cross_entropy(logits.transpose(1, 2), b["labels"], reduction="none")  # f32[B, L]
        return (each * b["weights"]).sum() / b["weights"].sum()

    return model, batch, loss


def _esm2_weights(eq) -> dict:
    """HF EsmForMaskedLM parameter name -> the Equinox leaf (layers are stacked on axis 0 in esm2quinox)."""
    lin = lambda m: {"weight": m.weight, "bias": m.bias}  # noqa: E731  (eqx Linear: weight [out, in], as torch)
    out = {"esm.embeddings.word_embeddings.weight": eq.logit_head.linear2.weight,
           "lm_head.bias": eq.logit_head.linear2.bias}
    for sub, module in {"lm_head.dense": eq.logit_head.linear1, "lm_head.layer_norm": eq.logit_head.layer_norm,
                        "esm.encoder.emb_layer_norm_after": eq.layer_norm}.items():
        out.update({f"{sub}.{k}": v for k, v in lin(module).items()})
    layers = eq.layers
    parts = {"attention.self.query": layers.attn.query_proj, "attention.self.key": layers.attn.key_proj,
             "attention.self.value": layers.attn.value_proj, "attention.output.dense": layers.attn.output_proj,
             "attention.LayerNorm": layers.layer_norm1, "LayerNorm": layers.layer_norm2,
             "intermediate.dense": layers.linear1, "output.dense": layers.linear2}
    for i in range(eq.num_layers):
        for sub, module in parts.items():
            out.update({f"esm.encoder.layer.{i}.{sub}.{k}": v[i] for k, v in lin(module).items()})
    return out


def resnet_twin(trial):
    """Flax's ImageNet ResNet ([1, 1] basic blocks) in torch.nn.functional, its weights transposed in."""
    def torch_layout(x):  # HWIO -> OIHW; Dense [in, out] -> [out, in]
        x = _t(x)
        return x.permute(3, 2, 0, 1).contiguous() if x.ndim == 4 else x.t().contiguous() if x.ndim == 2 else x

    params = {"/".join(p): torch.nn.Parameter(torch_layout(_get(trial.params, p))) for p in _leaf_paths(trial.params)}
    model = torch.nn.Module()
    model.params = torch.nn.ParameterDict({k.replace("/", "__"): v for k, v in params.items()})  # no "." allowed

    def batch(b):
        return {"image": _t(b["image"]).permute(0, 3, 1, 2).contiguous(), "label": _t(b["label"], torch.long)}

    def loss(model, b):  # imagenet train.py's loss_fn
        logits = _resnet_forward({k.replace("__", "."): v for k, v in model.params.items()}, b["image"])
        ce = F.cross_entropy(logits, b["label"])
        return ce + 1e-4 * 0.5 * sum((w ** 2).sum() for w in model.params.values() if w.ndim > 1)

    return model, batch, loss


def _leaf_paths(tree, prefix=()):
    for k, v in tree.items():
        yield from (_leaf_paths(v, prefix + (k,)) if isinstance(v, dict) else [prefix + (k,)])


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _same_pad(x, kernel: int, stride: int, value: float = 0.0):
    """Flax/XLA SAME padding (low = total // 2, high = the rest) on NCHW `x`."""
    size = x.shape[-1]
    total = max((-(-size // stride) - 1) * stride + kernel - size, 0)
    return F.pad(x, (total // 2, total - total // 2, total // 2, total - total // 2), value=value)


def _resnet_forward(p, x):
    """`models.ResNet(stage_sizes=[1, 1], block_cls=ResNetBlock, num_filters=8)` on f32[B, 3, 8, 8] -> [B, 10]."""
    def bn(x, name):  # Flax BatchNorm in train mode: batch statistics, epsilon 1e-5
        return F.batch_norm(x, None, None, p[f"{name}.scale"], p[f"{name}.bias"], training=True, eps=1e-5)

    def conv(x, name, stride=1):
        w = p[f"{name}.kernel"]
        return F.conv2d(_same_pad(x, w.shape[-1], stride), w, stride=stride)

    x = F.conv2d(x, p["conv_init.kernel"], stride=2, padding=3)  # padding=[(3, 3), (3, 3)]
    x = F.relu(bn(x, "bn_init"))
    x = F.max_pool2d(_same_pad(x, 3, 2, value=-float("inf")), 3, stride=2)
    for i, stride in enumerate((1, 2)):
        b = f"ResNetBlock_{i}"
        y = F.relu(bn(conv(x, f"{b}.Conv_0", stride), f"{b}.BatchNorm_0"))
        y = bn(conv(y, f"{b}.Conv_1"), f"{b}.BatchNorm_1")
        residual = bn(conv(x, f"{b}.conv_proj", stride), f"{b}.norm_proj") if f"{b}.conv_proj.kernel" in p else x
        x = F.relu(residual + y)
    x = x.mean(dim=(2, 3))  # [B, 16]
    return F.linear(x, p["Dense_0.kernel"], p["Dense_0.bias"])


TWINS = {"gpt2_hf": gpt2_twin, "esm2_equinox": esm2_twin, "imagenet_resnet": resnet_twin}


# --- runs -------------------------------------------------------------------------------------------------------------

def _context(mode: str):
    if mode.startswith("autocast"):
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        if "CUDA" in mode:
            stack.enter_context(CudaFloat32List())
        return stack
    return contextlib.nullcontext()


def _build(name: str, mode: str, options: dict):
    """(JAX trial, twin in train mode, batch converter, loss); under mode "fp32, rounded" the twin's weights rounded
    once to bfloat16 (kept float32)."""
    trial = TRIALS[name](**TRIAL_OPTIONS)
    model, to_torch, loss_fn = TWINS[name](trial, **options)
    if mode == "fp32, rounded":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
    return trial, model.train(), to_torch, loss_fn


def run(name: str, mode: str, steps: int, seed: int, options: dict) -> list[float]:
    """The per-step losses of one twin run: `steps` Adam steps on data draw `seed`."""
    trial, model, to_torch, loss_fn = _build(name, mode, options)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(seed)
    out = []
    for i in range(steps):
        b = to_torch(trial.make_batch(jax.random.key(1000 * seed + i)))
        with _context(mode):
            loss = loss_fn(model, b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def gradients(name: str, mode: str, seed: int, options: dict) -> dict:
    """`{param name: f32 gradient}` at init on data draw `seed`'s first batch (dropout masks from
    `torch.manual_seed(seed)`), the weights rounded once to bfloat16 under mode "fp32, rounded"."""
    trial, model, to_torch, loss_fn = _build(name, mode, options)
    torch.manual_seed(seed)
    with _context(mode):
        loss = loss_fn(model, to_torch(trial.make_batch(jax.random.key(1000 * seed))))
    loss.backward()
    return {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}  # ESM: no contact head


def leaf_count(mixed: dict, exact: dict, floor_grads: dict) -> tuple[int, int]:
    """(leaves within max(2%, 1.5 x noise floor), leaves counted): `jaxamp.fidelity`'s relative L2 errors, its
    noise floors (the rounded weights' float32 gradient against the float32 one) and its near-zero rule (RMS below
    `NEAR_ZERO` x the whole gradient's RMS: not counted)."""
    from jaxamp.fidelity import NEAR_ZERO

    rel = lambda g, r: float((g - r).norm() / r.norm())  # noqa: E731
    size = sum(g.numel() for g in exact.values())
    rms = float(sum((g ** 2).sum() for g in exact.values()) / size) ** 0.5
    counted = [n for n, g in exact.items() if float((g ** 2).mean()) ** 0.5 >= NEAR_ZERO * rms]
    within = sum(rel(mixed[n], exact[n]) <= max(0.02, 1.5 * rel(floor_grads[n], exact[n])) for n in counted)
    return within, len(counted)


def jax_first_loss(name: str) -> float:
    """The JAX trial's float32 loss on its first batch (dropout off where it has any): what the twin must give."""
    trial = TRIALS[name](**TRIAL_OPTIONS)
    b = trial.make_batch(jax.random.key(0))
    with jax.numpy_dtype_promotion("standard"):
        if name == "gpt2_hf":
            logits = trial.model(b["input_ids"], attention_mask=b["attention_mask"], params=trial.params)[0]
            return float(jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]),
                                                       b["input_ids"][:, 1:, None], -1)))
        out = trial.loss_fn(trial.params, b, jax.random.key(0))
    return float(out[0] if isinstance(out, tuple) else out)


def twin_first_loss(name: str, options: dict) -> float:
    trial = TRIALS[name](**TRIAL_OPTIONS)
    model, to_torch, loss_fn = TWINS[name](trial, **options)
    model.eval() if name == "gpt2_hf" else model.train()
    with torch.no_grad():
        return float(loss_fn(model, to_torch(trial.make_batch(jax.random.key(0)))))


def measure(name: str, steps: int, seeds: int, options: dict) -> dict:
    gaps = {mode: [] for mode in MODES[1:]}
    for k in range(seeds):
        fp32 = run(name, "fp32", steps, k, options)
        for mode in MODES[1:]:
            gaps[mode].append(float(np.mean(np.abs(np.subtract(run(name, mode, steps, k, options), fp32)))))
        harness.log(f"{name} seed {k}: " + ", ".join(f"{m} {g[-1]:.2e}" for m, g in gaps.items()))
    leaves = {mode: [] for mode in MODES[2:]}
    for k in range(seeds):
        exact, floor = gradients(name, "fp32", k, options), gradients(name, "fp32, rounded", k, options)
        for mode in MODES[2:]:
            leaves[mode].append(leaf_count(gradients(name, mode, k, options), exact, floor))
    return {"gaps": gaps, "leaves": leaves, "first": (jax_first_loss(name), twin_first_loss(name, options))}


def report(rows: dict, steps: int, argv) -> str:
    lines = [f"# torch.amp's bf16 autocast, {steps} steps against float32's own noise", "",
             f"- command: `{harness.command_line(__file__, argv)}`", f"- machine: {harness.machine()}",
             f"- torch {torch.__version__}, transformers {_version('transformers')}", f"- date: {harness.now()}",
             *([f"- dropout {TRIAL_OPTIONS['dropout']} (--dropout)"] if TRIAL_OPTIONS else []), "",
             "| model | autocast | gap / fp32's noise, per data draw | their median | within 1.5x | "
             "median gap | median fp32 noise | leaves within max(2%, 1.5x floor), per draw |",
             "| --- | --- | --- | ---: | --- | ---: | ---: | --- |"]
    for name, row in rows.items():
        noise = row["gaps"]["fp32, rounded"]
        for mode in MODES[2:]:
            ratios = [g / n for g, n in zip(row["gaps"][mode], noise)]
            median = float(np.median(ratios))
            lines.append(f"| {name} | {mode} | {' '.join(f'{r:.2f}' for r in ratios)} | {median:.3f} | "
                         f"{'yes' if median <= 1.5 else 'no'} | {np.median(row['gaps'][mode]):.2e} | "
                         f"{np.median(noise):.2e} | {' '.join(f'{w}/{c}' for w, c in row['leaves'][mode])} |")
    lines += ["", "The twins against the JAX trials, float32 loss on the first batch (dropout off):", "",
              "| model | JAX trial | PyTorch twin | difference |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {n} | {r['first'][0]:.6f} | {r['first'][1]:.6f} | {abs(r['first'][0] - r['first'][1]):.1e} |"
              for n, r in rows.items()]
    return "\n".join(lines) + "\n"


def _version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", nargs="*", default=list(TWINS), choices=list(TWINS))
    parser.add_argument("--steps", type=int, default=40, help="training steps per run (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=5, help="draws of the data (default: %(default)s)")
    parser.add_argument("--gpt2-sdpa", action="store_true", help="GPT-2 with transformers' default fused SDPA")
    parser.add_argument("--dropout", type=float, default=None,
                        help="GPT-2's dropout rate (default: its own, 0.1), for the JAX trial and its twin: at 0 "
                             "float32 is one trajectory in both frameworks")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="markdown file (default: %(default)s)")
    args = parser.parse_args(argv)
    if torch is None:
        parser.error("PyTorch not installed: pip install torch (CPU wheels suffice)")
    harness.check_output(parser, "--out", args.out)
    if args.dropout is not None:
        if args.trials != ["gpt2_hf"] or not 0.0 <= args.dropout < 1.0:
            parser.error(f"--dropout {args.dropout}: give a rate in [0, 1), with --trials gpt2_hf (the others have "
                         "no dropout)")
        TRIAL_OPTIONS["dropout"] = args.dropout
    torch.set_num_threads(2)
    rows = {}
    for name in args.trials:
        rows[name] = measure(name, args.steps, args.seeds, {"sdpa": True} if name == "gpt2_hf" and args.gpt2_sdpa
                             else {})
    harness.write_report(args.out, report(rows, args.steps, argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
