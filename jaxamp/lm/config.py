"""The experiment's options: `TrainConfig` (one training run, with the model presets filled in), `validate` (raises
`ConfigError` naming the first bad option and the fix), and the options a resumed run must share with its checkpoint
(`RESUME_MATCH_KEYS`; `PRECISION_KEYS` may change together on resume). No side effects: pure checks of the values.
"""

from __future__ import annotations

import dataclasses
import math

from jaxamp.lm.corpus import DATA_FORMATS, TOKENIZERS
from jaxamp.lm.model import REMAT_POLICIES
from jaxamp.lm.presets import MODEL_PRESETS, PRESET_FIELDS
from jaxamp.lm.token_files import TOKEN_DTYPES
from jaxamp.precision import fp8_recipe, get_policy
from jaxamp.sharding import check_distributed_args, distributed_args_from_env, parse_mesh_spec

LOSS_SCALES = ("auto", "dynamic", "static", "none")
# Options a resumed run must share with the checkpoint (others, e.g. --steps or --eval-every, may change).
RESUME_MATCH_KEYS = ("corpus_sha256", "vocab_size", "precision", "loss_scale", "init_scale", "growth_interval",
                     "layers", "heads", "width", "seq_len", "batch_size", "seed", "dropout", "bias", "lr", "min_lr",
                     "warmup_steps", "decay_steps", "weight_decay", "beta1", "beta2", "grad_clip", "accum_steps",
                     "on_overflow", "max_retries", "fp8_amax_history", "scan_layers")
# Match keys added after checkpoints were first written, with the value a checkpoint saved without one had: an
# earlier unrolled run's checkpoint has no scan_layers and was unrolled (`resume_keys`).
RESUME_DEFAULTS = {"scan_layers": False}
# Of those, the ones that may change together with the precision (fp32 <-> bf16 <-> fp16 on resume): the master
# weights and optimizer state carry over, the loss scale is made anew for the new precision.
PRECISION_KEYS = ("precision", "loss_scale", "init_scale", "growth_interval")


class ConfigError(ValueError):
    """A training option is invalid; the message names the option and the fix."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. Defaults: nanoGPT's shakespeare_char CPU recipe (4 layers, 4 heads, width 128)."""

    data: str | None = None  # UTF-8 text file, or a directory of nanoGPT train.bin/val.bin; None = stdlib sources
    data_format: str = "auto"  # auto (a directory: tokens, else text) | text | tokens
    token_dtype: str = "auto"  # token files' ids: auto (uint16; files that are not are refused) | uint16 | uint32
    tokenizer: str = "char"  # char | bpe (byte-level BPE trained on the text, kept in WORKDIR/tokenizer); text only
    vocab_size: int | None = None  # ids (embedding rows); None = the characters' / meta.pkl's / 50304; bpe: required
    precision: str = "fp32"  # fp32 | bf16 | fp16 | a jmp policy string
    loss_scale: str = "auto"  # auto (dynamic for float16 compute, else none) | dynamic | static | none
    init_scale: float = 2.0**15  # initial (or static) loss scale
    growth_interval: int = 2000  # steps of finite gradients before the dynamic scale grows
    model: str = "small"  # preset of layers, heads, width, seq_len (jaxamp.lm.presets); explicit values override it
    layers: int | None = None  # Transformer blocks; None = the preset's
    heads: int | None = None  # attention heads per block; None = the preset's
    width: int | None = None  # d_model, channels; None = the preset's
    seq_len: int | None = None  # tokens per sequence (context); None = the preset's
    batch_size: int = 12  # sequences per step
    steps: int = 2000  # optimizer steps (train_step calls)
    lr: float = 1e-3  # peak learning rate
    min_lr: float | None = None  # final learning rate of the cosine; None = lr / 10 (nanoGPT)
    warmup_steps: int = 100  # steps of linear warmup from 0 to lr
    decay_steps: int | None = None  # steps of warmup + cosine decay (nanoGPT's lr_decay_iters); None = steps
    weight_decay: float = 0.1  # AdamW decoupled weight decay on matrices and embeddings
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # max global norm of the unscaled gradients; 0 = off
    dropout: float = 0.0  # probability
    bias: bool = False  # biases in Dense and LayerNorm layers (nanoGPT's train.py default: False)
    eval_every: int = 250  # steps between validation estimates (and at the last step)
    eval_batches: int = 50  # batches per validation estimate
    log_every: int = 10  # steps between host fetches of metrics (every step is still recorded)
    sample_tokens: int = 200  # characters generated at the end; 0 = none
    checkpoint_every: int = 500  # steps between checkpoints (and at the end, and on SIGTERM/SIGINT)
    accum_steps: int = 1  # micro-batches of batch_size sequences per optimizer step (gradient accumulation)
    on_overflow: str = "skip"  # skip (drop the update) | retry (back off and recompute the same batch)
    max_retries: int = 4  # retries per step with --on-overflow retry
    underflow_stats: bool = False  # log gradient zero fraction and loss-scale headroom per step
    fidelity_every: int = 0  # steps between gradient-fidelity checks against float32 (0 = off)
    fp8_amax_history: int = 1024  # steps of amax history per FP8 tensor (--precision fp8)
    loss_chunk: int = 0  # tokens per block of the fused head + cross-entropy; 0 = whole f32 logits
    scan_layers: bool = False  # blocks as one nn.scan over stacked parameters (one compiled block for all layers)
    remat: str = "none"  # rematerialisation of each block: none | full | dots | dots_with_no_batch_dims | elementwise
    max_consecutive_skips: int = 100  # stop (after saving) when this many steps in a row overflow
    keep: int = 3  # checkpoints kept (newest)
    seed: int = 1337
    workdir: str = "runs/default"
    progress: bool | None = None  # tqdm bar; None = only on a terminal
    mesh: str | None = None  # "data=N" or "data=N,fsdp=M" over every device (batch_size is global); None = 1 device
    coordinator: str | None = None  # HOST:PORT of process 0 for jax.distributed (else JAX_COORDINATOR_ADDRESS)
    num_processes: int | None = None  # processes in all (else JAX_NUM_PROCESSES)
    process_id: int | None = None  # this process, 0 .. num_processes - 1 (else JAX_PROCESS_ID)
    dry_run: bool = False  # print the sizes, the precision audit and the compiled step's FLOPs and memory; no weights

    def __post_init__(self) -> None:
        """Fills the shape fields left None from the `model` preset (an unknown name is left to `validate`)."""
        preset = MODEL_PRESETS.get(self.model, {})
        for name in PRESET_FIELDS:
            if getattr(self, name) is None and name in preset:
                object.__setattr__(self, name, preset[name])

    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.accum_steps


