"""Everything a run is built from its config: data, model, policy, loss scale, optimizer, the initial
`TrainState` and the jitted step, evaluation and fidelity functions (`build` -> `Run`), and the batches of a step.

No side effects beyond reading the data: the loop (`jaxamp.lm.train`) prints, writes and checkpoints.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp.audit import precision_audit
from jaxamp.fidelity import grad_fidelity
from jaxamp.fp8_collection import split_fp8
from jaxamp.lm.config import ConfigError, TrainConfig, validate
from jaxamp.lm.corpus import Corpus, decode_sample, load_corpus, sample_prompt
from jaxamp.lm.data import batch_at, eval_batches
from jaxamp.lm.model import (
    LM_KEEP_FLOAT32,
    STACK_NAME,
    TransformerConfig,
    TransformerLM,
    count_params,
    generate,
    stack_params,
)
from jaxamp.lm.workdir import BPE_DIR
from jaxamp.loss_scale import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale
from jaxamp.opt_state import optimizer_bytes_per_param
from jaxamp.precision import (
    auto_precision,
    get_policy,
    needs_loss_scaling,
    opt_state_dtype,
    policy_name,
    uses_autocast,
    uses_fp8,
)
from jaxamp.sharding import (
    abstract_state,
    format_mesh_spec,
    gather_to_host,
    jit_eval_step,
    jit_train_step,
    make_global_batch,
    make_mesh,
    shard_state,
)
from jaxamp.state import TrainState
from jaxamp.step import eval_step, train_step


def make_policy(precision: str):
    """The LM's policy for `--precision`: with half-precision compute, its embedding tables stay float32 in the
    compute copy (`LM_KEEP_FLOAT32`), so their gradients accumulate exactly."""
    policy = get_policy(precision)
    if jnp.dtype(policy.compute_dtype) == jnp.float32 or uses_autocast(policy):
        return policy  # (autocast keeps lookups and their gradient sums float32 by itself)
    # FP8: `params` is the whole variables dict (the FP8 collection rides along), so the tables sit under "params/".
    keep = tuple(f"params/{p}" for p in LM_KEEP_FLOAT32) if uses_fp8(policy) else LM_KEEP_FLOAT32
    return get_policy(policy, keep_float32=keep)


def make_loss_scale(cfg: TrainConfig) -> LossScale:
    """The loss scale the config asks for; `auto` = dynamic when the compute dtype is float16, else none."""
    kind = cfg.loss_scale
    if kind == "auto":
        kind = "dynamic" if needs_loss_scaling(get_policy(cfg.precision)) else "none"
    try:
        if kind == "dynamic":
            return DynamicLossScale(cfg.init_scale, growth_interval=cfg.growth_interval)
        if kind == "static":
            return StaticLossScale(cfg.init_scale)
    except ValueError as err:
        raise ConfigError(f"--init-scale / --growth-interval: {err}") from None
    return NoOpLossScale()


def make_optimizer(cfg: TrainConfig, params) -> optax.GradientTransformation:
    """Clip (unscaled gradients) -> AdamW with linear warmup then cosine decay; LR readable from the state."""
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    decay_steps = cfg.steps if cfg.decay_steps is None else cfg.decay_steps  # after it: min_lr
    warmup = min(cfg.warmup_steps, decay_steps - 1)  # optax needs warmup < decay_steps
    schedule = optax.warmup_cosine_decay_schedule(  # step 0 runs at lr / (warmup + 1), as nanoGPT
        cfg.lr / (warmup + 1), cfg.lr, warmup, decay_steps, min_lr)
    mask = decay_mask(params)
    # Hyperparameters in float32 even for half-precision master weights (in bfloat16, beta2=0.99 would round to 1).
    adamw = optax.inject_hyperparams(optax.adamw, hyperparam_dtype=jnp.float32)(
        learning_rate=schedule, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay, mask=mask)
    clip = optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity()
    return optax.chain(clip, adamw)


def decay_mask(params):
    """Which leaves AdamW decays: matrices and embeddings, as nanoGPT (not biases or LayerNorm scales). A leaf of
    the scanned model's stacked blocks (a path through `h`) has one more axis, the layer's: a stacked LayerNorm
    scale `[layers, width]` is not decayed either."""
    def stacked(path) -> int:
        return int(any(getattr(k, "key", None) == STACK_NAME for k in path))

    return jax.tree_util.tree_map_with_path(lambda path, p: p.ndim - stacked(path) >= 2, params)


def model_config(cfg: TrainConfig, vocab_size: int, *, fp8: bool) -> TransformerConfig:
    """The model's hyper-parameters for a run."""
    return TransformerConfig(vocab_size=vocab_size, seq_len=cfg.seq_len, num_layers=cfg.layers, num_heads=cfg.heads,
                             width=cfg.width, dropout=cfg.dropout, use_bias=cfg.bias, fp8=fp8,
                             fp8_amax_history=cfg.fp8_amax_history, loss_chunk=cfg.loss_chunk,
                             scan_layers=cfg.scan_layers, remat=cfg.remat)


