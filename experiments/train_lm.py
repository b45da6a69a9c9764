"""Train the jaxamp Transformer LM on text (characters or a local BPE) or nanoGPT token files: fp32, bf16, fp16, fp8.

    python experiments/train_lm.py                                   # Python stdlib sources, fp32, nanoGPT CPU recipe
    python experiments/train_lm.py --data ../shared/data/tinyshakespeare.txt --precision fp16 --workdir runs/fp16
    python experiments/train_lm.py --data ../shared/data/tinyshakespeare.txt --tokenizer bpe --vocab-size 1024
    python experiments/train_lm.py --data nanoGPT/data/openwebtext --model gpt2-124m --precision bf16
    python experiments/train_lm.py --mesh data=8 --batch-size 96                # 8 devices, data parallel

Parses flags and delegates to `jaxamp.lm.train.train`; every flag is a field of `jaxamp.lm.config.TrainConfig`.
"""

from __future__ import annotations

import os
import signal

INTERRUPTED = (b"error: interrupted by SIGINT outside the training loop (nothing is half-written); run the same "
               b"command to start or resume\n")


def _exit_on_sigint(signum, frame) -> None:
    """SIGINT outside the training loop (imports, data, model build, workdir checks): exit at once, one line.

    Python's KeyboardInterrupt can land inside an import of a compiled extension (a segfault) or a garbage-collector
    callback (printed, swallowed, and the run goes on). Nothing has been written yet, so exiting is safe; the loop
    installs its own handler (finish the step, save, exit 0) while it runs.
    """
    del signum, frame
    os.write(2, INTERRUPTED)
    os._exit(130)


if __name__ == "__main__":  # first thing, before the imports (main() installs it too, for in-process callers)
    signal.signal(signal.SIGINT, _exit_on_sigint)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