def validate(cfg: TrainConfig) -> None:
    """Raises ConfigError naming the first bad option and the fix."""
    if cfg.model not in MODEL_PRESETS:
        raise ConfigError(f"--model must be one of {', '.join(MODEL_PRESETS)}, got {cfg.model!r}")
    if cfg.tokenizer not in TOKENIZERS:
        raise ConfigError(f"--tokenizer must be one of {', '.join(TOKENIZERS)}, got {cfg.tokenizer!r}")
    if cfg.data_format != "auto" and cfg.data_format not in DATA_FORMATS:
        raise ConfigError(f"--data-format must be auto or one of {', '.join(DATA_FORMATS)}, got {cfg.data_format!r}")
    if cfg.token_dtype not in TOKEN_DTYPES:
        raise ConfigError(f"--token-dtype must be one of {', '.join(TOKEN_DTYPES)}, got {cfg.token_dtype!r}")
    if cfg.remat not in REMAT_POLICIES:
        raise ConfigError(f"--remat must be one of {', '.join(REMAT_POLICIES)}, got {cfg.remat!r}")
    if cfg.scan_layers and not cfg.layers >= 1:
        raise ConfigError(f"--scan-layers needs --layers >= 1 (blocks to scan over), got {cfg.layers}")
    if cfg.vocab_size is not None and cfg.vocab_size <= 0:
        raise ConfigError(f"--vocab-size must be > 0, got {cfg.vocab_size}")
    positive = {"steps": cfg.steps, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "layers": cfg.layers,
                "heads": cfg.heads, "width": cfg.width, "eval_every": cfg.eval_every,
                "eval_batches": cfg.eval_batches, "log_every": cfg.log_every, "growth_interval": cfg.growth_interval,
                "checkpoint_every": cfg.checkpoint_every, "keep": cfg.keep, "accum_steps": cfg.accum_steps,
                "max_consecutive_skips": cfg.max_consecutive_skips, "fp8_amax_history": cfg.fp8_amax_history}
    for name, value in positive.items():
        if value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ConfigError(f"--lr must be a finite number > 0, got {cfg.lr}")
    if cfg.width % cfg.heads:
        raise ConfigError(f"--heads ({cfg.heads}) must divide --width ({cfg.width})")
    if cfg.decay_steps is not None and cfg.decay_steps <= 0:
        raise ConfigError(f"--decay-steps must be > 0, got {cfg.decay_steps}")
    for name, value in (("warmup_steps", cfg.warmup_steps), ("weight_decay", cfg.weight_decay),
                        ("grad_clip", cfg.grad_clip)):
        if not value >= 0:  # NaN fails too
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if cfg.min_lr is not None and not (math.isfinite(cfg.min_lr) and 0 <= cfg.min_lr <= cfg.lr):
        raise ConfigError(f"--min-lr must lie in [0, --lr] = [0, {cfg.lr}], got {cfg.min_lr}")
    for name, beta in (("beta1", cfg.beta1), ("beta2", cfg.beta2)):
        if not 0 <= beta < 1:
            raise ConfigError(f"--{name} must lie in [0, 1), got {beta}")
    if not 0 <= cfg.seed < 2**31:
        raise ConfigError(f"--seed must lie in [0, 2**31), got {cfg.seed}")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"--dropout must lie in [0, 1), got {cfg.dropout}")
    if cfg.on_overflow not in ("skip", "retry"):
        raise ConfigError(f"--on-overflow must be skip or retry, got {cfg.on_overflow!r}")
    if cfg.max_retries < 0:
        raise ConfigError(f"--max-retries must be >= 0, got {cfg.max_retries}")
    if cfg.loss_chunk < 0:
        raise ConfigError(f"--loss-chunk must be >= 0 (tokens; 0 = whole logits), got {cfg.loss_chunk}")
    if cfg.fidelity_every < 0:
        raise ConfigError(f"--fidelity-every must be >= 0 (steps; 0 = off), got {cfg.fidelity_every}")
    if cfg.loss_scale not in LOSS_SCALES:
        raise ConfigError(f"--loss-scale must be one of {', '.join(LOSS_SCALES)}, got {cfg.loss_scale!r}")
    try:
        policy = get_policy(cfg.precision)
    except ValueError as err:
        raise ConfigError(f"--precision: {err}") from None
    if fp8_recipe(policy) and cfg.fp8_amax_history != TrainConfig.fp8_amax_history:
        raise ConfigError(f"--fp8-amax-history is the history of delayed scaling (--precision fp8); --precision "
                          f"{cfg.precision} computes each scale from the tensor itself and keeps no history: drop "
                          "--fp8-amax-history")
    validate_scale_out(cfg)


