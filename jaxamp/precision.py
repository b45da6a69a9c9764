"""Precision policies: which dtype each tensor is stored, computed and returned in.

A policy is a `jmp.Policy` (params, compute and output dtypes). jaxamp adds three presets that name the usual
mixed-precision set-ups; every jmp policy string is accepted as well.

| preset | params (master weights) | compute | output |
| --- | --- | --- | --- |
| `"fp32"` | float32 | float32 | float32 |
| `"bf16"` | float32 | bfloat16 | float32 |
| `"fp16"` | float32 | float16 | float32 |

A per-leaf rule, `keep_float32`, names leaves that stay float32 in the compute copy (e.g. embedding tables, whose
lookups must accumulate their gradient in float32: see `jaxamp.layers`).
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from typing import Any

import jax
import jax.numpy as jnp
import jmp

from jaxamp.autocasting import FLOAT32_RESULTS
from jaxamp.fp8_recipes import FP8_EXCLUDE, RECIPES

PyTree = Any

__all__ = ["FP8_RECIPE_SPECS", "PRESETS", "Policy", "auto_precision", "fp8_recipe", "get_policy", "keep_matches",
           "leaf_path", "needs_loss_scaling", "opt_state_dtype", "policy_name", "split_patterns", "uses_autocast",
           "uses_fp8"]


def leaf_path(path) -> str:
    """A `tree_flatten_with_path` path as `"a/b/0"`, the form `keep_float32` and `trainable` patterns match."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def keep_matches(path: str, patterns) -> bool:
    """Whether `path` (a `leaf_path`) matches one of the `keep_float32` `fnmatch` patterns, as it is or without a
    box's trailing `/value`."""
    paths = (path, path[: -len("/value")]) if path.endswith("/value") else (path,)
    return any(fnmatch.fnmatchcase(p, pattern) for p in paths for pattern in patterns)


def _patterns(keep_float32) -> tuple[str, ...]:
    """`keep_float32` as a tuple; raises ValueError unless it is a sequence of non-empty strings."""
    if isinstance(keep_float32, str) or not all(isinstance(p, str) and p for p in keep_float32):
        raise ValueError(f"keep_float32 must be a sequence of fnmatch patterns such as ('*/embedding',), got "
                         f"{keep_float32!r}")
    return tuple(keep_float32)