HELP = {
    "data": "UTF-8 text file, or a directory holding nanoGPT's train.bin and val.bin (uint16 token ids, read by "
            "memmap) and optionally meta.pkl (default: the Python standard library's own sources, no download)",
    "data_format": "how --data is read: auto (a directory: tokens, anything else: text) | text (a UTF-8 file) | "
                   "tokens (a directory of nanoGPT's train.bin/val.bin)",
    "token_dtype": "token files' ids: auto (nanoGPT's uint16; a file that looks like uint32 ids, or a meta.pkl "
                   "vocab_size above 65536, is refused naming the fix) | uint16 | uint32 (vocabularies above 65535); "
                   "not a resume setting: a uint32 file's corpus checksum names its dtype",
    "tokenizer": "for a text file: char (one token per character) | bpe (byte-level BPE trained on the training "
                 "split with Hugging Face tokenizers, kept in WORKDIR/tokenizer; needs --vocab-size)",
    "vocab_size": "vocabulary size = embedding rows (bpe: the size to train, 256-65536; token files: default "
                  "meta.pkl's, else GPT-2's 50304; characters: default the distinct characters)",
    "model": "model size preset: small (4 layers, 4 heads, width 128, seq 64) | gpt2-124m (12, 12, 768, 1024) | "
             "gpt2-medium (24, 16, 1024, 1024) | gpt2-xl (48, 25, 1600, 1024; 1.56B parameters); "
             "--layers/--heads/--width/--seq-len override it",
    "precision": "fp32 | bf16 | fp16 | fp8 (bf16 compute, Dense matmuls in FP8 with delayed scaling) | fp8-current "
                 "| fp8-current-pow2 | fp8-block | mxfp8 (stateless FP8 recipes: the model under autocast, its "
                 "Dense matmuls in FP8, the head bf16) | auto (bf16 on TPUs and GPUs of compute capability >= 8.0, "
                 "fp16 on 7.x, fp32 on older GPUs and CPUs) | a jmp policy string such as 'p=f32,c=f16,o=f32'; "
                 "rules may follow: ';autocast', ';opt_state=bf16' (Adam moments in bfloat16), ';keep_float32=...' "
                 "(docs/guide/policies.md); may change between fp32, bf16 and fp16 on resume (the loss scale is "
                 "then made anew)",
    "loss_scale": "auto (dynamic for float16 compute, else none) | dynamic | static | none",
    "init_scale": "initial dynamic (or fixed static) loss scale",
    "growth_interval": "finite steps before the dynamic loss scale grows",
    "layers": "Transformer blocks", "heads": "attention heads", "width": "model width (channels)",
    "seq_len": "tokens per sequence", "batch_size": "sequences per step", "steps": "optimizer steps",
    "lr": "peak learning rate (linear warmup, then cosine decay)", "min_lr": "final learning rate (default lr/10)",
    "bias": "biases in Dense and LayerNorm layers (nanoGPT's default: off)", "warmup_steps": "warmup steps",
    "decay_steps": "steps of warmup + cosine decay (default: --steps)", "weight_decay": "AdamW weight decay",
    "beta1": "Adam beta1",
    "beta2": "Adam beta2", "grad_clip": "max global gradient norm, unscaled (0 = off)", "dropout": "dropout rate",
    "eval_every": "steps between validation losses", "eval_batches": "batches per validation loss",
    "log_every": "steps between metric fetches", "sample_tokens": "tokens sampled (and decoded) at the end",
    "seed": "seed of the data order, init and dropout", "workdir": "output directory (metrics.jsonl, summary.json)",
    "progress": "show a progress bar (default: on a terminal only)",
    "checkpoint_every": "steps between checkpoints (also saved at the end and on SIGTERM/SIGINT)",
    "keep": "checkpoints kept (newest)",
    "accum_steps": "micro-batches of --batch-size sequences per optimizer step (float32 gradient accumulation)",
    "on_overflow": "skip (drop the update, back off) | retry (back off and recompute the same batch)",
    "max_retries": "retries per step with --on-overflow retry",
    "underflow_stats": "log the gradients' zero fraction and the loss scale's headroom each step",
    "fp8_amax_history": "steps of amax history per FP8 tensor (--precision fp8)",
    "loss_chunk": "tokens per block of the fused output head + cross-entropy, which never holds the whole float32 "
                  "logits (0 = compute them whole); same loss to float32 rounding; may change on resume",
    "scan_layers": "run the blocks as one nn.scan over parameters stacked on a layer axis: one block compiled for "
                   "all layers, so compile time stops growing with depth; same initial weights and losses (to "
                   "float32 rounding) as unrolled; a checkpoint of either layout resumes in the other (converted)",
    "remat": "rematerialise each block in the backward pass (less activation memory, more compute; same math, "
             "may change on resume): none | full (recompute the whole block) | dots (keep every matmul output, "
             "jax.checkpoint_policies.dots_saveable) | dots_with_no_batch_dims (keep the Dense outputs, recompute "
             "the attention core: dots_with_no_batch_dims_saveable) | elementwise (keep every output but the "
             "elementwise ops': no matmul or attention recomputed; jaxamp.remat.recompute_elementwise)",
    "fidelity_every": "steps between gradient-fidelity checks: each leaf's relative error against a float32 "
                      "recomputation of the same batch, as grad_rel_err in metrics.jsonl (0 = off)",
    "max_consecutive_skips": "stop, after saving, when this many steps in a row overflow (or 10 at the minimum "
                             "loss scale); checked at each metrics fetch (--log-every)",
    "mesh": "devices as 'data=N' (data parallel) or 'data=N,fsdp=M' (params and optimizer state sharded too); "
            "N*M = all devices of all processes; --batch-size is then the global batch",
    "coordinator": "HOST:PORT of process 0 for jax.distributed (several processes; or JAX_COORDINATOR_ADDRESS)",
    "num_processes": "number of processes (or JAX_NUM_PROCESSES)",
    "process_id": "this process's index, 0 .. num_processes-1 (or JAX_PROCESS_ID)",
    "dry_run": "print the parameter count, bytes per parameter, the precision audit and the compiled step's "
               "FLOPs and memory (XLA's analyses, for this backend) without making the weights or training; "
               "the workdir is not touched",
}


def parse_args(argv=None):
    from jaxamp.lm.config import TrainConfig
    from jaxamp.lm.presets import PRESET_FIELDS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        text = HELP.get(field.name, field.name.replace("_", " "))
        if str(field.type).startswith("bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=text)
            continue
        kind = {"int": int, "float": float}.get(str(field.type).split(" ")[0], str)
        default = "the --model preset's" if field.name in PRESET_FIELDS else "%(default)s"
        parser.add_argument(flag, type=kind, default=field.default, help=f"{text} (default: {default})")
    return TrainConfig(**vars(parser.parse_args(argv)))


def main(argv=None) -> int:
    """Runs the CLI; returns the exit status (0; 2 for bad input or a workdir that cannot be written; 3 when
    training diverged; 130, at once, for SIGINT outside the training loop)."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _exit_on_sigint) if main_thread else None
    previous_format, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        return _run(argv)
    finally:
        warnings.formatwarning = previous_format
        if main_thread:
            signal.signal(signal.SIGINT, previous)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Warnings (e.g. a damaged checkpoint step set aside) as one line each, without the source line Python adds."""
    del category, filename, lineno, line
    return f"warning: {message}\n"


def _run(argv) -> int:
    from jaxamp.checkpoint import CheckpointError
    from jaxamp.lm.config import ConfigError
    from jaxamp.lm.data import DataError
    from jaxamp.lm.stopping import DivergenceError
    from jaxamp.lm.train import train
    from jaxamp.lm.workdir import WorkdirWriteError

    cfg = parse_args(argv)
    try:
        train(cfg)
    except (ConfigError, DataError, CheckpointError, WorkdirWriteError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except DivergenceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
