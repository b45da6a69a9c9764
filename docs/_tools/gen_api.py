"""Writes docs/api/*.rst, one page per public module (run by hand when a module or its __all__ changes; the pages are
committed, and tests/test_docs.py checks that every public name reaches the built reference).

Names re-exported by `jaxamp` (and `jaxamp.nnx`'s FP8 layers) are documented once, where most code imports them; the
defining module's page names them (classes: Sphinx's canonical alias; functions and data: a short entry linking
there). Module data (constants) are listed with `autodata`.
"""

import importlib
import inspect
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODULES = {
    "jaxamp": "the names most programs need",
    "jaxamp.loss_scale": "loss scales and their registry",
    "jaxamp.precision": "precision policies",
    "jaxamp.state": "the training state",
    "jaxamp.opt_state": "optimizer state in bfloat16",
    "jaxamp.step": "the train and eval steps",
    "jaxamp.autocasting": "autocast: mixed precision for any JAX code",
    "jaxamp.autocast_rules": "autocast's op classes and per-primitive rules",
    "jaxamp.audit": "the precision audit",
    "jaxamp.gradients": "steps 1 to 5 of the train step",
    "jaxamp.finite": "the one finite check",
    "jaxamp.metrics": "the step's metrics",
    "jaxamp.trainable": "frozen and trainable leaves",
    "jaxamp.fp8_collection": "the FP8 collection's rules",
    "jaxamp.fp8_recipes": "stateless FP8 recipes: current, block and MXFP8 scaling",
    "jaxamp.fp8_grouped": "grouped FP8 matmuls: an MoE's lax.ragged_dot under current scaling",
    "jaxamp.fp8_quant": "FP8 quantizers",
    "jaxamp.fidelity": "gradient fidelity against float32",
    "jaxamp.diagnostics": "activation ranges and gradient underflow",
    "jaxamp.fp8_report": "FP8 ranges",
    "jaxamp.grad_stats": "overflowed leaves and underflow",
    "jaxamp.layers": "layers whose gradient sums stay float32",
    "jaxamp.attention": "attention as a float32 island (cuDNN's fused kernel in half precision)",
    "jaxamp.remat": "a rematerialisation policy for mixed-precision blocks",
    "jaxamp.nnx": "Flax NNX models",
    "jaxamp.nnx_fp8": "FP8 layers for Flax NNX",
    "jaxamp.sharding": "meshes, sharded states and steps, several processes",
    "jaxamp.checkpoint": "checkpoints with integrity checks",
}
PRIMARY = ("jaxamp", "jaxamp.nnx")  # their re-exports are documented there
# Module data have no docstrings of their own: their descriptions (from the comments beside them in the source).
DATA_DOCS = {
    "PRESETS": "The named policies of ``get_policy`` (``fp32``, ``bf16``, ``fp16``, ``fp8``, ...), by name.",
    "LOSS_SCALES": "The registry: every loss-scale type by its class name (checkpoint records name the type).",
    "LossFn": "``loss_fn(params, batch, rng) -> loss`` or ``(loss, aux)``: the loss function ``train_step`` takes.",
    "STEP_METRICS": "Every key of the step's metrics: ``{key: (shape and dtype, meaning)}``.",
    "FP8_COLLECTION": "The collection in which Flax's FP8 ops keep their scales and amax histories; the "
                      "\"gradient\" of each is its new value.",
    "FORMATS": "``float16`` and ``bfloat16`` as ``FloatFormat``\\ s: their range and rounding thresholds.",
    "LOG2_BINS": "Histogram bins: bin ``i`` holds nonzero ``|g|`` in ``[2^(LOG2_BINS[i]), 2^(LOG2_BINS[i] + 1))``; "
                 "the first and last bins also take everything below / above them.",
    "FP8_FORMATS": "The FP8 formats (``e4m3``, ``e5m2`` and AMD's ``fnuz`` forms) as ``FloatFormat``\\ s.",
    "AXES": "The mesh's axis names, in order.",
    "MATMUL_OPS": "Autocast's matmul class: operands in the compute dtype, result in it.",
    "FLOAT32_OPS": "Autocast's float32 class: inputs cast to float32, result float32.",
    "WIDEST_OPS": "Autocast's widest class: floating inputs cast to the widest of them.",
    "PASSTHROUGH_OPS": "Primitives autocast binds with their operands as they are.",
    "ABSORB_LIMIT": "Values a running sum in each half-precision format absorbs before the next ones round away.",
    "NEAR_ZERO": "A leaf whose float32 gradient RMS is below this fraction of the whole gradient's counts as near "
                 "zero.",
    "RECIPES": "The stateless FP8 recipes by name (``current``, ``block``, ``mxfp8``).",
    "FP8_RECIPE_SPECS": "The policy specs of the stateless FP8 recipes (``fp8-current``, ``fp8-block``, ``mxfp8``) "
                        "and the recipe each names.",
    "FP8_EXCLUDE": "The default ``fp8_exclude`` of ``autocast``: regular expressions over module names, param "
                   "paths and function names whose matmuls keep the compute dtype (the output head, an MoE's router).",
    "FLOAT32_RESULTS": "The default ``float32_results`` of ``autocast``: the output head and an MoE's router by "
                       "``FP8_EXCLUDE``'s names, whose matmuls write float32 logits from compute-dtype operands.",
    "FP8_SCOPE": "The prefix of the name scope around an FP8 matmul, which the precision audit reads.",
    "MX_KERNEL_ENV": "The environment variable that picks the ``mxfp8`` path: ``jax`` "
                     "(``jax.nn.scaled_dot_general``), ``numerics``, or unset (``scaled_dot_general`` on Blackwell "
                     "GPUs); see ``mx_kernel``.",
    "WEIGHT_SCOPE": "The name-scope prefix autocast puts around a matmul with a param operand "
                    "(``jaxamp_weight:<path>``), which ``fp8_exclude`` and the precision audit read.",
    "E4M3": "``jnp.float8_e4m3fn``: inputs and weights (largest 448).",
    "E5M2": "``jnp.float8_e5m2``: output gradients of current scaling (largest 57344).",
    "FP8_MAX": "The largest finite value of each FP8 format.",
    "MX_BLOCK": "Elements per MXFP8 scale block along the contraction dimension (32).",
    "MX_TILE": "The MXFP8 tile: one row by 32 elements.",
    "ROW_TILE": "Block scaling's activation and gradient tile: one row by 128 elements.",
    "WEIGHT_TILE": "Block scaling's weight tile: 128 by 128 elements.",
    "FP8_OUTPUT_NAME": "The ``checkpoint_name`` of a stateless FP8 matmul's output in the compute dtype, which "
                       "``recompute_elementwise`` saves instead of the float32 dot before its scales.",
    "ELEMENTWISE": "The primitives ``recompute_elementwise`` recomputes in the backward pass: elementwise arithmetic "
                   "and functions, converts, comparisons, selects and data movement.",
    "ATTENTION_JIT_NAMES": "The names of ``dot_product_attention``'s jits (``jaxamp_attention``, "
                           "``jaxamp_causal_attention``) and whether each is causal: what ``autocast`` looks for to "
                           "run the call as cuDNN's fused attention in the compute dtype.",
}