@dataclasses.dataclass(frozen=True)
class Policy(jmp.Policy):
    """A jmp policy with two jaxamp rules: leaves that stay float32 in the compute copy, and FP8 matmuls.

    `cast_to_compute(params)` casts every floating leaf to `compute_dtype` except those whose path (`leaf_path`, e.g.
    `"wte/embedding"`) matches one of the `keep_float32` `fnmatch` patterns: those are cast to float32.
    `cast_to_param` and `cast_to_output` are jmp's. The rule exists for gathered rows: a lookup `table[ids]` into a
    half-precision table differentiates into a half-precision scatter-add, and a row looked up thousands of times in
    a batch stops absorbing contributions (bf16: once its sum is ~2^8 times one contribution). torch.amp never
    autocasts embeddings for the same reason. Keep the table float32 and cast the looked-up rows to the compute
    dtype in the model (`jaxamp.layers.embed_lookup` does both).

    `fp8` says that the model's Dense matmuls go through Flax's FP8 ops (e4m3 inputs and kernels, e5m2 output
    gradients, delayed per-tensor scaling: `jaxamp.layers.Dense(fp8=True)`); it changes no cast here. The `"fp8"`
    preset is float32 master weights, bfloat16 compute and FP8 matmuls.

    `autocast` says that the params are not cast at all: `loss_fn` receives the float32 master weights and runs under
    `jaxamp.autocast(loss_fn, compute_dtype)` (torch.amp's autocast: matmuls and convolutions in the
    compute dtype, exponentials, logarithms, norms, sums and losses in float32, everything else in the widest type
    of its inputs), so unchanged float32 model code computes in half precision with float32 sums.

    Build it with `get_policy(spec, keep_float32=("*embedding",))`, `get_policy("bf16", autocast=True)` or
    `get_policy("fp8")`; `policy_name` writes it as `"bf16;keep_float32=*embedding"`, `"bf16;autocast"`, `"fp8"` or
    `"fp16;fp8"`, which `get_policy` parses back.

    Attributes:
      keep_float32: `fnmatch` patterns over leaf paths, e.g. `("*/embedding",)` for every Flax `nn.Embed` table;
        `TrainState.create` and `with_policy` refuse a pattern that matches no leaf of their params.
      fp8: the model's Dense matmuls run in FP8 (a flag for the model; see `uses_fp8`).
      autocast: `loss_fn` runs under `jaxamp.autocast` on the uncast master weights (see `uses_autocast`).
      fp8_recipe: under autocast, the stateless FP8 recipe of the weight matmuls (`"current"`, `"block"`,
        `"mxfp8"`: `jaxamp.fp8_recipes`), or None. The `"fp8-current"`, `"fp8-block"` and `"mxfp8"` specs set it.
      fp8_exclude: regular expressions over module names whose matmuls stay in the compute dtype under
        `fp8_recipe` (`jaxamp.autocast`'s `fp8_exclude`; default the output head).
      opt_state_dtype: `"bfloat16"` or `"float16"`: `TrainState.create` stores the optax state's floating arrays
        (Adam's moments) in it (`jaxamp.opt_state.low_precision_state`: the update in float32, storage narrow), or
        None (float32). The `";opt_state=bf16"` rule sets it.
      float32_results: regular expressions over module names whose `dot_general` (or convolution) writes float32 under
        autocast (`jaxamp.autocast`'s `float32_results`; default the output head, so that logits stay float32).
        The `";float32_results=REGEX,REGEX"` rule replaces them, `";float32_results+=REGEX,REGEX"` adds to them;
        `";float32_results="` leaves none (torch.amp's bfloat16 logits). Independent of `fp8_exclude`, whose
        default names the same head: a pattern added to one is not added to the other.
    """

    keep_float32: tuple[str, ...] = ()
    fp8: bool = False
    # Not in the repr, which checkpoint records hold in their structure string: records written before the field
    # existed must keep matching. The policy's name (`policy_name`), recorded and compared too, says "autocast".
    autocast: bool = dataclasses.field(default=False, repr=False)
    fp8_recipe: str | None = dataclasses.field(default=None, repr=False)
    fp8_exclude: tuple[str, ...] = dataclasses.field(default=FP8_EXCLUDE, repr=False)
    opt_state_dtype: str | None = dataclasses.field(default=None, repr=False)
    float32_results: tuple[str, ...] = dataclasses.field(default=FLOAT32_RESULTS, repr=False)

    def __post_init__(self) -> None:
        # A string would be read as one pattern per character, and "*" keeps every leaf float32.
        object.__setattr__(self, "keep_float32", _patterns(self.keep_float32))

    def keeps(self, path: str) -> bool:
        """Whether the leaf at `path` (as `leaf_path` writes it) stays float32 in the compute copy. A boxed param
        (`nn.with_logical_partitioning`, `nn.Partitioned`: its path ends in `/value`) matches with or without
        that last part."""
        return keep_matches(path, self.keep_float32)

    def cast_to_compute(self, x: PyTree) -> PyTree:
        if self.autocast:  # the master weights as they are: autocast casts at each matmul
            return x
        if not self.keep_float32:
            return super().cast_to_compute(x)

        def cast(path, leaf):
            dtype = jnp.float32 if self.keeps(leaf_path(path)) else self.compute_dtype
            return leaf.astype(dtype) if jnp.issubdtype(jnp.result_type(leaf), jnp.floating) else leaf

        return jax.tree_util.tree_map_with_path(cast, x)

    def __str__(self) -> str:
        return policy_name(self)


PRESETS: dict[str, jmp.Policy] = {
    "fp32": jmp.Policy(jnp.float32, jnp.float32, jnp.float32),
    "bf16": jmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32),
    "fp16": jmp.Policy(jnp.float32, jnp.float16, jnp.float32),
    "fp8": Policy(jnp.float32, jnp.bfloat16, jnp.float32, fp8=True),
}

