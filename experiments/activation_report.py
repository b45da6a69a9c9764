"""Per-layer activation ranges of the jaxamp LM in float32, and whether float16 or bfloat16 would hold them.

    python experiments/activation_report.py --data ../shared/data/tinyshakespeare.txt          # fresh init
    python experiments/activation_report.py --checkpoint-workdir runs/fp32                     # trained params

Runs `--batches` validation batches through the model in float32 with every layer's output captured and prints,
per layer, the largest |activation| and the share of values that float16 / bfloat16 would overflow, flush to zero
or hold only as subnormals, then the recommended policy with a one-line reason. With `--checkpoint-workdir` the
model's sizes (and the data, unless `--data` is given) come from the newest checkpoint of that jaxamp run
(`experiments/train_lm.py --workdir ...`) and its trained float32 master weights are used; otherwise the model is
freshly initialised with the size flags. The computation is `jaxamp.diagnostics.activation_ranges`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# Settings a trained checkpoint must share with the model built here (the state's shapes depend on them).
_MATCH_KEYS = ("corpus_sha256", "vocab_size", "layers", "heads", "width", "seq_len")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None,
                   help="UTF-8 text file (default: the checkpoint's, else the Python standard library's sources)")
    p.add_argument("--layers", type=int, default=None, help="Transformer blocks (default 4, or the checkpoint's)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 4, or the checkpoint's)")
    p.add_argument("--width", type=int, default=None, help="model width (default 128, or the checkpoint's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 64, or the checkpoint's)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per batch (default 12, or the checkpoint's)")
    p.add_argument("--batches", type=int, default=4, help="validation batches (default: %(default)s)")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                   help="biases in Dense and LayerNorm layers (default: TrainConfig's, or the checkpoint's; pass "
                        "--bias for checkpoints saved before the option existed, when biases were always on)")
    p.add_argument("--seed", type=int, default=None, help="seed of the init and batches (default 1337)")
    p.add_argument("--checkpoint-workdir", type=Path, default=None,
                   help="a jaxamp run's --workdir: use the trained params of its newest usable checkpoint")
    p.add_argument("--out", type=Path, default=None, help="also write the report (markdown) to this file")
    args = p.parse_args(argv)
    if args.batches < 1:
        p.error("--batches must be >= 1")
    if args.out is not None:
        from jaxamp.lm.cli import check_output  # pylint: disable=import-outside-toplevel

        check_output(p, "--out", args.out)
    return args


def _saved_config(ckpt_dir: Path) -> dict:
    """The run config stored with the newest checkpoint whose config item reads back (JSON only, no arrays)."""
    import orbax.checkpoint as ocp

    from jaxamp.checkpoint import Checkpointer, CheckpointError

    steps = Checkpointer(ckpt_dir).steps()
    if not steps:
        raise CheckpointError(f"no checkpoint in {ckpt_dir}; pass the --workdir of a jaxamp training run")
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, enable_async_checkpointing=False)
    reasons = []
    for step in reversed(steps):
        manager = ocp.CheckpointManager(ckpt_dir, options=options, item_names=("state", "config", "integrity"))
        try:
            config = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
            if isinstance(config, dict):
                return config
            reasons.append(f"step {step}: no config")
        except Exception as err:  # noqa: BLE001 - orbax raises anything; the restore below names the problem
            reasons.append(f"step {step}: {type(err).__name__}")
        finally:
            manager.close()
    raise CheckpointError(f"no readable checkpoint config in {ckpt_dir} ({'; '.join(reasons)})")


def load(args: argparse.Namespace):
    """`(run, state, source)`: the built run (`jaxamp.lm.setup.build`), the state to inspect and where it came from."""
    import jax

    from jaxamp.checkpoint import Checkpointer
    from jaxamp.lm.config import TrainConfig
    from jaxamp.lm.setup import build

    sizes = {"layers": args.layers, "heads": args.heads, "width": args.width, "seq_len": args.seq_len,
             "seed": args.seed, "data": args.data, "batch_size": args.batch_size, "bias": args.bias}
    common = {"eval_batches": args.batches, "sample_tokens": 0}
    if args.checkpoint_workdir is None:
        cfg = TrainConfig(precision="fp32", **{k: v for k, v in sizes.items() if v is not None}, **common)
        run = build(cfg)
        return run, run.state, "fresh initialisation"
    ckpt_dir = args.checkpoint_workdir / "checkpoints"
    saved = _saved_config(ckpt_dir)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    missing = sorted(fields - set(saved) - {"workdir", "progress"})
    if missing:  # saved by an older jaxamp: the current defaults may not be what that run used
        print(f"note: the checkpoint's config has no {', '.join(missing)}; using the current defaults",
              file=sys.stderr)
    cfg = TrainConfig(**{k: v for k, v in saved.items() if k in fields})
    overrides = {k: v for k, v in sizes.items() if v is not None}
    cfg = dataclasses.replace(cfg, **overrides, **common)
    run = build(cfg)  # the state's structure (loss scale, optimizer) follows the saved precision and options
    state, _ = Checkpointer(ckpt_dir).restore(jax.eval_shape(lambda: run.state), run.run_config(),
                                              match_keys=_MATCH_KEYS)
    return run, state, f"checkpoint step {int(state.step)} of {args.checkpoint_workdir}"


def report_text(run, report, recommendation, source: str, num_batches: int) -> str:
    from jaxamp.diagnostics import format_activation_table
    from jaxamp.fp8_collection import split_fp8
    from jaxamp.lm.model import count_params

    cfg = run.cfg
    name, reason = recommendation
    return "\n".join([
        f"# Activation ranges (float32): {cfg.layers} layers, {cfg.heads} heads, width {cfg.width}, seq "
        f"{cfg.seq_len}, {count_params(split_fp8(run.state.params)[0]):,} parameters",
        "",
        f"Params: {source}. Data: `{cfg.data or 'Python stdlib sources'}`, {num_batches} validation batches of "
        f"{cfg.batch_size} sequences. Percentages are of each layer's output elements; 'flush to 0': would round to "
        f"exactly 0; 'below normal': nonzero and below the format's smallest normal (subnormal or 0).",
        "",
        format_activation_table(report),
        "",
        f"Recommendation: **{name}** -- {reason}",
        "",
    ])


def fp8_text(run, state) -> str:
    """The FP8 ops' tensors of the first validation batch against their delayed scales (`fp8_ranges`)."""
    from jaxamp.fp8_report import format_fp8_table, fp8_ranges
    from jaxamp.lm.setup import make_loss_fn

    rows = fp8_ranges(state, run.val_batches[0], make_loss_fn(run.model))
    return ("\n## FP8 tensors against their current scales (first validation batch)\n\n"
            "e4m3 (inputs, kernels) holds |x / scale| up to 448, e5m2 (output gradients) up to 57344; the scale is "
            "max(amax history) / format max. 'amax / capacity' above 1 saturates.\n\n" + format_fp8_table(rows))


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxamp.checkpoint import CheckpointError
    from jaxamp.diagnostics import activation_ranges, recommend_policy
    from jaxamp.fp8_collection import FP8_COLLECTION
    from jaxamp.lm.config import ConfigError
    from jaxamp.lm.data import DataError

    try:
        run, state, source = load(args)
    except (ConfigError, DataError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = activation_ranges(run.model, state.params, list(run.val_batches))
    text = report_text(run, report, recommend_policy(report), source, len(run.val_batches))
    if FP8_COLLECTION in state.params:  # an fp8 run: its FP8 tensors against their current scales, too
        text += fp8_text(run, state)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