def _is_data(obj) -> bool:
    return not (inspect.isclass(obj) or inspect.isroutine(obj))


def page(name: str, title: str, home: dict) -> str:
    mod = importlib.import_module(name)
    head = f"``{name}``: {title}"
    elsewhere = [n for n in mod.__all__ if home.get(id(getattr(mod, n)), f"{name}.{n}") != f"{name}.{n}"]
    data = [n for n in mod.__all__ if n not in elsewhere and _is_data(getattr(mod, n))]
    lines = [head, "=" * len(head), "", f".. automodule:: {name}"]
    if elsewhere or data:
        lines.append(f"   :exclude-members: {', '.join(elsewhere + data)}")
    for n in data:
        short = len(repr(getattr(mod, n))) <= 100
        lines += ["", f".. autodata:: {n}"] + ([] if short else ["   :no-value:"]) + ["", f"   {DATA_DOCS[n]}"]
    if elsewhere:
        lines += ["", "Also in this module's ``__all__``, documented where most code imports them:", ""]
        # autodoc registers a class's defining module as its canonical alias; a class defined in another module
        # gets an entry of its own here, as functions and data do
        aliased = {n for n in elsewhere if inspect.isclass(getattr(mod, n)) and getattr(mod, n).__module__ == name}
        for n in elsewhere:
            if n in aliased:
                lines.append(f"- :py:class:`{home[id(getattr(mod, n))]}`")
        for n in elsewhere:
            obj, where = getattr(mod, n), home[id(getattr(mod, n))]
            if n in aliased:
                continue
            directive, role = (("class", "class") if inspect.isclass(obj) else ("function", "func") if callable(obj)
                               else ("data", "data"))
            kind = {"class": "class", "function": "function"}.get(directive, "object")
            lines += ["", f".. py:{directive}:: {n}" + ("(...)" if directive == "function" else ""), "",
                      f"   The same {kind} as :py:{role}:`{where}`."]
    return "\n".join(lines) + "\n"


def main() -> None:
    home = {}
    for primary in PRIMARY:
        mod = importlib.import_module(primary)
        for n in mod.__all__:
            home.setdefault(id(getattr(mod, n)), f"{primary}.{n}")
    out = ROOT / "docs" / "api"
    for name, title in MODULES.items():
        (out / f"{name}.rst").write_text(page(name, title, home), encoding="utf-8")


if __name__ == "__main__":
    main()