# Stateless FP8 recipes (jaxamp.fp8_recipes) as policies: float32 master weights, autocast with bfloat16 compute and
# the weight matmuls in FP8, no FP8 state (Transformer Engine's Float8CurrentScaling / Float8BlockScaling, MXFP8).
FP8_RECIPE_SPECS = {"fp8-current": "current", "fp8-current-pow2": "current-pow2", "fp8-block": "block",
                    "mxfp8": "mxfp8"}

_JMP_FORMS = ('"params=float32,compute=float16,output=float32"', '"p=f32,c=bf16"', 'a dtype name such as "float32"')
_RULES = ("';keep_float32=PATTERN,PATTERN', ';autocast', ';fp8', ';fp8=RECIPE' (current, current-pow2, block, mxfp8: "
          "autocast with stateless FP8 weight matmuls), ';fp8_exclude=REGEX,REGEX' (replaces the default "
          "exclusions) or ';fp8_exclude+=REGEX,REGEX' (adds to them), ';float32_results=REGEX,REGEX' (the matmuls "
          "that write float32 under autocast, replacing the default, the output head; empty: none) or "
          "';float32_results+=REGEX,REGEX' (adds to it) and ';opt_state=bf16' (or "
          "fp16: the optimizer state's dtype)")
_OPT_STATE_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