def resume_keys(match_keys: tuple[str, ...], saved: dict | None, cfg: TrainConfig) -> tuple[str, ...]:
    """`match_keys` for a checkpoint whose saved settings are `saved` (None: unreadable).

    A key of `RESUME_DEFAULTS` the checkpoint was saved without (an earlier jaxamp's) is left out when this run has
    its default value, which that checkpoint had (`jaxamp.lm.resume` passes a `cfg` with the saved layout,
    `saved_scan_layers`, and converts the restored state to the run's). With the settings unreadable the key is left
    out too when this run has the default: an older step the restore falls back to may be an earlier jaxamp's, and a
    layout it cannot load is still refused by the leaves' check.
    """
    return tuple(k for k in match_keys if not (k in RESUME_DEFAULTS and (saved is None or k not in saved)
                                               and getattr(cfg, k) == RESUME_DEFAULTS[k]))


def saved_scan_layers(saved: dict | None, cfg: TrainConfig) -> bool:
    """Whether the checkpoint whose settings are `saved` has its blocks scanned (stacked under `h`) or unrolled
    (`h_0 .. h_{L-1}`, as every checkpoint of an earlier jaxamp without `scan_layers`); this run's setting when the
    settings are unreadable (the restore then checks the leaves)."""
    if saved is None:
        return cfg.scan_layers
    return bool(saved.get("scan_layers", RESUME_DEFAULTS["scan_layers"]))


def validate_scale_out(cfg: TrainConfig) -> None:
    """--mesh and the multi-process flags (or JAX_* environment); the device count is checked in `build`."""
    try:
        shape = None if cfg.mesh is None else parse_mesh_spec(cfg.mesh)
        several = check_distributed_args(*distributed_args_from_env(cfg.coordinator, cfg.num_processes,
                                                                    cfg.process_id))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if shape is not None and cfg.batch_size % math.prod(shape.values()):
        raise ConfigError(f"--batch-size ({cfg.batch_size}, the global batch) must be divisible by the "
                          f"{math.prod(shape.values())} devices of --mesh {cfg.mesh}")
    if several and shape is None:
        raise ConfigError("several processes need --mesh, e.g. --mesh data=N with N the devices of all processes")