def init_variables(model_cfg: TransformerConfig, key: jax.Array) -> dict:
    """The model's initial variables. A scanned model's are the unrolled model's, stacked (`stack_params`): the same
    weights from the same seed whether or not the blocks are scanned (and `--remat` changes nothing either)."""
    unrolled = TransformerLM(dataclasses.replace(model_cfg, scan_layers=False, remat="none"))
    variables = unrolled.init(key, jnp.zeros((1, model_cfg.seq_len), jnp.int32))
    return stack_params(variables) if model_cfg.scan_layers else variables


def applied_lr(opt_state) -> jax.Array:
    """The learning rate of the last applied update, read back from `inject_hyperparams`' state."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams")):
        if hasattr(node, "hyperparams"):
            return node.hyperparams["learning_rate"]
    raise ValueError("optimizer state holds no inject_hyperparams state with a learning_rate")


def lm_variables(params) -> dict:
    """The LM's variables for `model.apply`: the params tree as `{"params": ...}`, or the variables dict itself (an
    FP8 model keeps `{"params": ..., "_overwrite_with_gradient": ...}` in the state)."""
    return params if "params" in params else {"params": params}


def make_loss_fn(model: TransformerLM):
    """`loss_fn(params, (inputs, targets), rng)`: mean cross-entropy in float32; dropout on when rng is given."""

    def loss_fn(params, batch, rng):
        inputs, targets = batch  # i32[batch, seq] each
        rngs = None if rng is None else {"dropout": rng}
        # f32[] mean loss: the model takes the head and the loss together (fused when config.loss_chunk > 0)
        return model.apply(lm_variables(params), inputs, targets, deterministic=rng is None, rngs=rngs)

    return loss_fn


@dataclasses.dataclass
class Run:
    """Everything built from a config: data, model, jitted functions and the initial state."""

    cfg: TrainConfig
    dataset: Corpus
    model: TransformerLM
    state: TrainState
    step_fn: Any
    eval_fn: Any
    val_batches: list
    corpus_sha256: str
    mesh: Any = None  # a jax.sharding.Mesh when cfg.mesh is set: state and batches are global arrays on it
    fidelity_fn: Any = None  # (state, batch) -> {leaf path: f32[] relative error against float32}

    def run_config(self) -> dict:
        """The config saved with each checkpoint: the options plus what the data and model derive from them."""
        return {**dataclasses.asdict(self.cfg), "corpus_sha256": self.corpus_sha256,
                "vocab_size": self.dataset.vocab_size}

    def header(self) -> str:
        """The line a run prints when it starts: sizes, data, tokens per step, precision, loss scale, the blocks'
        layout (`--scan-layers`, `--remat`), mesh."""
        cfg, n = self.cfg, count_params(split_fp8(self.state.params)[0])
        dtype = jnp.dtype(self.state.policy.param_dtype)
        per_param = optimizer_bytes_per_param(split_fp8(self.state.params)[0], self.state.opt_state)
        return (f"jaxamp: {n:,} parameters ({n * dtype.itemsize / 2**20:.1f} MiB {dtype.name} master weights; "
                f"{per_param:.1f} bytes per parameter with the optimizer state); data "
                f"{self.dataset.description}; vocab {self.dataset.vocab_size}; train {len(self.dataset.train):,} / val "
                f"{len(self.dataset.val):,} tokens; {cfg.tokens_per_step():,} tokens per step; precision "
                f"{policy_name(self.state.policy, rules=False)}"
                f"{' (auto: ' + auto_precision()[1] + ')' if cfg.precision.strip().lower() == 'auto' else ''}; "
                f"loss scale {type(self.state.loss_scale).__name__}"
                + ("; blocks scanned" if cfg.scan_layers else "")
                + (f"; remat {cfg.remat}" if cfg.remat != "none" else "")
                + ("" if self.mesh is None else f"; mesh {format_mesh_spec(self.mesh)} over {jax.device_count()} "
                   f"devices ({jax.process_count()} process(es)), global batch {cfg.batch_size}"))

    def precision_summary(self) -> str | None:
        """The precision audit's one line for this run's step (`jaxamp.precision_audit`, traced on the batch's
        shapes, nothing computed), or None for a float32 compute dtype."""
        if jnp.dtype(self.state.policy.compute_dtype).itemsize >= 4:
            return None
        rows = self.cfg.batch_size * self.cfg.accum_steps
        tokens = jax.ShapeDtypeStruct((rows, self.cfg.seq_len), jnp.int32)
        return precision_audit(self.state, (tokens, tokens), make_loss_fn(self.model),
                               accum_steps=self.cfg.accum_steps).summary()


def initial_state(cfg: TrainConfig, model_cfg: TransformerConfig, policy) -> TrainState:
    """The model's initial variables and the `TrainState` on them (seeded by `cfg.seed`).

    Raises:
      ConfigError: the device ran out of memory (XLA's RESOURCE_EXHAUSTED), in one line giving the parameter count,
        the bytes the weights and optimizer state need, and what to change.
    """
    init_key, state_key = jax.random.split(jax.random.PRNGKey(cfg.seed))
    try:
        variables = init_variables(model_cfg, init_key)
        params = variables if model_cfg.fp8 else variables["params"]  # FP8: scales and histories ride along
        return TrainState.create(params=params, tx=make_optimizer(cfg, split_fp8(params)[0]), policy=policy,
                                 loss_scale=make_loss_scale(cfg), rng=state_key)
    except Exception as err:  # jax's XlaRuntimeError (or a ValueError wrapping it)
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
    n = count_params(jax.eval_shape(lambda key: init_variables(model_cfg, key), init_key)["params"])
    per_param = 4 + 2 * jnp.dtype(opt_state_dtype(policy) or jnp.float32).itemsize  # weights + Adam's 2 moments
    raise ConfigError(f"out of memory creating the model's weights and optimizer state on {jax.devices()[0]}: "
                      f"{n:,} parameters x {per_param} bytes (float32 master weights and Adam moments) = "
                      f"{n * per_param / 1e9:.1f} GB before activations; use a smaller --model, more devices "
                      "(--mesh data=N,fsdp=M shards them) or ';opt_state=bf16' (8 bytes per parameter)")


def build(cfg: TrainConfig) -> Run:
    """Validates `cfg`, loads the data and builds the model, optimizer, loss scale and initial state (with
    `cfg.dry_run`, the state's shapes and dtypes only: `jax.ShapeDtypeStruct`s, no weights made)."""
    validate(cfg)
    try:
        mesh = None if cfg.mesh is None else make_mesh(cfg.mesh)  # checks the device count before any work
    except ValueError as err:
        raise ConfigError(str(err)) from None
    dataset = load_corpus(cfg.data, data_format=cfg.data_format, tokenizer=cfg.tokenizer, vocab_size=cfg.vocab_size,
                          seq_len=cfg.seq_len, bpe_dir=Path(cfg.workdir) / BPE_DIR, token_dtype=cfg.token_dtype)
    policy = make_policy(cfg.precision)
    model_cfg = model_config(cfg, dataset.vocab_size, fp8=uses_fp8(policy))
    model = TransformerLM(model_cfg)
    if cfg.dry_run:  # shapes and dtypes only (`jax.ShapeDtypeStruct`s): nothing allocated
        state = abstract_state(jax.eval_shape(lambda: initial_state(cfg, model_cfg, policy)), mesh)
    else:
        state = initial_state(cfg, model_cfg, policy)
    if mesh is not None and not cfg.dry_run:
        state = shard_state(state, mesh)  # every leaf a global array: params/opt_state by the FSDP rule
    loss_fn = make_loss_fn(model)

    def step_with_lr(state, batch):
        state, metrics = train_step(state, batch, loss_fn, accum_steps=cfg.accum_steps, on_overflow=cfg.on_overflow,
                                    max_retries=cfg.max_retries, underflow_stats=cfg.underflow_stats)
        return state, {**metrics, "lr": jnp.copy(applied_lr(state.opt_state))}  # own buffer: state is donated

    step_fn = jax.jit(step_with_lr, donate_argnums=0)
    eval_fn = jax.jit(lambda s, b: eval_step(s, b, loss_fn)["loss"])
    # FP8: the float32 reference bypasses the FP8 ops (the same model without them; grad_fidelity does it). Keys as in
    # the other precisions: an FP8 state's params are the variables dict, its paths start with "params/".
    fidelity_fn = jax.jit(lambda s, b: {k.removeprefix("params/") if model_cfg.fp8 else k: v for k, v in
                                        grad_fidelity(s, b, loss_fn, accum_steps=cfg.accum_steps).items()})
    if mesh is not None:  # shardings pinned: a step's output feeds the next one (and a restore) with no recompile
        step_fn = jit_train_step(step_with_lr, mesh)
        eval_fn = jit_eval_step(lambda s, b: eval_step(s, b, loss_fn)["loss"], mesh)
    val = eval_batches(dataset.val, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                       num_batches=cfg.eval_batches, seed=cfg.seed, vocab_size=dataset.vocab_size)
    val = [device_batch(mesh, b) for b in val]
    return Run(cfg, dataset, model, state, step_fn, eval_fn, val, dataset.sha256, mesh, fidelity_fn)


def step_costs(run: Run) -> dict:
    """The training step compiled for this backend on the run's shapes (nothing run): `seconds` to trace, lower
    and compile; `flops` per step (XLA's cost analysis); `argument_bytes` (weights, optimizer state, batch),
    `temp_bytes` (activations, gradients, XLA's scratch) and `output_bytes` less the donated state's aliased
    buffers (XLA's memory analysis). On a GPU, XLA fuses otherwise: the CPU's figures are estimates for it."""
    rows = run.cfg.batch_size * run.cfg.accum_steps
    tokens = jax.ShapeDtypeStruct((rows, run.cfg.seq_len), jnp.int32)  # i32[batch * accum_steps, seq]
    t0 = time.perf_counter()
    compiled = run.step_fn.lower(run.state, (tokens, tokens)).compile()
    seconds = time.perf_counter() - t0
    cost, memory = compiled.cost_analysis(), compiled.memory_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost  # a list of one dict in older jax
    return {"seconds": seconds, "flops": float((cost or {}).get("flops", 0.0)),
            "argument_bytes": int(memory.argument_size_in_bytes), "temp_bytes": int(memory.temp_size_in_bytes),
            "output_bytes": int(memory.output_size_in_bytes - memory.alias_size_in_bytes)}


def device_batch(mesh, batch):
    """A whole host batch as is (one device), or as global arrays sharded over `mesh` (this process's rows only)."""
    if mesh is None:
        return batch
    rows = len(jax.tree.leaves(batch)[0])
    return make_global_batch(lambda a, z: jax.tree.map(lambda x: x[a:z], batch), rows, mesh)


def train_batch(run: Run, step: int):
    """The global training batch of step `step`; with a mesh, each process gathers only its own rows."""
    cfg, rows = run.cfg, run.cfg.batch_size * run.cfg.accum_steps  # accum_steps micro-batches, split in the step
    vocab = run.dataset.vocab_size
    if run.mesh is None:
        return batch_at(run.dataset.train, seed=cfg.seed, step=step, batch_size=rows, seq_len=cfg.seq_len,
                        vocab_size=vocab)
    return make_global_batch(lambda a, z: batch_at(run.dataset.train, seed=cfg.seed, step=step, batch_size=rows,
                                                   seq_len=cfg.seq_len, rows=slice(a, z), vocab_size=vocab),
                             rows, run.mesh)


def evaluate(run: Run, state: TrainState) -> float:
    """Mean validation loss over the run's fixed validation batches (nats per token)."""
    losses = [run.eval_fn(state, batch) for batch in run.val_batches]
    return float(np.mean(jax.device_get(losses)))


def sample_text(run: Run, state: TrainState) -> str:
    tok = run.dataset.tokenizer
    host = state if run.mesh is None else state.replace(params=gather_to_host(state.params))
    ids = generate(run.model, lm_variables(host.compute_params()), sample_prompt(tok), run.cfg.sample_tokens,
                   jax.random.PRNGKey(run.cfg.seed))
    return decode_sample(tok, ids)