def get_policy(spec: str | jmp.Policy, *, keep_float32: tuple[str, ...] | list[str] = (),
               autocast: bool = False) -> jmp.Policy:
    """Returns the precision policy named by `spec`.

    Args:
      spec: a preset (`"fp32"`, `"bf16"`, `"fp16"`, `"fp8"`: delayed scaling through the model's FP8 ops), `"auto"` (see
        `auto_precision`), a stateless FP8 recipe (`"fp8-current"`, `"fp8-current-pow2"`, `"fp8-block"`, `"mxfp8"`: bf16
        autocast with the weight matmuls in FP8, `FP8_RECIPE_SPECS`), any policy string that `jmp.get_policy` parses
        (e.g. `"params=float32,compute=float16,output=float32"` or `"p=f32,c=bf16"`; jmp's rule applies: an unnamed
        output dtype follows the compute dtype), any of these followed by rules (what `policy_name` writes):
        `";autocast"`, `";keep_float32=PATTERN,PATTERN"`, `";fp8"` (delayed scaling), `";fp8=RECIPE"` (`current`,
        `current-pow2`, `block`, `mxfp8`), `";fp8_exclude=REGEX,REGEX"` (the matmuls a recipe leaves in the compute
        dtype, replacing the default, the output head's usual names `FP8_EXCLUDE`; commas inside a regex's (), [] or {}
        stay in it) or `";fp8_exclude+=REGEX,REGEX"` (added to the default), `";float32_results=REGEX,REGEX"`
        (the matmuls whose result autocast keeps float32, replacing the default, the output head; empty: none) or
        `";float32_results+=REGEX,REGEX"` (added to the default),
        `";opt_state=bf16"` (or `fp16`: the
        optimizer state's dtype); each rule at most once; or a `jmp.Policy`.
      keep_float32: `fnmatch` patterns of leaves that stay float32 in the compute copy (see `Policy`), added to
        those of `spec`.
      autocast: hand `loss_fn` the float32 master weights and run it under `jaxamp.autocast` with the compute dtype
        (recorded in the name: `"bf16;autocast"`); not with `keep_float32` (nothing is cast to keep).

    Returns:
      A `jmp.Policy` whose `cast_to_compute` casts the float32 master weights to the compute dtype: a `Policy`
      when a rule applies, else the plain jmp policy (a preset, or `spec` itself).

    Raises:
      ValueError: the name is neither a preset nor a jmp policy string, a rule is unknown (the message lists the
        accepted forms) or given twice, `keep_float32` is not a sequence of non-empty strings, or autocast is asked
        for with `keep_float32` or a float32 compute dtype.
    """
    _patterns(keep_float32)
    fp8, recipe, exclude, opt_dtype, results = False, None, None, None, None
    if isinstance(spec, str) and ";" in spec:
        spec, *rules = spec.split(";")
        _check_repeats(rules)
        for rule in (r.strip() for r in rules):
            name, _, patterns = rule.partition("=")
            if rule == "fp8":
                fp8 = True
            elif rule == "autocast":
                autocast = True
            elif name.strip() == "keep_float32" and patterns.strip():
                keep_float32 = (*[p.strip() for p in patterns.split(",") if p.strip()], *keep_float32)
            elif name.strip() == "fp8" and patterns.strip():
                recipe = _recipe_name(patterns.strip())
            elif name.strip() in ("fp8_exclude", "fp8_exclude+"):
                exclude = _read_patterns(name.strip(), patterns, FP8_EXCLUDE)
            elif name.strip() in ("float32_results", "float32_results+") and "=" in rule:
                results = _read_patterns(name.strip(), patterns, FLOAT32_RESULTS)
            elif name.strip() == "opt_state":
                if patterns.strip().lower() not in _OPT_STATE_DTYPES:
                    raise ValueError(f"';opt_state={patterns.strip()}': the optimizer state is stored in bf16 or "
                                     "fp16 (float32 is the default: leave the rule out)")
                opt_dtype = _OPT_STATE_DTYPES[patterns.strip().lower()]
            else:
                raise ValueError(f"unknown policy rule {rule!r}: the rules are {_RULES}")
    if isinstance(spec, str) and spec.strip().lower() in FP8_RECIPE_SPECS:
        recipe = recipe or FP8_RECIPE_SPECS[spec.strip().lower()]
        spec = "bf16"
    base = _base_policy(spec)
    keep = tuple(dict.fromkeys((*getattr(base, "keep_float32", ()), *keep_float32)))  # in order, once each
    fp8 = fp8 or getattr(base, "fp8", False)
    recipe = recipe or getattr(base, "fp8_recipe", None)
    autocast = bool(autocast or getattr(base, "autocast", False) or recipe)
    if autocast:
        _check_autocast(base, keep)
    if recipe and fp8:
        raise ValueError(f"';fp8' (delayed scaling through Flax's FP8 ops) and the stateless recipe {recipe!r} are "
                         "two FP8 schemes: pick one ('fp8' or 'fp8-current', 'fp8-block', 'mxfp8')")
    if exclude is not None and not recipe:
        raise ValueError("';fp8_exclude=...' names matmuls to keep out of a stateless FP8 recipe; add ';fp8=current' "
                         "(or use 'fp8-current', 'fp8-block', 'mxfp8')")
    if results is not None and not autocast:
        raise ValueError("';float32_results=...' names the matmuls whose result autocast keeps float32; add "
                         "';autocast' (e.g. 'bf16;autocast;float32_results=head$')")
    opt_dtype = opt_dtype or getattr(base, "opt_state_dtype", None)
    if not keep and not fp8 and not autocast and not opt_dtype:
        return base
    exclude = exclude if exclude is not None else getattr(base, "fp8_exclude", FP8_EXCLUDE)
    results = results if results is not None else getattr(base, "float32_results", FLOAT32_RESULTS)
    return Policy(base.param_dtype, base.compute_dtype, base.output_dtype, keep_float32=keep, fp8=fp8,
                  autocast=autocast, fp8_recipe=recipe, fp8_exclude=tuple(exclude), opt_state_dtype=opt_dtype,
                  float32_results=tuple(results))


