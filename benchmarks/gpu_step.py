"""The jaxamp LM step the GPU benchmarks time (`gpu_throughput.py`, `gpu_paired.py`, `gpu_profile.py`): its
precisions, sizes, the device peaks for MFU, and `build`, which makes a precision's jitted, donating step.

Importing this module imports jax but starts no backend (a parent that leaves the device to its children can use it).
"""

from __future__ import annotations

import collections
import contextlib
import re

from jaxamp.lm.presets import MODEL_PRESETS, PRESET_FIELDS  # imports jax, starts no backend

FUSED_CHUNK = 4096  # tokens per block of the fused head + cross-entropy in the *-fused rows
PRECISIONS = {  # name -> (jaxamp policy, dynamic loss scale?, matmul precision or None, peak-table key, loss_chunk)
    "fp32-highest": ("fp32", False, "highest", "fp32", 0),
    "fp32": ("fp32", False, None, "tf32", 0),
    "bf16": ("bf16", False, None, "16bit", 0),
    "bf16-fused": ("bf16", False, None, "16bit", FUSED_CHUNK),  # TransformerConfig.loss_chunk: no whole f32 logits
    "fp16": ("fp16", True, None, "16bit", 0),
    "fp8": ("fp8", False, None, "fp8", 0),
    # The same float32 model code under autocast (no LM keep_float32 rules: autocast keeps lookups float32), the
    # stateless FP8 recipes through autocast (the tied head excluded by name), and bf16 Adam moments.
    "bf16-autocast": ("bf16;autocast", False, None, "16bit", 0),  # float32 logits (autocast's float32_results)
    "bf16-autocast-bf16-logits": ("bf16;autocast;float32_results=", False, None, "16bit", 0),  # torch.amp's rule
    "fp8-current": ("fp8-current", False, None, "fp8", 0),
    "fp8-current-pow2": ("fp8-current-pow2", False, None, "fp8", 0),  # power-of-2 scales: bf16 GEMM outputs
    "fp8-block": ("fp8-block", False, None, "fp8", 0),
    "bf16-moments": ("bf16;opt_state=bf16", False, None, "16bit", 0),
    "fp8-moments": ("fp8-current;opt_state=bf16", False, None, "fp8", 0),  # issue 23's XL memory goal: both savings
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


def add_size_flags(parser, *, precisions: str | int) -> None:
    """`--tiny`, `--precisions` (`precisions`: argparse's nargs, default bf16 fp16) and `--batch-size`, the size flags
    of gpu_paired.py and gpu_profile.py."""
    parser.add_argument("--tiny", action="store_true", help="gpu_throughput.py's --tiny sizes (a CPU test)")
    parser.add_argument("--precisions", nargs=precisions, choices=list(PRECISIONS), default=["bf16", "fp16"])
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: gpu_throughput's)")


def sizes(tiny: bool, batch_size: int | None = None, model: str = "gpt2-124m") -> dict:
    """The sizes of `--tiny` or of the `--model` preset, with `--batch-size` when given."""
    size = dict(TINY) if tiny else preset_size(model)
    if batch_size is not None:
        size["batch_size"] = batch_size
    return size


def add_model_flags(parser, scan_help: str = "train_lm.py's --scan-layers") -> None:
    """`--model`, `--scan-layers` and `--remat`: train_lm.py's size preset and block layout, the flags of
    gpu_throughput.py, gpu_compile.py and gpu_profile.py."""
    from jaxamp.lm.model import REMAT_POLICIES

    parser.add_argument("--model", choices=list(MODEL_PRESETS), default="gpt2-124m",
                        help="size preset of train_lm.py's --model (default: gpt2-124m; `small`: 4 layers, width "
                             "128, seq 64; a script's --tiny overrides it)")
    parser.add_argument("--scan-layers", action="store_true", help=f"blocks as one nn.scan ({scan_help})")
    parser.add_argument("--remat", choices=list(REMAT_POLICIES), default="none",
                        help="rematerialisation of each block (train_lm.py's --remat; default: none)")


def model_size(args, tiny: bool = False, batch_size: int | None = None) -> dict:
    """`sizes` of `args.model` (or --tiny) with the block layout of `add_model_flags`' `--scan-layers` and `--remat`."""
    return {**sizes(tiny, batch_size, args.model), "scan_layers": args.scan_layers, "remat": args.remat}


def layout_words(size: dict) -> str:
    """`"48 layers (scanned), remat elementwise"`: the depth and block layout, for a report's model line."""
    return (f"{size['layers']} layers{' (scanned)' if size.get('scan_layers') else ''}"
            f"{'' if size.get('remat', 'none') == 'none' else ', remat ' + size['remat']}")


def peak_flops(device_kind: str, key: str) -> float | None:
    """The dense peak FLOP/s of this device for a precision key, or None for an unknown device (CPU)."""
    for name, table in PEAK_FLOPS.items():
        if name.lower() in device_kind.lower():
            return table.get(key)
    return None


_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[")  # "%name = f8e4m3fn[4096,768]{1,0} op(...)": name, dtype
_DOT = re.compile(r"= \w+\[[^]]*\]\S* dot\(%([^,\s]+), %([^,)\s]+)\)")


def dot_operand_dtypes(hlo_text: str) -> list[tuple[str, str]]:
    """The element types of the two operands of every `dot` instruction in an HLO module's text (each computation
    read once: a dot in a loop body counts once)."""
    dtypes, dots = {}, []
    for line in hlo_text.splitlines():
        if line.startswith(("%", "ENTRY")) and line.rstrip().endswith("{"):  # a computation: names are its own
            dtypes = dict(re.findall(r"(\S+): (\w+)\[", line.split(")", 1)[0]))
            continue
        m = _INSTR.match(line)
        if m:
            dtypes[m.group(1)] = m.group(2)
        d = _DOT.search(line)
        if d:
            dots.append((dtypes.get(d.group(1), "?"), dtypes.get(d.group(2), "?")))
    return dots


def custom_calls(hlo_text: str) -> dict:
    """The compiled step's GEMMs and fused attention: cuDNN fused attention calls (`cudnn_attention`), GEMMs with
    FP8 operands (`f8_gemm`: cuBLASLt FP8 calls and Triton/XLA dots of FP8 operands) and all GEMMs (`gemm`: cuBLAS
    calls and dots left to Triton or XLA's emitters), counted in the program text (a scanned block's once)."""
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo_text)
    cublas = [t for t in targets if "matmul" in t or "gemm" in t]
    dots = dot_operand_dtypes(hlo_text)
    f8_dots = sum(a.startswith("f8") and b.startswith("f8") for a, b in dots)
    return {"cudnn_attention": sum("fmha" in t for t in targets),
            "f8_gemm": sum("f8" in t for t in cublas) + f8_dots, "gemm": len(cublas) + len(dots)}


def fp8_gemm_outputs(hlo_text: str) -> dict:
    """Result dtypes of the cuBLASLt FP8 GEMM calls in the compiled text: `{"bf16": 16, "f32": 8}`."""
    found = re.findall(r"= \((\w+)\[[^\n]*custom_call_target=\"__cublas\$lt\$matmul\$f8\"", hlo_text)
    return dict(collections.Counter(found))


def flops_per_token(n_params_no_pos: int, layers: int, heads: int, head_dim: int, seq_len: int) -> float:
    """nanoGPT's `estimate_mfu`: 6 N (forward + backward of the weights) + 12 L H Q T (attention scores)."""
    return 6 * n_params_no_pos + 12 * layers * heads * head_dim * seq_len


# --------------------------------------------------------------------------------------------------------------------
# One precision, in this process.

def build(name: str, size: dict, abstract: bool = False):
    """The jitted, donating jaxamp step of precision `name` and its first state and batch (on the default device).

    Args:
      abstract: the state and batch as `jax.ShapeDtypeStruct`s (`jax.eval_shape`: nothing allocated), to compile.

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
                            loss_chunk=loss_chunk, scan_layers=size.get("scan_layers", False),
                            remat=size.get("remat", "none"))
    model = TransformerLM(cfg)

    def loss_fn(params, batch, rng):
        del rng  # no dropout
        inputs, targets = batch  # i32[batch, seq] each
        return model.apply(lm_variables(params), inputs, targets, deterministic=True)  # f32[] mean cross-entropy

    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(learning_rate=6e-4, b1=0.9, b2=0.95, weight_decay=0.1))
    loss_scale = DynamicLossScale(2.0**15) if dynamic else NoOpLossScale()

    def first_state_and_batch():
        init_key, data_key, state_key = jax.random.split(jax.random.key(0), 3)
        variables = jax.jit(model.init)(init_key, jnp.zeros((1, cfg.seq_len), jnp.int32))
        params = variables if cfg.fp8 else variables["params"]  # FP8: its scales and amax histories ride along
        state = TrainState.create(params=params, tx=tx, policy=policy, loss_scale=loss_scale, rng=state_key)
        tokens = jax.random.randint(data_key, (size["batch_size"], cfg.seq_len + 1), 0, cfg.vocab_size, jnp.int32)
        return state, (tokens[:, :-1], tokens[:, 1:]), variables["params"]  # batch: i32[batch, seq] each

    state, batch, weights = (jax.eval_shape if abstract else lambda f: f())(first_state_and_batch)
    n_params = count_params(weights)
    info = {"cfg": cfg, "n_params": n_params, "n_no_pos": n_params - int(weights["wpe"]["embedding"].size)}
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