def split_patterns(text: str) -> list[str]:
    """`"a,b{1,2},(c|d)"` -> `["a", "b{1,2}", "(c|d)"]`: splits at the commas outside (), [] and {} (a regex's own
    commas stay), as the `;fp8_exclude=` rule reads its patterns."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}" and depth > 0
        if ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    return [*out, text[start:]]


def _read_patterns(name: str, text: str, defaults: tuple[str, ...]) -> tuple[str, ...]:
    """The patterns of a `;NAME=REGEX,REGEX` rule (they replace `defaults`) or a `;NAME+=...` rule (`name` ends in
    "+": added to them)."""
    added = tuple(p.strip() for p in split_patterns(text) if p.strip())
    return (*defaults, *added) if name.endswith("+") else added


def _patterns_rule(name: str, patterns: tuple[str, ...], defaults: tuple[str, ...]) -> str:
    """How `policy_name` writes `patterns`: nothing for the defaults, `;NAME+=...` for the defaults and more (named
    by what was added), else `;NAME=...`."""
    if patterns == defaults:
        return ""
    if patterns[:len(defaults)] == defaults:
        return f";{name}+={','.join(patterns[len(defaults):])}"
    return f";{name}={','.join(patterns)}"


def _check_repeats(rules: list[str]) -> None:
    """A rule given twice (its second value would silently win) is refused, naming the fix."""
    seen: set[str] = set()
    for rule in rules:
        name = rule.strip().partition("=")[0].strip().rstrip("+")
        if name in seen:
            raise ValueError(f"policy rule ';{name}' is given twice: give it once (join patterns with commas; "
                             f"';fp8_exclude+=...' adds to the default exclusions)")
        seen.add(name)


def _recipe_name(name: str) -> str:
    if name not in RECIPES:
        close = difflib.get_close_matches(name, RECIPES, n=1)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown FP8 recipe {name!r} in ';fp8={name}'{guess}: the recipes are {', '.join(RECIPES)}")
    return name


def _check_autocast(base: jmp.Policy, keep: tuple) -> None:
    if keep:
        raise ValueError(f"autocast hands loss_fn the float32 master weights uncast, so keep_float32 {keep} has "
                         "nothing to keep: drop keep_float32 (autocast keeps lookups and sums float32 by itself)")
    if not jnp.issubdtype(base.compute_dtype, jnp.floating) or jnp.finfo(base.compute_dtype).bits >= 32:
        raise ValueError(f"autocast computes matmuls in a half-precision dtype, but this policy computes in "
                         f"{jnp.dtype(base.compute_dtype).name}: use 'bf16;autocast' or 'fp16;autocast'")


def uses_autocast(policy: jmp.Policy) -> bool:
    """Whether `policy` runs `loss_fn` under `jaxamp.autocast` (`get_policy(..., autocast=True)`, `";autocast"`)."""
    return bool(getattr(policy, "autocast", False))


def opt_state_dtype(policy: jmp.Policy) -> str | None:
    """The dtype name the optimizer state is stored in under `policy` (`"bfloat16"`, `"float16"`), or None."""
    return getattr(policy, "opt_state_dtype", None)


def fp8_recipe(policy: jmp.Policy) -> str | None:
    """The stateless FP8 recipe of `policy`'s weight matmuls under autocast (`"current"`, `"block"`, `"mxfp8"`), or
    None."""
    return getattr(policy, "fp8_recipe", None)


def uses_fp8(policy: jmp.Policy) -> bool:
    """Whether `policy` asks for FP8 matmuls (`get_policy("fp8")`, or a `";fp8"` rule)."""
    return bool(getattr(policy, "fp8", False))


def _base_policy(spec: str | jmp.Policy) -> jmp.Policy:
    """`get_policy` without the rules given after `;`."""
    if isinstance(spec, jmp.Policy):
        return spec
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        return PRESETS[auto_precision()[0]]
    if not isinstance(spec, str):
        raise ValueError(f"precision policy must be a string or jmp.Policy, got {type(spec).__name__}")
    name = spec.strip()
    if name.lower() in PRESETS:
        return PRESETS[name.lower()]
    try:
        return jmp.get_policy(name)
    except (ValueError, KeyError) as err:
        names = (*PRESETS, "auto", *FP8_RECIPE_SPECS)
        close = difflib.get_close_matches(name.lower(), names, n=1)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        accepted = ", ".join(f'"{p}"' for p in (*PRESETS, "auto"))
        recipes = ", ".join(f'"{p}"' for p in FP8_RECIPE_SPECS)
        if close:
            raise ValueError(f"unknown precision policy {spec!r}{guess}; the presets are {accepted} and the stateless "
                             f"FP8 recipes {recipes} (jmp policy strings and the ';' rules: get_policy's docstring)"
                             ) from None
        raise ValueError(
            f"unknown precision policy {spec!r}; accepted: the presets {accepted}, the stateless FP8 recipes "
            f"{recipes}, or a jmp policy string ({'; '.join(_JMP_FORMS)}), optionally followed by the rules "
            f"{_RULES} (jmp: {err})"
        ) from None


def policy_name(policy: jmp.Policy, *, rules: bool = True) -> str:
    """Returns the preset name of `policy` if it is one, else jmp's short form (e.g. `"p=f32,c=f16,o=f16"` for
    `get_policy("float16")`; jmp writes float32 as `full` in some forms); `"fp8"` or `";fp8"` for FP8 matmuls,
    `";autocast"` for autocast (both kept with `rules=False`: they change what computes in which precision); and
    `";keep_float32=..."` for that rule unless `rules=False`. `get_policy(policy_name(p)) == p`."""
    base = jmp.Policy(policy.param_dtype, policy.compute_dtype, policy.output_dtype)
    name = next((n for n, preset in PRESETS.items() if preset == base), str(base))
    if uses_fp8(policy):
        name = "fp8" if base == PRESETS["bf16"] else f"{name};fp8"
    recipe = fp8_recipe(policy)
    if recipe:
        spec = next((n for n, r in FP8_RECIPE_SPECS.items() if r == recipe), None)
        name = spec if base == PRESETS["bf16"] and spec else f"{name};autocast;fp8={recipe}"
        name += _patterns_rule("fp8_exclude", tuple(getattr(policy, "fp8_exclude", FP8_EXCLUDE)), FP8_EXCLUDE)
    elif uses_autocast(policy):
        name = f"{name};autocast"
    if uses_autocast(policy):
        results = tuple(getattr(policy, "float32_results", FLOAT32_RESULTS))
        name += _patterns_rule("float32_results", results, FLOAT32_RESULTS)
    if opt_state_dtype(policy):
        name = f"{name};opt_state={'bf16' if opt_state_dtype(policy) == 'bfloat16' else 'fp16'}"
    keep = getattr(policy, "keep_float32", ())
    return f"{name};keep_float32={','.join(keep)}" if rules and keep else name


def needs_loss_scaling(policy: jmp.Policy) -> bool:
    """True when the compute dtype is float16, whose narrow exponent range makes gradients underflow unscaled.

    bfloat16 shares float32's exponent range, so bf16 and fp32 policies train without a loss scale
    (Micikevicius et al., 2018; torch.amp recommends GradScaler for float16 only).
    """
    return jnp.dtype(policy.compute_dtype) == jnp.dtype(jnp.float16)


def _capability(device) -> tuple[int, int] | None:
    """A CUDA device's compute capability as `(major, minor)`, or None where the device does not say."""
    try:
        major, _, minor = str(getattr(device, "compute_capability", "")).partition(".")
        return int(major), int(minor or 0)
    except ValueError:
        return None


def auto_precision(device: jax.Device | None = None) -> tuple[str, str]:
    """Picks a preset for `device` (default: the first device) and says why.

    - bf16 where half precision is fast and needs no loss scale: GPUs of compute capability >= 8.0 (Ampere and
      newer), TPUs.
    - fp16 with dynamic loss scaling where only float16 is fast: compute capability 7.x (Volta and Turing tensor
      cores), and 6.0, 6.2 and 5.3 (P100 and Jetson chips: float16 at twice the float32 rate).
    - fp32 elsewhere: other Pascal and older GPUs (6.1's float16 runs at 1/64 of the float32 rate), GPUs that do not
      report a compute capability (e.g. ROCm; choose `--precision` yourself), and CPUs (XLA:CPU computes
      half-precision dots in float32, so there is nothing to gain).

    Returns:
      `(preset name, reason)`, e.g. `("fp32", "cpu: no fast half-precision matmuls")`.
    """
    device = device or jax.devices()[0]
    if device.platform == "tpu":
        return "bf16", f"{device.device_kind}: TPUs compute in bfloat16 natively"
    if device.platform == "gpu":
        cc = _capability(device)
        where = f"{device.device_kind} (compute capability {'.'.join(map(str, cc)) if cc else 'unknown'})"
        if cc is None:
            return "fp32", f"{where}: choose --precision bf16 or fp16 yourself if it has fast half precision"
        if cc >= (8, 0):
            return "bf16", f"{where}: bfloat16 tensor cores"
        if cc >= (7, 0) or cc in ((6, 0), (6, 2), (5, 3)):
            return "fp16", f"{where}: fast float16 only, dynamic loss scale"
        return "fp32", f"{where}: no fast half-precision arithmetic"
    return "fp32", f"{device.platform}: no fast half-precision matmuls"
