"""The precision audit: what a training step would run in which precision, read from its traced program.

`precision_audit(state, batch, loss_fn)` traces (does not run) the step's gradient computation exactly as
`train_step` would build it (the policy's casts or `autocast`, the loss scale, accumulation) and reads its jaxpr,
forward and backward:

- every matmul-class op (`dot_general`, `conv_general_dilated`): its operand and result dtypes, its FLOPs (times the
  trip count of an enclosing `scan`), the pass it belongs to (backward ops carry `transpose(...)` in their name
  stack) and the line of the user's code that issued it (the innermost frame outside JAX, Flax, Equinox, optax,
  Hugging Face and jaxamp);
- `half_fraction`: the share of those FLOPs whose operands are float16, bfloat16 or an FP8 type;
- `fallbacks`: the matmuls that ran in float32 under a half-precision policy, and for the first one the op that made
  its input float32 (found by walking the program back from its float32 operand to the first op that turned
  half-precision values into float32, or to the float32 input it came from);
- `half_accumulations`: sums, scatter-adds (lookup gradients) and cumulative ops that add more values in half
  precision than the format absorbs: once a running sum is about 2^8 (bfloat16) or 2^11 (float16) times one
  contribution, further ones round away (Micikevicius et al., 2018, accumulate in float32 for this reason).

`train_step` audits the very program it runs (traced once, `jaxamp.gradients.traced_gradients`) and, under a
half-precision policy, calls `warn_if_degraded`: one `PrecisionWarning` per
compilation when under 90% of the matmul FLOPs run in half precision or a half-precision accumulation passes its
format's limit, naming the largest source.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import source_info_util

from jaxamp.autocast_rules import contracts_nothing, exclusion_names, moved_axis, selects, weight_path
from jaxamp.autocasting import FLOAT32_RESULTS
from jaxamp.fp8_recipes import FP8_EXCLUDE, FP8_SCOPE
from jaxamp.gradients import check_loss_args, gradients
from jaxamp.precision import fp8_recipe, policy_name, uses_autocast, uses_fp8

PyTree = Any

__all__ = ["ABSORB_LIMIT", "PrecisionReport", "PrecisionWarning", "audit_jaxpr", "precision_audit",
           "warn_if_degraded"]

# `scaled_matmul_wrapper`: `jax.nn.scaled_dot_general`'s block-scaled GEMM (`fp8[b, m, k] . fp8[b, n, k]` with e8m0
# scales), which the mxfp8 recipe calls on Blackwell GPUs.
_MATMULS = ("dot_general", "conv_general_dilated", "ragged_dot_general", "scaled_matmul_wrapper", "scaled_matmul")
# The ops between a head's matmul and the softmax that takes its logits: a bias, a scale, a soft cap (tanh), casts,
# reshapes, slices (`logits[:, :-1]`), masks, clips.
_LOGIT_PATH = ("add", "add_any", "sub", "mul", "div", "neg", "tanh", "convert_element_type", "reduce_precision",
               "reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "slice", "dynamic_slice",
               "select_n", "max", "min", "clamp", "copy", "copy_p", "name", "pad", "concatenate", "gather")
# (`name`: `checkpoint_name`.)
# `_Walk._forward_walk`'s "go on through this equation's outputs".
_FOLLOW = "follow"
# What picks an entry by its score: a nearest-neighbour (VQ codebook) search, a ranking.
_SEARCHES = ("argmin", "argmax")
# The copies of logits a softmax may take: a cast, a mask (`where=`).
_ALIAS_OPS = ("convert_element_type", "select_n", "reduce_precision")
# The ops between a softmax's `x - max` and its `exp`.
_SHIFT_TO_EXP = ("convert_element_type", "broadcast_in_dim", "reshape", "transpose", "select_n", "reduce_precision")
# The ops between an FP8 value and the matmul that takes it dequantized (`convert(f8) * scale`, reshaped).
_DEQUANTIZE_OPS = ("convert_element_type", "mul", "div", "broadcast_in_dim", "reshape", "transpose", "squeeze",
                   "copy", "copy_p")
# Ops through which a value is still the array it came from (casts and shape ops): a one-hot array
# (`jax.nn.one_hot`'s) on its way to a matmul, forward or backward; a param cast by the policy (`from_input`).
_SHAPE_AND_CAST_OPS = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "copy",
                       "convert_element_type")
# The ops between a scanned weight slice and the matmul that takes it: casts, shape ops, an FP8 quantization's scale
# and clip.
_SLICE_PATH = (*_SHAPE_AND_CAST_OPS, "mul", "div", "clamp", "max", "min", "round", "reduce_precision")
# The ops of a softplus (`logaddexp(x, 0)`) and of the log-sigmoid around it, up to what a loss does next.
_SOFTPLUS_OPS = ("neg", "add", "sub", "max", "abs", "exp", "log1p", "select_n", "convert_element_type",
                 "broadcast_in_dim", "reshape")
_SUMS = ("reduce_sum", "cumsum", "cumlogsumexp", "cumprod", "reduce_prod")
_SCATTER_ADDS = ("scatter-add", "scatter_add")
# Contributions a running sum in the format absorbs before the next ones round away (about 2^mantissa bits).
ABSORB_LIMIT = {"bfloat16": 2**8, "float16": 2**11}
_HALF_NAMES = ("float16", "bfloat16")


def _package_dirs(*names: str) -> tuple[str, ...]:
    """The folders of the installed packages `names` (those that are installed), each ending in a separator."""
    return tuple(os.path.join(d, "") for name in names if (spec := importlib.util.find_spec(name))
                 for d in spec.submodule_search_locations or ())


# Folders whose frames are library code, not the user's: the installed model and optimizer libraries (and jaxamp's
# own library modules, `_is_library`: its LM application, `jaxamp/lm`, counts as user code).
_LIBRARIES = _package_dirs("flax", "equinox", "optax", "transformers", "jmp", "haiku", "orbax", "chex", "optree")
_JAXAMP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
_JAXAMP_APP = os.path.join(_JAXAMP, "lm", "")


_JAX_DIRS = _package_dirs("jax", "jaxlib")
# Library files whose frames wrap every module call (Haiku's `wrap_method`, linen's `_call_wrapped_method`): no
# layer's name.
_MODULE_WRAPPERS = (os.path.join("haiku", "_src", "module.py"), os.path.join("flax", "linen", "module.py"),
                    os.path.join("flax", "core", ""))


def _users_frame():
    """The innermost frame outside JAX, jaxamp's library and the model libraries (the user's line that called the
    jitted step, or the step itself), or None."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith("<frozen") or name.startswith(_JAX_DIRS) or _is_library(name)):  # (`<stdin>`,
            # IPython's `<ipython-input-...>` cells are the user's)
            return frame
        frame = frame.f_back
    return None


def _is_library(filename: str) -> bool:
    if filename.startswith(_JAXAMP):
        return not filename.startswith(_JAXAMP_APP)
    return filename.startswith(_LIBRARIES)
_CALLS = ("jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint", "custom_jvp_call",
          "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin")


class PrecisionWarning(UserWarning):
    """A half-precision policy that runs much of the step in float32, or sums in half precision past the format's
    limit (see `jaxamp.audit`)."""


def _is_half(dtype) -> bool:
    name = jnp.dtype(dtype).name
    return name in _HALF_NAMES or name.startswith("float8")


def _half_operands(lhs, rhs) -> bool:
    """Whether a matmul's floating operands are all half precision (or FP8): a boolean or integer mask beside a
    bfloat16 activation (a dispatch einsum) runs as that activation's GEMM."""
    floats = [d for d in (lhs, rhs) if jnp.issubdtype(jnp.dtype(d), jnp.inexact)]
    return bool(floats) and all(map(_is_half, floats))


def _dtype(v) -> str:
    return jnp.dtype(v.aval.dtype).name if hasattr(v.aval, "dtype") else "?"


def _where(eqn) -> tuple[str, str]:
    """`(user's file:line, library frame or "")` of an equation: the innermost frame outside JAX and the libraries,
    and the library's entry point the user called there (the outermost library frame inside it that is no module
    wrapper, e.g. `flax/nnx/nn/normalization.py:BatchNorm.__call__`, `haiku/_src/nets/vqvae.py:VectorQuantizer.__call__`
    rather than Haiku's `wrap_method.<locals>.wrapped`)."""
    library = ""
    for frame in source_info_util.user_frames(eqn.source_info.traceback):
        name = frame.file_name
        if _is_library(name):
            if not any(w in name for w in _MODULE_WRAPPERS):
                short = ("jaxamp" + os.sep + name[len(_JAXAMP):] if name.startswith(_JAXAMP)
                         else name.split(os.sep + "site-packages" + os.sep)[-1])
                library = f"{short}:{frame.function_name}"
            continue
        return f"{_short_file(name)}:{frame.start_line}", library
    return library or "?", library  # no user frame (a backward op of library code): the library's entry point


def _short_file(name: str) -> str:
    """A user frame's file as the audit writes it: the base name (`models.py`), or for a file of an installed
    package its path in the package (`jraph/_src/models.py`: a library the audit does not know, which would read as
    the user's own `models.py`)."""
    for packages in (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep):
        if packages in name:
            return name.split(packages)[-1]
    return os.path.basename(name)


def _fp8_formats(eqn) -> tuple[str, str] | None:
    """The FP8 formats of a `jaxamp.fp8_recipes` matmul (it names its scope after them: a per-tile recipe's dot is
    float32 x float32 on `convert(f8) * scale`), or None."""
    for entry in reversed(getattr(eqn.source_info.name_stack, "stack", ())):
        name = str(getattr(entry, "name", entry))
        if name.startswith(FP8_SCOPE + ":"):
            _, lhs, rhs = name.split(":")
            return lhs, rhs
    return None


def _names(eqn) -> list[str]:
    """The names on an equation's own name stack (Flax modules, Equinox classes, `jax.named_scope`s, autocast's
    `WEIGHT_SCOPE`), outermost first, without autodiff's `jvp` / `transpose` and jaxamp's FP8 scope. Inside a
    sub-program (a jit, custom_vjp or scan body) they are relative to the equation that calls it: `_Walk` prefixes
    the caller's."""
    names = [str(getattr(entry, "name", entry)) for entry in getattr(eqn.source_info.name_stack, "stack", ())]
    return [n for n in names if n not in ("jvp", "transpose") and not n.startswith(FP8_SCOPE + ":")]


def _scope(names: list[str]) -> list[str]:
    """`names` without autocast's `WEIGHT_SCOPE` (the row's `weight`)."""
    return [n for n in names if not weight_path([n])]


def _callers(eqn) -> str:
    """The qualified names of the functions outside JAX and jaxamp that traced the matmul, innermost first:
    `"Linear.__call__ < GPT.__call__ < loss_fn"` (what an `fp8_exclude` pattern can also match), without linen's
    module wrappers (`Module._call_wrapped_method`, repeated at every module)."""
    traceback = eqn.source_info.traceback
    frames = traceback.frames if traceback is not None else ()
    skip = (os.sep + "jax" + os.sep, os.sep + "jaxlib" + os.sep, _JAXAMP, os.sep + "contextlib.py",
            os.sep + "functools.py", os.path.join("flax", "linen", "module.py"), os.path.join("flax", "core", ""))
    return " < ".join(str(f.function_name) for f in frames
                      if not any(s in str(f.file_name) or str(f.file_name).startswith(s) for s in skip))


def _pass(eqn, inside_backward: bool = False) -> str:
    """`"backward"` for an equation autodiff's transpose made, or one inside the body of such a scan/while/call
    (their equations' own name stacks start afresh), else `"forward"`."""
    stack = getattr(eqn.source_info.name_stack, "stack", ())  # (a module named `conv_transpose` is no transpose)
    transposed = any(isinstance(e, source_info_util.Transform) and e.name == "transpose" for e in stack)
    return "backward" if inside_backward or transposed else "forward"


def _matmul_flops(eqn) -> int:
    out = eqn.outvars[0].aval
    if eqn.primitive.name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        return 2 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lhs_contract)
    if eqn.primitive.name == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        out_feature = eqn.params["dimension_numbers"].rhs_spec[0]
        return 2 * math.prod(out.shape) * (math.prod(rhs.shape) // rhs.shape[out_feature])
    if eqn.primitive.name == "ragged_dot_general":
        dims = eqn.params["ragged_dot_dimension_numbers"]
        (lhs_contract, _), _ = dims.dot_dimension_numbers
        flops = 2 * math.prod(out.shape) * math.prod(eqn.invars[0].aval.shape[d] for d in lhs_contract)
        if set(dims.lhs_ragged_dimensions) & set(lhs_contract):  # a weight gradient: out [groups, k, n], each group
            return flops // eqn.invars[2].aval.shape[-1]  # over its own rows only, m rows in all
        return flops
    return 2 * math.prod(out.shape) * eqn.invars[0].aval.shape[-1]  # scaled_matmul: lhs [.., k]


def _summed(eqn) -> int:
    """How many values one output element of a sum-like equation adds up."""
    name = eqn.primitive.name
    if name in ("reduce_sum", "reduce_prod"):
        shape = eqn.invars[0].aval.shape
        return math.prod(shape[a] for a in eqn.params["axes"])
    if name in _SCATTER_ADDS:  # scatter dims of the updates, less the batching ones (one row each: no sum there,
        updates, indices = eqn.invars[2].aval.shape, eqn.invars[1].aval.shape  # e.g. take_along_axis's gradient)
        dims = eqn.params["dimension_numbers"]
        batching = math.prod(indices[d] for d in getattr(dims, "scatter_indices_batching_dims", ()))
        return math.prod(s for i, s in enumerate(updates) if i not in dims.update_window_dims) // max(batching, 1)
    return eqn.invars[0].aval.shape[eqn.params["axis"]] if eqn.invars[0].aval.shape else 1


def _sub_jaxprs(eqn):
    """`(jaxpr, trip count)` of every sub-program of `eqn` (scan bodies run `length` times)."""
    trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            jaxpr = getattr(item, "jaxpr", item)
            if hasattr(jaxpr, "eqns"):
                yield jaxpr, trips


def _inputs(eqn, sub) -> list:
    """`(operand, inner input, carried)` of `eqn` and its sub-program `sub` where the inner input stands for the
    operand: a call's and a cond branch's operands; a scan's consts and xs (a slice at a time); a while loop's
    consts; and, `carried`, a loop's carries, which hold the operand only on the first trip (an HMM's one-hot start
    becomes a distribution): the cause walk follows them, the one-hot and step-input tests do not."""
    name, outer, inner = eqn.primitive.name, list(eqn.invars), list(sub.invars)
    if name in _CALLS or name == "cond":
        return [(o, i, False) for o, i in zip(outer[len(outer) - len(inner):], inner)]
    if name == "scan" and len(outer) == len(inner) and "num_consts" in eqn.params:
        n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
        return [(o, i, n_consts <= k < n_consts + n_carry) for k, (o, i) in enumerate(zip(outer, inner))]
    if name == "while":
        n_c, n_b = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        if sub is getattr(eqn.params["body_jaxpr"], "jaxpr", None):
            return [(o, i, k >= n_b) for k, (o, i) in enumerate(zip(outer[n_c:], inner))]
        return [(o, i, k >= n_c) for k, (o, i) in enumerate(zip(outer[:n_c] + outer[n_c + n_b:], inner))]
    return []


@dataclasses.dataclass
class _Walk:
    """Everything found in one traversal; `producer` maps a variable to the equation that made it (through calls)."""

    rows: list = dataclasses.field(default_factory=list)
    eqns: list = dataclasses.field(default_factory=list)  # per row: its equation
    names: list = dataclasses.field(default_factory=list)  # per row: its whole name stack (`_names`, prefixed)
    sums: list = dataclasses.field(default_factory=list)
    producer: dict = dataclasses.field(default_factory=dict)
    # id(var) -> the equations that take it; ("enter", id(var)) -> the call bodies' inputs it becomes; ("exit",
    # id(inner output)) -> the call's outputs it becomes; ("loop", id(body output)) -> the body input it is next trip
    consumers: dict = dataclasses.field(default_factory=dict)
    first_fallback: Any = None
    backward: bool = False  # visiting the body of a backward (transposed) scan, while or call
    prefix: tuple = ()  # the names of the equations whose sub-programs are being visited
    # the equations (nested jits, scans, loops, conds, ...) whose sub-programs are being visited, outermost first
    calls: tuple = ()
    held_by: dict = dataclasses.field(default_factory=dict)  # id(equation) -> the `calls` it was visited in
    passes: dict = dataclasses.field(default_factory=dict)  # id(equation) -> "forward" or "backward"
    sliced: set = dataclasses.field(default_factory=set)  # id(var): a scan body's per-trip input (an xs slice)

    def visit(self, jaxpr, trips: int, compute_half: bool) -> None:
        for eqn in jaxpr.eqns:
            for out in eqn.outvars:
                self.producer[id(out)] = eqn
            for v in eqn.invars:
                if _is_var(v):
                    self.consumers.setdefault(id(v), []).append(eqn)
            self.held_by[id(eqn)] = self.calls
            self.passes[id(eqn)] = _pass(eqn, self.backward)
            name = eqn.primitive.name
            if name in _MATMULS and any(jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.invars[:2]) \
                    and not contracts_nothing(eqn):
                # (an integer matmul, BigBird's mask einsums, is no GEMM here; a float one beside a boolean mask, a
                # dispatch einsum, is; and a dot_general that contracts nothing is an elementwise product)
                self._matmul(eqn, trips, compute_half)
            elif (name in _SUMS or name in _SCATTER_ADDS) and _dtype(eqn.outvars[0]) in ABSORB_LIMIT:
                self._sum(eqn)
            for sub, inner_trips in _sub_jaxprs(eqn):
                if name in _CALLS:  # outputs of the call are the inner program's outputs
                    for outer, inner in zip(eqn.outvars, sub.outvars):
                        if hasattr(inner, "aval") and not hasattr(inner, "val"):
                            self.producer.setdefault(("alias", id(outer)), inner)
                for outer, inner, carried in _inputs(eqn, sub):
                    self.producer.setdefault(("carry" if carried else "input", id(inner)), outer)
                self._link(eqn, sub)
                outer = self.backward, self.prefix, self.calls
                self.backward = _pass(eqn, self.backward) == "backward"
                self.prefix = (*self.prefix, *_names(eqn))
                self.calls = (*self.calls, eqn)
                self.visit(sub, trips * inner_trips, compute_half)
                self.backward, self.prefix, self.calls = outer

    def _link(self, eqn, sub) -> None:
        """`consumers`' links between `eqn`'s operands and results and the inputs and outputs of its sub-program
        `sub` where they line up one to one (calls; scan: consts, carry, xs -> carry, ys; while's body; cond's
        branches, the index aside), and a loop body's carries out to its carries in (`"loop"`: the next trip)."""
        if len(sub.outvars) == len(eqn.outvars):
            for outer, inner in zip(eqn.outvars, sub.outvars):
                if _is_var(inner):
                    self.consumers.setdefault(("exit", id(inner)), []).append(outer)
        pairs = [(o, i) for o, i, _ in _inputs(eqn, sub)] if eqn.primitive.name == "while" else \
            zip(eqn.invars[len(eqn.invars) - len(sub.invars):], sub.invars)  # (a while's cond skips the body's consts)
        for outer, inner in pairs:
            if _is_var(outer):
                self.consumers.setdefault(("enter", id(outer)), []).append(inner)
        params, name = eqn.params, eqn.primitive.name
        if name == "scan" and "num_carry" in params and sub is getattr(params["jaxpr"], "jaxpr", None):
            first, count = params["num_consts"], params["num_carry"]  # (a carry's next trip: a scanned layer's input)
        elif name == "while" and sub is getattr(params["body_jaxpr"], "jaxpr", None):
            first, count = params["body_nconsts"], len(sub.outvars)
        else:
            return
        for out, nxt in zip(sub.outvars[:count], sub.invars[first:first + count]):
            if _is_var(out):
                self.consumers.setdefault(("loop", id(out)), []).append(nxt)
        if name == "scan":  # a scan's xs: a slice per trip (a scanned stack's layer weights)
            self.sliced.update(id(v) for v in sub.invars[first + count:])

    def where(self, eqn) -> tuple[str, str, str]:
        """`(source, library, callers)` of `eqn` (`_where`, `_callers`). The body of a nested jit, a scan, a loop
        or a cond is traced with a traceback that ends at the function traced: where that holds no user frame (a
        library's jit, such as `jaxamp.attention`'s, or scan, such as `nn.RNN`'s over `nn.LSTMCell`), the source is
        the enclosing equation's, the library its entry point, and the callers go on with its."""
        source, library = _where(eqn)
        callers = [_callers(eqn)]
        for call in reversed(self.held_by.get(id(eqn), ())):
            if source not in ("?", library):
                break
            source, outer_library = _where(call)
            library = outer_library or library
            callers.append(_callers(call))
        return source, library, " < ".join(c for c in callers if c)

    def _matmul(self, eqn, trips, compute_half) -> None:
        lhs, rhs = _fp8_formats(eqn) or self._dequantized(eqn) or (_dtype(eqn.invars[0]), _dtype(eqn.invars[1]))
        source, library, callers = self.where(eqn)
        names = [*self.prefix, *_names(eqn)]
        row = {"source": source, "library": library, "primitive": eqn.primitive.name, "lhs": lhs, "rhs": rhs,
               "out": _dtype(eqn.outvars[0]), "flops": _matmul_flops(eqn) * trips, "trips": trips,
               "pass": _pass(eqn, self.backward),
               "shape": f"{list(eqn.invars[0].aval.shape)} x {list(eqn.invars[1].aval.shape)}",
               "scope": "/".join(_scope(names)), "callers": callers, "weight": weight_path(names),
               "selection": not _half_operands(lhs, rhs) and self._selects(eqn)}
        self.rows.append(row)
        self.eqns.append(eqn)
        self.names.append(names)
        if compute_half and not _half_operands(lhs, rhs) and not row["selection"]:
            if self.first_fallback is None:
                self.first_fallback = (row, eqn)

    def feeds_softmax(self, var, sizes=None, depth: int = 24) -> str:
        """Whether `var` reaches a softmax's input (`log_softmax`, `softmax`, `logsumexp`, optax's cross-entropies:
        `x` taken by a `reduce_max` and by the `x - max` that goes to `exp`) or a log-sigmoid's (binary and
        multi-label losses: `_log_sigmoid_input`) through elementwise and shape ops and call, scan and cond
        boundaries only (no other matmul, normalisation or reduction), at most `depth` ops on; with `sizes`, a
        softmax over an axis of one of those sizes (the classes a weight's output features make); or a `top_k` over
        them (a mixture-of-experts router's choice); failing those, an `argmin` or `argmax` over them (a
        nearest-neighbour search: a VQ codebook's distances `|x|^2 - 2 x.E + |E|^2`, Haiku's `argmax(-distances)`;
        scores a model only ranks). Returns `"softmax"`, `"log-sigmoid"`, `"top_k"`, `"argmin"`, `"argmax"` or
        `""`."""
        frontier, seen, search = [(var, depth, sizes)], set(), ""
        while frontier:
            v, left, sizes = frontier.pop()
            if left == 0 or id(v) in seen:
                continue
            seen.add(id(v))
            if self._softmax_input(v, sizes):
                return "softmax"
            if self._log_sigmoid_input(v):
                return "log-sigmoid"
            if self._top_k_input(v, sizes):
                return "top_k"
            search = search or self._search_input(v, sizes)
            frontier += [(w, left - 1, sizes) for w in self.consumers.get(("exit", id(v)), [])]
            frontier += [(w, left - 1, sizes) for w in self.consumers.get(("enter", id(v)), [])]
            frontier += [(w, left - 1, None if eqn.primitive.name in ("pad", "concatenate") else sizes)
                         for eqn in self.consumers.get(id(v), []) if eqn.primitive.name in _LOGIT_PATH
                         for w in eqn.outvars]  # (padded or joined logits: their axis is no longer the weight's)
        return search  # (a softmax first: a classifier's accuracy takes an argmax of the logits its loss takes)

    def _top_k_input(self, var, sizes=None) -> bool:
        """`var` (or a copy, `_aliases`) is a `top_k`'s operand over its last axis, of one of `sizes` if given: a
        mixture-of-experts router's choice of experts (Mixtral's top-k before its softmax)."""
        return any(e.primitive.name == "top_k" and (sizes is None or e.invars[0].aval.shape[-1] in sizes)
                   for v in self._aliases(var) for e in self.consumers.get(id(v), []))

    def _search_input(self, var, sizes=None) -> str:
        """`"argmin"` / `"argmax"` where `var` (or a copy, `_aliases`) is one's operand over an axis of one of `sizes`
        (if given): a search that picks the nearest code or the best-scoring entry; else `""`."""
        for v in self._aliases(var):
            for e in self.consumers.get(id(v), []):
                if e.primitive.name in _SEARCHES and (sizes is None or any(
                        e.invars[0].aval.shape[a] in sizes for a in e.params["axes"])):
                    return e.primitive.name
        return ""

    def only_searched(self, var, limit: int = 256) -> bool:
        """Whether every forward use of `var` ends in an `argmin` / `argmax` through elementwise and shape ops
        (`_LOGIT_PATH`) and call boundaries: a search's scores, which nothing else (the loss, another layer, an
        `exp`) takes. False past `limit` values."""
        def decide(eqn):
            name = eqn.primitive.name
            if name in _SEARCHES or any(True for _ in _sub_jaxprs(eqn)):
                return None  # (a call, loop or cond: its body's uses, through the "enter" links)
            return _FOLLOW if name in _LOGIT_PATH else False

        return self._forward_walk(var, decide, ("enter", "exit"), limit, exhausted=True)

    def _forward_walk(self, var, decide, links: tuple, limit: int, exhausted: bool) -> bool:
        """Walks the forward equations that use `var` and the values they make, across the `consumers` links named
        in `links`: `decide(eqn)` gives the answer (a bool), `_FOLLOW` (go on through its outputs) or None (pass it
        by). `exhausted` when nothing decided; the other answer past `limit` values."""
        seen, frontier = set(), [var]
        while frontier:
            v = frontier.pop()
            if id(v) in seen:
                continue
            seen.add(id(v))
            if len(seen) > limit:
                return not exhausted
            frontier += [w for key in links for w in self.consumers.get((key, id(v)), [])]
            for eqn in self.consumers.get(id(v), []):
                if self.passes.get(id(eqn)) != "forward":
                    continue
                verdict = decide(eqn)
                if verdict is _FOLLOW:
                    frontier += [o for o in eqn.outvars if _is_var(o)]
                elif verdict is not None:
                    return verdict
        return exhausted

    def attends(self, var, depth: int = 10) -> bool:
        """Whether `var` reaches a forward matmul through other ops, at most `depth` values on: attention scores
        (`softmax(q @ k.T) @ v`), not logits (a head's softmax goes to the loss; only the backward's matmuls follow)."""
        frontier, seen = [(var, depth)], set()
        while frontier:
            v, left = frontier.pop()
            if left == 0 or id(v) in seen:
                continue
            seen.add(id(v))
            for e in self.consumers.get(id(v), []):
                if e.primitive.name in _MATMULS and _pass(e) == "forward":
                    return True
                if e.primitive.name not in _MATMULS:
                    frontier += [(w, left - 1) for w in e.outvars]
            frontier += [(w, left - 1) for key in ("enter", "exit") for w in self.consumers.get((key, id(v)), [])]
        return False

    def _aliases(self, var) -> list:
        """`var` and its copies a softmax may take instead: casts (autocast's float32 cast before `logsumexp`'s
        `x - max`), masks (`where=`: `select_n`) and call boundaries (a jitted `_where`)."""
        out, todo = [var], [var]
        while todo and len(out) < 16:
            v = todo.pop()
            more = [w for e in self.consumers.get(id(v), []) if e.primitive.name in _ALIAS_OPS for w in e.outvars]
            more += self.consumers.get(("enter", id(v)), []) + self.consumers.get(("exit", id(v)), [])
            more = [w for w in more if all(w is not u for u in out)]
            out += more
            todo += more
        return out

    def _softmax_input(self, var, sizes=None) -> bool:
        """`var` is a softmax's input: a `reduce_max` takes it (or a copy, `_aliases`; over an axis of one of
        `sizes`, if given), and a `sub` of it reaches an `exp` within 3 ops."""
        copies = self._aliases(var)
        takers = [e for v in copies for e in self.consumers.get(id(v), [])]
        if not any(e.primitive.name == "reduce_max" and (sizes is None or any(
                e.invars[0].aval.shape[a] in sizes for a in e.params.get("axes", ()))) for e in takers):
            return False
        shifted = [out for e in takers if e.primitive.name == "sub" and any(e.invars[0] is v for v in copies)
                   for out in e.outvars]
        return self._reaches(shifted, "exp", _SHIFT_TO_EXP, 3, links=("enter",))

    def _reaches(self, starts, target: str, through, depth: int, links=()) -> bool:
        """Whether an equation named `target` takes one of `starts`, or a value made from them by ops named in
        `through` (and across the call links named in `links`: `"enter"`, `"exit"`), at most `depth` values on."""
        frontier, seen = [(v, depth) for v in starts], set()
        while frontier:
            v, left = frontier.pop()
            if left == 0 or (id(v), left) in seen:
                continue
            seen.add((id(v), left))
            takers = self.consumers.get(id(v), [])
            if any(e.primitive.name == target for e in takers):
                return True
            frontier += [(w, left - 1) for e in takers if e.primitive.name in through for w in e.outvars]
            frontier += [(w, left - 1) for key in links for w in self.consumers.get((key, id(v)), [])]
        return False

    def _log_sigmoid_input(self, var) -> bool:
        """`var` is the logits of a binary cross-entropy: it reaches softplus inputs (`logaddexp(y, 0)`) through an
        odd number of negations (`log_sigmoid(x) = -softplus(-x)`) and through an even one (`log_sigmoid(-x)`),
        as optax's `sigmoid_binary_cross_entropy` has it, or the first alone with an `expm1` after it (Flax's VAE
        example: `log(-expm1(log_sigmoid(x)))`). A log-sigmoid gate (xLSTM's forget gate into a `cumsum`) or a
        softplus of `x` itself (Mamba's step size) is not a loss's."""
        parities, frontier, seen = {}, [(var, 0, 6)], set()
        while frontier:
            v, odd, left = frontier.pop()
            if (id(v), odd) in seen or left == 0:
                continue
            seen.add((id(v), odd))
            for u in self._aliases(v):
                if self._softplus_input(u):
                    parities.setdefault(odd, []).append(u)
                frontier += [(w, 1 - odd, left - 1) for e in self.consumers.get(id(u), [])
                             if e.primitive.name == "neg" for w in e.outvars]
        if 0 in parities and 1 in parities:
            return True
        return 1 in parities and self._reaches(parities[1], "expm1", _SOFTPLUS_OPS, 24, links=("enter", "exit"))

    def _softplus_input(self, var) -> bool:
        takers = self.consumers.get(id(var), [])
        if not any(e.primitive.name == "max" for e in takers):
            return False
        shifted = [out for e in takers if e.primitive.name == "sub" and e.invars[0] is var for out in e.outvars]
        return self._reaches(shifted, "exp", ("abs", "neg", *_SHIFT_TO_EXP), 5)

    def _dequantized(self, eqn) -> tuple[str, str] | None:
        """The FP8 formats of a matmul on two dequantized FP8 operands (`convert(f8) * scale`: Flax's
        quantize-dequantize ops, `Fp8DotGeneralOp` and AMD's `NANOOFp8DotGeneralOp`, which XLA on a GPU rewrites
        into one FP8 GEMM), or None."""
        formats = tuple(self._fp8_origin(v, 8) for v in eqn.invars[:2])
        return formats if all(formats) else None

    def _fp8_origin(self, var, depth: int) -> str | None:
        """The float8 dtype `var` was converted from, through scales (mul, div), broadcasts, reshapes, transposes,
        other converts and call boundaries, at most `depth` ops back; or None."""
        if depth == 0 or not _is_var(var):
            return None
        step = self._through_calls(var)
        if step is not None:
            return self._fp8_origin(step, depth - 1)
        maker = self.producer.get(id(var))
        if maker is None or maker.primitive.name not in _DEQUANTIZE_OPS:
            return None
        if maker.primitive.name == "convert_element_type" and _dtype(maker.invars[0]).startswith("float8"):
            return _dtype(maker.invars[0])
        values = maker.invars
        if maker.primitive.name in ("mul", "div"):  # `convert(f8) * scale`: the one operand that is not a scale
            values = [v for v in maker.invars if not self._is_scale(v, maker.outvars[0])]
            if len(values) != 1 or (maker.primitive.name == "div" and values[0] is not maker.invars[0]):
                return None  # e.g. data times a mask stored in FP8: not a dequantization
        for v in values:
            found = self._fp8_origin(v, depth - 1)
            if found:
                return found
        return None

    def _is_scale(self, var, out) -> bool:
        """`var` scales `out` elementwise: a literal, an array with fewer elements, or one broadcast from such."""
        if not _is_var(var) or math.prod(var.aval.shape) < math.prod(out.aval.shape):
            return True
        maker = self.producer.get(id(var))
        return maker is not None and maker.primitive.name == "broadcast_in_dim" and \
            math.prod(maker.invars[0].aval.shape) < math.prod(out.aval.shape)

    def _sum(self, eqn) -> None:
        size = _summed(eqn)
        dtype = _dtype(eqn.outvars[0])
        if size > ABSORB_LIMIT[dtype] and not self._counts_booleans(eqn):
            source, library, _ = self.where(eqn)
            self.sums.append({"source": source, "library": library, "primitive": eqn.primitive.name,
                              "dtype": dtype, "size": size, "pass": _pass(eqn, self.backward)})

    def _counts_booleans(self, eqn) -> bool:
        """Whether a sum adds up booleans converted to a float (through broadcasts and reshapes): a count, exact up
        to 2^8 in bfloat16 and 2^11 in float16, e.g. the ties of a max in `reduce_max`'s derivative, which JAX
        writes in the max's dtype (a half-precision head's logits under autocast, in logsumexp)."""
        var = eqn.invars[-1] if eqn.primitive.name in _SCATTER_ADDS else eqn.invars[0]
        for _ in range(8):
            maker = self.producer.get(id(var)) if _is_var(var) else None
            if maker is None:
                return False
            if maker.primitive.name == "convert_element_type":
                return _dtype(maker.invars[0]) == "bool"
            if maker.primitive.name not in ("broadcast_in_dim", "reshape", "transpose", "squeeze"):
                return False
            var = maker.invars[0]
        return False

    def scope(self, eqn) -> str:
        """The module scope of `eqn` (its name stack under those of the calls it was visited in), `/`-joined."""
        prefix = [n for call in self.held_by.get(id(eqn), ()) for n in _names(call)]
        return "/".join(_scope([*prefix, *_names(eqn)]))

    def cause(self, eqn) -> str:
        """The op that made `eqn`'s float32 operand float32, in one line, with its module scope: walking back along
        float32 values, the first op with a half-precision input. A layer that promotes its own half-precision
        weight to float32 (flax's `promote_dtype` under `dtype=float32`, or with a float32 input) shows that it
        computes in float32, not why its input was float32: such promotions are named only when nothing else is
        found, the most upstream one (a Hugging Face model whose modules all compute in float32: its embedding;
        every op of a model from an installed package is on the user's one line that called it, so the scopes
        tell its layers apart)."""
        seen: set = set()
        promotion = None
        frontier = [v for v in eqn.invars if _is_var(v) and _dtype(v) == "float32"]
        while frontier:
            var = frontier.pop(0)
            if id(var) in seen:
                continue
            seen.add(id(var))
            step = self._through_calls(var)
            if step is None and id(var) not in self.producer:
                step = self.producer.get(("carry", id(var)))  # a loop's carry: its first value
            if step is not None:
                frontier.append(step)
                continue
            maker = self.producer.get(id(var))
            if maker is None:
                return f"a float32 input of the step ({var.aval.str_short()}) reached it unchanged"
            floats = [v for v in maker.invars if _is_var(v) and jnp.issubdtype(v.aval.dtype, jnp.floating)]
            if any(_is_half(v.aval.dtype) for v in floats):
                (source, library, _), scope = self.where(maker), self.scope(maker)
                where = (f"{library} at {source}" if library else source) + (f" (in {scope})" if scope else "")
                if maker.primitive.name != "convert_element_type" or not self.from_input(maker.invars[0]):
                    return f"{where} returned float32 from half-precision inputs ({maker.primitive.name})"
                promotion = (f"{where} promoted a half-precision param to float32 (convert_element_type): it "
                             "computes in float32 (its `dtype`)")
            frontier.extend(v for v in floats if _dtype(v) == "float32")
        return promotion or "no half-precision value reached it (the model computes in float32 there)"

    def feeds_matmul(self, var, limit: int = 4096, loop: bool = False) -> bool:
        """Whether `var` (a forward value) reaches another forward matmul or convolution, through the forward ops
        after it (and call, loop and cond boundaries); not, it reaches the loss as an output layer's result does (a
        regression or value head's: no softmax to find it by). With `loop`, also through a loop body's carry into
        its next trip (a scanned stack's block output feeds the next block's matmuls: its weights, a slice per
        trip, are every layer's, not an output layer's). True where the walk passes `limit` variables."""
        links = ("enter", "exit", "loop") if loop else ("enter", "exit")
        return self._forward_walk(var, lambda eqn: True if eqn.primitive.name in _MATMULS else _FOLLOW, links, limit,
                                  exhausted=False)

    def per_trip(self, eqn, depth: int = 12) -> bool:
        """Whether an operand of the matmul `eqn` is a scan's per-trip slice (`sliced`), through casts, shape ops
        and the quantization around an FP8 matmul (scales, clips), at most `depth` ops back: a scanned stack's
        weights, a different layer's each trip (a loop-invariant weight, an autoregressive rollout's, is not)."""
        frontier, seen = [(v, depth) for v in eqn.invars[:2]], set()
        while frontier:
            v, left = frontier.pop()
            if not _is_var(v) or left == 0 or id(v) in seen:
                continue
            seen.add(id(v))
            if id(v) in self.sliced:
                return True
            maker = self.producer.get(id(v))
            if maker is not None and maker.primitive.name in _SLICE_PATH:
                frontier += [(w, left - 1) for w in maker.invars]
            for link in ("alias", "input"):  # a call's output: its body's; a body's input: the call's operand
                other = self.producer.get((link, id(v)))
                if other is not None:
                    frontier.append((other, left - 1))
        return False

    def from_input(self, var, depth: int = 8) -> bool:
        """Whether `var` is a float32 input of the step (a master weight, cast to the compute dtype by the policy or
        by autocast) through casts, shape ops and call boundaries: a weight, not an activation. A half-precision
        input (a bfloat16 batch) is not one: a model that converts it to float32 made its activations float32."""
        for _ in range(depth):
            if not _is_var(var):
                return False
            step = self._through_calls(var)
            if step is None:
                maker = self.producer.get(id(var))
                if maker is None:
                    return _dtype(var) == "float32"
                if maker.primitive.name not in _SHAPE_AND_CAST_OPS:
                    return False
                step = maker.invars[0]
            var = step
        return False

    def _one_hot_axis(self, var, depth: int) -> int | None:
        """The class axis of `var` where it holds a one-hot array, `jax.nn.one_hot`'s `convert(ids[..., None] ==
        iota)` (through shape ops, casts and call boundaries, at most `depth` ops back), else None: a float32 matmul
        that takes it is a selection that autocast ran in its other operand's dtype
        (`autocast_rules.selection_rule`), or the backward of one."""
        if depth == 0 or not _is_var(var):
            return None
        step = self._through_calls(var)
        if step is not None:
            axis = self._one_hot_axis(step, depth - 1)
            if axis is not None and id(var) in self.sliced:  # a scan's xs slice: the leading axis dropped
                return axis - 1 if axis > 0 else None
            return axis
        maker = self.producer.get(id(var))
        if maker is None or maker.primitive.name not in _SHAPE_AND_CAST_OPS or not maker.invars:
            return None
        if maker.primitive.name == "convert_element_type" and _dtype(maker.invars[0]) == "bool":
            compare = self.producer.get(id(maker.invars[0]))
            if compare is None or compare.primitive.name != "eq":
                return None
            return next((a for a in (self._iota_axis(v, 4) for v in compare.invars) if a is not None), None)
        axis = self._one_hot_axis(maker.invars[0], depth - 1)
        return None if axis is None else moved_axis(maker, axis)

    def _selects(self, eqn) -> bool:
        """Whether a matmul selects with a one-hot operand (`_one_hot_axis`): forward, contracted over its class
        axis, as `autocast_rules.selects` decides (`x.T @ one_hot(ids)`, VectorQuantizerEMA's codebook sums, is a
        segment sum: a matmul like any other); backward, any (a selection's gradient sums over its rows)."""
        axes = [self._one_hot_axis(v, 8) for v in eqn.invars[:2]]
        if eqn.primitive.name != "dot_general" or self.passes.get(id(eqn)) != "forward":
            return any(a is not None for a in axes)
        return any(selects(eqn, axes))

    def _iota_axis(self, var, depth: int) -> int | None:
        """The axis along which `var` counts, where it is an `iota` (through broadcasts and casts), else None."""
        maker = self.producer.get(id(var)) if _is_var(var) else None
        if maker is None or depth == 0:
            return None
        if maker.primitive.name == "iota":
            return maker.params["dimension"]
        if maker.primitive.name not in ("broadcast_in_dim", "convert_element_type"):
            return None
        axis = self._iota_axis(maker.invars[0], depth - 1)
        return None if axis is None else moved_axis(maker, axis)

    def _through_calls(self, var):
        """The variable `var` stands for across a call boundary (a call's output -> the inner program's output; an
        inner program's input -> the call's operand), or None."""
        inner = self.producer.get(("alias", id(var)))
        if inner is not None:
            return inner
        if id(var) not in self.producer:
            return self.producer.get(("input", id(var)))
        return None


def _is_var(v) -> bool:
    """A variable with an array type (not a literal)."""
    return hasattr(v, "aval") and hasattr(v.aval, "dtype") and not hasattr(v, "val")


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """What the audited step runs in which precision.

    Attributes:
      policy: the policy's name (e.g. `"bf16;autocast"`).
      compute_dtype: the policy's compute dtype name.
      half_fraction: share of matmul and convolution FLOPs (forward and backward) whose operands are both float16,
        bfloat16 or FP8; 1.0 when the step has no matmul.
      rows: one dict per matmul or convolution: `source` (`file.py:LINE` of the user's code), `library` (the
        library function that `source` called, e.g. `flax/linen/linear.py:Dense.__call__` from a linen module's own
        code; for a model called whole, as a Hugging Face model is, the same entry point on every row, which
        `weight` and `scope` tell apart; or ""), `primitive`, `lhs`,
        `rhs`, `out` (dtype names), `flops` (per step, times scan trip counts), `trips` (how many times a step
        runs it: the product of its enclosing scans' lengths, 1 outside a scan), `pass` (`"forward"` or
        `"backward"`), `shape`, `scope` (the names on its name stack: `"Model/block_0/Dense_1"`; Equinox's
        classes, `jax.named_scope`s), `callers` (the functions outside JAX and jaxamp that traced it, innermost
        first: `"Linear.__call__ < GPT.__call__ < loss_fn"`), `weight` (under autocast, the path of the param
        that is an operand, in the forward and in the backward matmuls derived from it: `"head.kernel"`,
        `"params.decoder.logitdense.kernel"`; "" for an activation x activation matmul or without autocast),
        `selection` (an operand is one-hot, `jax.nn.one_hot`'s: a gather written as a matmul, such as optax's
        `ctc_loss`'s, which autocast runs in its other operand's dtype; left out of `half_fraction` and
        `fallbacks`), and under a stateless FP8 recipe
        `fp8_excluded_by`: the `fp8_exclude` pattern that kept this half-precision weight matmul out of FP8, or
        None, and `fp8_excluded_name`: the name it matched (`"lm_head"`, `"Embed.attend"`), or None; under
        autocast `float32_result_by`: the `float32_results` pattern that made this half-precision matmul write
        float32 (the output head's logits), or None.
      fallbacks: the rows with a float32 operand under a half-precision policy (selections aside); the first holds
        `cause` too.
      half_accumulations: sums, scatter-adds and cumulative ops in half precision over more values than the format
        absorbs (`ABSORB_LIMIT`): dicts with `source`, `library`, `primitive`, `dtype`, `size` (values added per
        output element), `pass`.
      fp8_exclude: the policy's `fp8_exclude` patterns under a stateless FP8 recipe, else ().
      autocast: whether the policy runs the loss under `jaxamp.autocast` (what the warning then advises).
      float32_results: under autocast, the policy's `float32_results` patterns, else ().
      fp8: whether the policy asks for FP8 matmuls (delayed `fp8` or a stateless recipe): the summary then always
        gives the FP8 share, and the warning fires when it is 0.
      half_logits: under autocast, the forward weight matmuls whose half-precision result (or FP8 operands) goes
        into a softmax (`log_softmax`, `logsumexp`, optax's cross-entropies) or a log-sigmoid (binary and
        multi-label cross-entropies) or a `top_k` (an MoE router's) through elementwise and shape ops only: an
        output head or router that `float32_results` (or `fp8_exclude`) did not name; FP8 weight matmuls that
        reach the loss through no other matmul (an output layer); and, of the others, those whose result goes into
        an `argmin` or `argmax` so (a search: a VQ codebook's distances `|x|^2 - 2 x.E + |E|^2`, as Haiku's
        `VectorQuantizer` and MaskGIT's VQGAN compute them; a DQN's Q-values), whose pick changes where two entries
        score within the format's rounding (e4m3 distances picked another code for 6.0% of a test's inputs, bf16
        ones 0.9%, float32 results from bf16 operands 0.4%). Rows as `rows`, with `into`: `"softmax"`,
        `"log-sigmoid"`, `"top_k"`, `OUTPUT_LAYER`, `"argmin"` or `"argmax"`.
    """

    policy: str
    compute_dtype: str
    half_fraction: float
    rows: tuple
    fallbacks: tuple
    half_accumulations: tuple
    fp8_exclude: tuple = ()
    autocast: bool = False
    float32_results: tuple = ()
    fp8: bool = False
    half_logits: tuple = ()

    @property
    def fp8_unused_exclusions(self) -> tuple[str, ...]:
        """The `fp8_exclude` patterns that kept no matmul out of FP8 (a typo, or a model without such names)."""
        used = {r.get("fp8_excluded_by") for r in self.rows}
        return tuple(p for p in self.fp8_exclude if p not in used)

    @property
    def fp8_unused_added(self) -> tuple[str, ...]:
        """The unused patterns the user gave: all of them, except the defaults (`FP8_EXCLUDE`, which a model need
        not match) when the exclusions begin with them (`;fp8_exclude+=...`)."""
        return _given(self.fp8_unused_exclusions, self.fp8_exclude, FP8_EXCLUDE)

    @property
    def float32_results_unused(self) -> tuple[str, ...]:
        """The `float32_results` patterns the user gave that made no matmul write float32 (a typo, or a head named
        otherwise): all unused ones, except the defaults (`FLOAT32_RESULTS`, which a model need not match) when the
        patterns begin with them (`;float32_results+=...`)."""
        used = {r.get("float32_result_by") for r in self.rows}
        return _given(tuple(p for p in self.float32_results if p not in used), self.float32_results, FLOAT32_RESULTS)

    @property
    def fp8_fraction(self) -> float:
        """Share of the matmul FLOPs whose operands are both FP8 (`jaxamp.fp8_recipes` matmuls, Flax's FP8 ops on
        FP8 operands and on dequantized ones, `convert(f8) * scale`), of the FLOPs `half_fraction` counts (one-hot
        selections aside); 0.0 when the step has no matmul."""
        rows = [r for r in self.rows if not r.get("selection")]
        total = sum(r["flops"] for r in rows)
        fp8 = sum(r["flops"] for r in rows if r["lhs"].startswith("float8") and r["rhs"].startswith("float8"))
        return fp8 / total if total else 0.0

    def summary(self) -> str:
        """One line: the half share (and the FP8 share where there is one), the fallbacks and half-precision sums,
        and the largest source of each."""
        total = sum(r["flops"] for r in self.rows if not r.get("selection"))
        selected = sum(r["flops"] for r in self.rows if r.get("selection"))
        text = (f"precision audit ({self.policy}): {100 * self.half_fraction:.1f}% of {_flops_text(total)} of "
                f"matmuls in half precision")
        if self.fp8_fraction or self.fp8:
            text += f" ({100 * self.fp8_fraction:.1f}% in FP8)"
        if self.fp8 and not self.fp8_fraction:
            text += f"; {_NO_FP8}"
        grouped = sum(r["flops"] for r in self.rows if r["primitive"] == "ragged_dot_general"
                      and not r["lhs"].startswith("float8") and not r.get("fp8_excluded_by"))
        if self.fp8 and grouped:
            text += (f"; {_flops_text(grouped)} of grouped matmuls (lax.ragged_dot) in the compute dtype: FP8 takes "
                     "them in ragged_dot's own form (lhs [m, k], rhs [groups, k, n]) under per-tensor scaling "
                     "(fp8-current) only (an MoE's experts as a batched einsum run in FP8 under every recipe)")
        if selected:
            text += f"; {_flops_text(selected)} of one-hot selections besides, in their table's dtype"
        excluded = [r for r in self.rows if r.get("fp8_excluded_by") and r["pass"] == "forward"]
        if excluded:
            names = list(dict.fromkeys(r["fp8_excluded_name"] for r in excluded))
            text += (f"; {len(excluded)} weight matmul{'' if len(excluded) == 1 else 's'} kept out of FP8 by "
                     f"fp8_exclude ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
        head_in_fp8 = not excluded and bool(self.fp8_fraction and self.fp8_exclude) and not self.logits_note()
        if head_in_fp8:
            text += ("; fp8_exclude kept no matmul out of FP8 (the audit found no output head in FP8; one it "
                     "missed, under another name: name it in fp8_exclude or wrap it in jax.named_scope('head'))")
        if self.fp8_unused_added:
            text += f"; fp8_exclude patterns that match no matmul: {', '.join(self.fp8_unused_added)}"
        if not head_in_fp8:  # (a head in FP8 writes no float32 logits either: the FP8 note says so)
            text += self._float32_results_note()
        if self.fallbacks:
            source, flops = _costliest_source(self.fallbacks)
            share = 100 * flops / (sum(r["flops"] for r in self.rows) or 1)
            text += (f"; {sum(r['trips'] for r in self.fallbacks)} in float32, the most FLOPs at {source} "
                     f"({share:.1f}% of all)")
        if self.half_accumulations:
            worst = max(self.half_accumulations, key=lambda r: r["size"])
            text += (f"; {len(self.half_accumulations)} half-precision sums past the format's limit, largest "
                     f"{worst['size']:,} values in {worst['dtype']} at {worst['source']}")
        return text

    def _float32_results_note(self) -> str:
        """Under autocast with `float32_results`: the head that writes half-precision logits into a softmax or
        log-sigmoid (`logits_note`), else a note when no matmul wrote float32 (a regression's output, or a head the
        audit cannot see), and any pattern the user gave that matched nothing."""
        if not self.float32_results:
            return ""
        unused = self.float32_results_unused
        unused_text = f"; float32_results patterns that match no matmul: {', '.join(unused)}" if unused else ""
        logits = self.logits_note()
        if logits:
            return "; " + logits + unused_text
        forward = [r for r in self.rows if r["pass"] == "forward" and not r.get("selection")]
        if len(forward) >= 3 and all(r.get("float32_result_by") for r in forward):
            return (f"; float32_results made every forward matmul ({len(forward)}) write float32 (a pattern wider "
                    "than the output head: the activations between matmuls are float32)" + unused_text)
        if not any(r.get("float32_result_by") for r in self.rows):
            return ("; float32_results kept no matmul result float32 (no usual head name, and no half-precision "
                    "result reaches a softmax or log-sigmoid: right for a regression; a classifier's head the audit "
                    "cannot see takes ';float32_results+=NAME' or jax.named_scope('head'))" + unused_text)
        return unused_text

    def logits_note(self) -> str:
        """What to do about the largest output head in `half_logits` that the policy's patterns would cover if they
        named it (none where the user emptied them: `;float32_results=`, `;fp8_exclude=`), or "": the policy, its
        patterns extended by the head's module path, that keeps its logits float32 (and it out of FP8)."""
        heads = [r for r in self.half_logits
                 if (self.fp8_exclude if r["lhs"].startswith("float8") else self.float32_results)]
        if not heads:
            return ""
        head = max(heads, key=lambda r: (r.get("into") not in _SEARCHES, r["flops"]))  # (searches last)
        into = head.get("into", "softmax")
        if not head["weight"] and into in _SEARCHES:  # a codebook in the batch or the model's state (Haiku's EMA)
            return (f"the search at {head['source']} (its codebook is no param: an input of the step or the model's "
                    f"state) writes {head['out']} {_VALUES[into]} into {_a(into)} ({_SEARCH_WHY}): wrap that call in "
                    "jax.named_scope('head') (a default float32_results pattern) to keep them float32")
        if not head["weight"]:  # its weight is no param: no pattern can name it by path
            return (f"the {_KINDS.get(into, _HEAD)[0]} at {head['source']} (an operand is an input of the step "
                    f"outside the params: another network's weights, a graph's adjacency matrix) writes {head['out']} "
                    f"{_VALUES.get(into, 'logits')} into {_a(into)}: wrap that call in jax.named_scope('head') (a "
                    "default float32_results pattern), or "
                    "pass that network in the params, frozen (TrainState.create(..., trainable=)), where this audit "
                    "names the policy that keeps them float32")
        fp8 = head["lhs"].startswith("float8")
        # the same line's other heads too: a target network's copy read through stop_gradient, each layer's router
        alike = {head["weight"]: head}  # the largest first, each weight once
        for r in heads:
            if r["source"] == head["source"] and r.get("into") == into and r["weight"] and \
                    r["lhs"].startswith("float8") == fp8:
                alike.setdefault(r["weight"], r)
        alike = list(alike.values())
        patterns = _path_patterns([r["weight"] for r in alike])  # whole param paths: a module name recurs (`out`)
        starred = re.sub(r"\\(.)", r"\1", patterns[0][1:-1].replace("[0-9]+", "*"))  # `layers.*.gate.kernel`
        named = (f"{starred} ({len(alike)} layers)" if len(patterns) < len(alike)
                 else ", ".join(r["weight"] for r in alike))
        several = len(alike) > 1
        head_at = f"the {_KINDS.get(into, _HEAD)[several]} {named} at {head['source']}"
        why = _WHY.get(into, "a head, or a router, no pattern names")
        runs, feeds, it, writes = ("run", "feed", "them", "write") if several else ("runs", "feeds", "it", "writes")
        if not fp8:
            spec = self.policy
            for pattern in patterns:
                spec = _add_pattern(spec, "float32_results", pattern)
            return (f"{head_at} {writes} {head['out']} {_VALUES.get(into, 'logits')} into {_a(into)} ({why}): "
                    f"policy '{spec}' keeps them float32")
        spec = self.policy
        for pattern in patterns:
            spec = _add_pattern(spec, "fp8_exclude", pattern)
        if self.float32_results and not all(r.get("float32_results_names") for r in alike):  # (a default may)
            for pattern in patterns:
                spec = _add_pattern(spec, "float32_results", pattern)
        if into == OUTPUT_LAYER:
            return (f"{head_at} {runs} in FP8 and {feeds} the loss through no other matmul (an output layer no "
                    "pattern names, such as a regression or value head; Transformer Engine's recipes keep the "
                    f"output layer out of FP8): policy '{spec}' keeps {it} out")
        return f"{head_at} {runs} in FP8 into {_a(into)} ({why}): policy '{spec}' keeps {it} out"

    def __str__(self) -> str:
        """The summary, then the matmuls grouped by where they come from and their weight, its layer numbers as `*`
        (under autocast), largest FLOPs first (under a stateless FP8 recipe, with the `fp8_exclude` pattern that
        kept them out of FP8), the first fall-back's cause and the half-precision sums, as aligned columns for a
        terminal."""
        groups: dict = {}
        for r in self.rows:
            key = (r["source"], r["library"], r["pass"], r["primitive"], r["lhs"], r["rhs"], r["out"],
                   _layers(r.get("weight", "")) or "-", r.get("fp8_excluded_by") or "-")
            count, flops = groups.get(key, (0, 0))
            groups[key] = (count + r["trips"], flops + r["flops"])
        total = sum(r["flops"] for r in self.rows) or 1
        rows = [(src, lib or "-", pas, f"{prim} x{count}", f"{lhs} x {rhs} -> {out}", f"{100 * flops / total:.1f}%",
                 weight, excluded)
                for (src, lib, pas, prim, lhs, rhs, out, weight, excluded), (count, flops)
                in sorted(groups.items(), key=lambda kv: -kv[1][1])]
        header = ("source", "library", "pass", "op", "dtypes", "FLOPs", "weight", "kept out of FP8 by")
        keep = [True] * 6 + [any(r.get("weight") for r in self.rows), bool(self.fp8_exclude)]
        header, rows = _keep(header, keep), [_keep(row, keep) for row in rows]
        lines = [self.summary(), "", _columns(header, rows)]
        if self.fallbacks:
            lines += ["", f"first float32 fall-back at {self.fallbacks[0]['source']}: {self.fallbacks[0]['cause']}"]
        if self.half_accumulations:
            sums = [(r["source"], r["library"] or "-", r["pass"], r["primitive"], r["dtype"], f"{r['size']:,}")
                    for r in self.half_accumulations]
            lines += ["", "half-precision sums past the format's limit:",
                      _columns(("source", "library", "pass", "op", "dtype", "values"), sums)]
        return "\n".join(lines)


_NO_FP8 = ("the policy asks for FP8 but no matmul ran in FP8 (FP8 covers weight matmuls, dot_general and an MoE's "
           "ragged_dot: convolutions and activation x activation matmuls stay in the compute dtype; fp8_exclude "
           "keeps the output head out)")


def _class_sizes(eqn) -> set | None:
    """The sizes a head's softmax axis may have: a `dot_general`'s output features, the free dimensions (size > 1)
    of an operand of rank 2 or less (a weight; not an attention pooling's `Dense(1)` scorer, whose softmax runs over
    the sequence); None (any) for a convolution."""
    if eqn.primitive.name != "dot_general":
        return None
    (contract_l, contract_r), (batch_l, batch_r) = eqn.params["dimension_numbers"]
    sizes = set()
    for v, used in ((eqn.invars[0], (*contract_l, *batch_l)), (eqn.invars[1], (*contract_r, *batch_r))):
        if len(v.aval.shape) <= 2:
            sizes |= {n for d, n in enumerate(v.aval.shape) if d not in used and n > 1}
    return sizes


def _router_shaped(eqn) -> bool:
    """A weight matmul whose `top_k` may be a router's: fewer output features (experts: 8 to 384) than it contracts
    (the model width), not a TopK sparse autoencoder's encoder (a dictionary wider than its input)."""
    if eqn.primitive.name != "dot_general" or not eqn.outvars[0].aval.shape:
        return False
    (contract, _), _ = eqn.params["dimension_numbers"]  # top_k runs over the last axis: the output features
    return eqn.outvars[0].aval.shape[-1] <= math.prod(eqn.invars[0].aval.shape[d] for d in contract)


def _add_pattern(policy: str, rule: str, pattern: str) -> str:
    """The policy spec `policy` with `pattern` added to its `rule` (`fp8_exclude`, `float32_results`): to the patterns
    its `;rule+=` or `;rule=` already gives, else as `;rule+=pattern` (a rule given twice is refused)."""
    parts = policy.split(";")
    for i, part in enumerate(parts):
        name, eq, patterns = part.partition("=")
        if eq and name.strip() in (rule, rule + "+"):
            parts[i] = f"{part},{pattern}" if patterns.strip() else part + pattern
            return ";".join(parts)
    return f"{policy};{rule}+={pattern}"


def _costliest_source(rows: list[dict]) -> tuple[str, float]:
    """The `source` whose rows add up to the most FLOPs (each row's `flops` counts its trips), and those FLOPs: a
    layer called in every block outweighs one large matmul elsewhere, as the table's grouped lines show."""
    totals: dict = {}
    for r in rows:
        totals[r["source"]] = totals.get(r["source"], 0) + r["flops"]
    return max(totals.items(), key=lambda kv: kv[1])


def _flops_text(flops: float) -> str:
    """`"5,107.0 GFLOP"`, `"12.6 MFLOP"`, `"10.2 kFLOP"` (a toy model, "0.0 MFLOP" otherwise): FLOPs per step in
    the unit that reads best."""
    if flops < 5e4:
        return f"{flops / 1e3:,.1f} kFLOP"
    return f"{flops / 1e9:,.1f} GFLOP" if flops >= 1e9 else f"{flops / 1e6:,.1f} MFLOP"


def _given(unused: tuple[str, ...], patterns: tuple[str, ...], defaults: tuple[str, ...]) -> tuple[str, ...]:
    """The `unused` patterns the user gave: all, except `defaults` when `patterns` begin with them (`;NAME+=...`)."""
    skip = defaults if patterns[:len(defaults)] == defaults else ()
    return tuple(p for p in unused if p not in skip)


def _path_patterns(paths: list[str]) -> list[str]:
    r"""Anchored patterns that name each of `paths` (param paths of one source line's heads): one pattern where the
    paths differ only in whole-number components (each layer's router of a 48-layer stack: `layers\.[0-9]+\.`),
    those components alone as `[0-9]+` (`Dense_0` stays `Dense_0`), else one per path."""
    exact = [f"^{re.escape(p)}$" for p in paths]
    split = [re.split(r"((?:^|(?<=[._/]))[0-9]+(?=$|[._/]))", p) for p in paths]  # [text, number, text, ...]
    if len(paths) < 2 or len({len(parts) for parts in split}) > 1:
        return exact
    pattern = []
    for i, column in enumerate(zip(*split)):
        if len(set(column)) == 1:
            pattern.append(re.escape(column[0]))
        elif i % 2:  # a layer number that differs
            pattern.append("[0-9]+")
        else:
            return exact
    return [f"^{''.join(pattern)}$"]


def _layers(weight: str) -> str:
    """A param path with its layer numbers as `*` (`"h.*.mlp.c_fc.kernel"`, `"Dense_*.kernel"`): one table row for
    the same weight of every layer."""
    return re.sub(r"(^|[._/])[0-9]+(?=$|[._/])", r"\1*", weight)  # whole numbers only: `linear1` stays


def _keep(row: tuple, keep: list) -> tuple:
    return tuple(x for x, k in zip(row, keep) if k)


def _columns(header: tuple, rows: list) -> str:
    """Rows of strings as left-aligned columns under a header."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*row).rstrip() for row in (header, *rows))


def audit_jaxpr(closed_jaxpr, *, policy: str, compute_dtype, fp8_exclude=None, autocast: bool = False,
                float32_results=None, fp8: bool = False) -> PrecisionReport:
    """The report of a traced step (`jax.make_jaxpr` of its gradient computation).

    Args:
      closed_jaxpr: the traced program.
      policy: the policy's name, for the report.
      compute_dtype: the policy's compute dtype: fall-backs are counted only when it is a half-precision type.
      fp8_exclude: under a stateless FP8 recipe, the policy's `fp8_exclude` patterns (each half-precision weight
        matmul's row then says which one kept it out of FP8); None otherwise.
      autocast: whether the policy runs the loss under `jaxamp.autocast` (recorded in the report).
      float32_results: under autocast, the policy's `float32_results` patterns (each half-precision matmul with a
        float32 result then says which one made it so); None otherwise.
      fp8: whether the policy asks for FP8 matmuls (recorded in the report).

    Returns:
      A `PrecisionReport`.
    """
    compute_half = _is_half(compute_dtype)
    walk = _Walk()
    walk.visit(closed_jaxpr.jaxpr, 1, compute_half)
    _user_sources(walk.rows)
    if fp8_exclude is not None:
        _mark_fp8_exclusions(walk, fp8_exclude)
    if float32_results is not None:
        _mark_float32_results(walk, float32_results)
    counted = [r for r in walk.rows if not r.get("selection")]  # (a one-hot matmul selects: it runs as its input)
    total = sum(r["flops"] for r in counted)
    half = sum(r["flops"] for r in counted if _half_operands(r["lhs"], r["rhs"]))
    fallbacks = [dict(r) for r in counted if compute_half and not _half_operands(r["lhs"], r["rhs"])]
    # (a weight matmul: a param operand, or an operand that is another input of the step, such as the other
    # network's weights a GAN's generator step takes in its batch; not attention's product of two activations)
    results = [re.compile(p) for p in float32_results or ()]
    def named(eqn, scopes) -> bool:  # (an FP8 head a float32_results pattern would keep float32)
        return any(rx.search(n) for rx in results for n in exclusion_names(eqn, scopes))

    into = [(r, eqn, scopes, walk.feeds_softmax(eqn.outvars[0], _class_sizes(eqn)))
            for r, eqn, scopes in zip(walk.rows, walk.eqns, walk.names)
            if autocast and r["pass"] == "forward" and (_is_half(r["out"]) or r["lhs"].startswith("float8"))
            and (r["weight"] or (any(walk.from_input(v) for v in eqn.invars[:2]) and not walk.attends(eqn.outvars[0])))]
    half_logits = [{**r, "into": kind, "float32_results_names": named(eqn, scopes)} for r, eqn, scopes, kind in into
                   if kind and kind not in _SEARCHES and (kind != "top_k" or _router_shaped(eqn))]
    # an FP8 weight matmul whose result reaches the loss through no other matmul: an output layer (a regression or
    # value head: no softmax finds it), which Transformer Engine's recipes keep out of FP8 as they keep a head
    found = {(r["source"], r["weight"]) for r in half_logits}
    half_logits += [{**r, "into": OUTPUT_LAYER, "float32_results_names": named(eqn, scopes)}
                    for r, eqn, scopes in zip(walk.rows, walk.eqns, walk.names)
                    if autocast and r["pass"] == "forward" and r["weight"] and r["lhs"].startswith("float8")
                    and (r["source"], r["weight"]) not in found
                    and not walk.feeds_matmul(eqn.outvars[0], loop=walk.per_trip(eqn))]
    # a search (a VQ codebook's distances into an argmin, Q-values into an argmax) no head or output layer found
    found = {(r["source"], r["weight"]) for r in half_logits}
    half_logits += [{**r, "into": kind, "float32_results_names": named(eqn, scopes)} for r, eqn, scopes, kind in into
                    if kind in _SEARCHES and (r["source"], r["weight"]) not in found
                    and walk.only_searched(eqn.outvars[0])]
    if fallbacks:
        row, eqn = walk.first_fallback
        fallbacks[0]["cause"] = walk.cause(eqn)
    return PrecisionReport(policy=policy, compute_dtype=jnp.dtype(compute_dtype).name,
                           half_fraction=half / total if total else 1.0, rows=tuple(walk.rows),
                           fallbacks=tuple(fallbacks) if compute_half else (),
                           half_accumulations=tuple(walk.sums),
                           fp8_exclude=tuple(fp8_exclude) if fp8_exclude is not None else (),
                           autocast=autocast,
                           float32_results=tuple(float32_results) if float32_results is not None else (),
                           fp8=fp8, half_logits=tuple(half_logits))


OUTPUT_LAYER = "the loss through no other matmul"


def _user_sources(rows: list) -> None:
    """A row with no user frame (its source is the library's entry point: a remat'd layer's forward, which a
    gradient's partial evaluation moves out of the remat with the body's traceback) takes the user's line of another
    row of the same weight and library (its backward), in place."""
    known = {(r["weight"], r["library"]): r["source"] for r in rows if r["weight"] and r["source"] != r["library"]}
    for r in rows:
        if r["source"] == r["library"] and (r["weight"], r["library"]) in known:
            r["source"] = known[(r["weight"], r["library"])]

# What `logits_note` calls a matmul (one, several) by what its result goes into (else an output head's logits), what
# it writes, and why it names it.
_HEAD = ("output head", "output heads")
_KINDS = {"top_k": ("router", "routers"), "argmin": ("search over", "searches over"),
          "argmax": ("search over", "searches over")}
_VALUES = {"argmin": "distances", "argmax": "scores"}
_SEARCH_WHY = ("a nearest-neighbour search, such as a VQ codebook's, no pattern names: its pick changes where two "
               "entries score within the format's rounding")
_WHY = {"argmin": _SEARCH_WHY, "argmax": _SEARCH_WHY}


def _a(into: str) -> str:
    """`"a softmax"`, `"an argmin"`: what a result goes into, with its article."""
    return f"{'an' if into[:1] in 'aeiou' else 'a'} {into}"


def _mark_fp8_exclusions(walk: _Walk, fp8_exclude) -> None:
    """Each row's `fp8_excluded_by` and `fp8_excluded_name`: for a half-precision (not FP8) weight matmul, the
    first pattern found in a name of its scope, weight or call stack (as `autocast_rules.fp8_applies` decides) and
    that name, else None."""
    patterns = [(p, re.compile(p)) for p in fp8_exclude]
    for row, eqn, scopes in zip(walk.rows, walk.eqns, walk.names):
        # What an FP8 recipe would take (autocast_rules.fp8_applies): a dot_general with a param operand (batch dims
        # allowed: an MoE's experts), or without batch dims; a ragged_dot.
        batched = eqn.primitive.name == "dot_general" and eqn.params["dimension_numbers"][1][0]
        weight = eqn.primitive.name == "ragged_dot_general" or (
            eqn.primitive.name == "dot_general" and bool(row.get("weight") or not batched))
        names = exclusion_names(eqn, scopes)
        kept_out = weight and _half_operands(row["lhs"], row["rhs"]) and not row["lhs"].startswith("float8")
        match = next(((p, n) for p, rx in patterns for n in names if rx.search(n)), (None, None)) if kept_out \
            else (None, None)
        row["fp8_excluded_by"], row["fp8_excluded_name"] = match


def _mark_float32_results(walk: _Walk, float32_results) -> None:
    """Each row's `float32_result_by`: for a `dot_general` or convolution with half-precision (not FP8) operands and
    a float32 result, the first `float32_results` pattern found in a name of its scope, weight or call stack (as
    `autocast_rules.float32_result_applies` decides), else None."""
    patterns = [(p, re.compile(p)) for p in float32_results]
    for row, eqn, scopes in zip(walk.rows, walk.eqns, walk.names):
        wrote = (eqn.primitive.name in ("dot_general", "conv_general_dilated") and row["out"] == "float32"
                 and _half_operands(row["lhs"], row["rhs"]) and not row["lhs"].startswith("float8"))
        names = exclusion_names(eqn, scopes) if wrote else []
        row["float32_result_by"] = next((p for p, rx in patterns for n in names if rx.search(n)), None)


def _float32_results(policy):
    """The policy's `float32_results` patterns under autocast, else None."""
    return tuple(getattr(policy, "float32_results", FLOAT32_RESULTS)) if uses_autocast(policy) else None


def _asks_fp8(policy) -> bool:
    """Whether `policy` asks for FP8 matmuls: delayed scaling (`fp8`) or a stateless recipe (`fp8-current`, ...)."""
    return uses_fp8(policy) or fp8_recipe(policy) is not None


def _fp8_exclude(policy):
    """The policy's `fp8_exclude` patterns under a stateless FP8 recipe, else None."""
    return tuple(getattr(policy, "fp8_exclude", FP8_EXCLUDE)) if fp8_recipe(policy) else None


def warn_if_degraded(report: PrecisionReport, *, threshold: float = 0.9, where: str = "train_step") -> bool:
    """One `PrecisionWarning` when a half-precision step runs under `threshold` of its matmul FLOPs in half
    precision, sums in half precision past the format's limit, asks for FP8 and runs no matmul in FP8, or has
    `fp8_exclude` patterns the user gave that match no matmul; returns whether it warned."""
    if not _is_half(report.compute_dtype):
        return False
    problems = []
    if report.half_fraction < threshold:
        source = _costliest_source(report.fallbacks)[0] if report.fallbacks else None
        problems.append(f"only {100 * report.half_fraction:.1f}% of its matmul FLOPs run in half precision"
                        + (f" (the most float32 matmul FLOPs at {source}; first fall-back: "
                           f"{report.fallbacks[0]['cause']})" if source else ""))
    if report.half_accumulations:
        worst = max(report.half_accumulations, key=lambda r: r["size"])
        problems.append(f"{len(report.half_accumulations)} sums in half precision add more values than "
                        f"{report.compute_dtype} absorbs (largest: {worst['size']:,} values in {worst['dtype']} at "
                        f"{worst['source']})")
    if report.fp8 and not report.fp8_fraction:
        problems.append(_NO_FP8)
    if report.logits_note():
        problems.append(report.logits_note())
    if report.fp8_unused_added:
        problems.append(f"the fp8_exclude patterns {', '.join(report.fp8_unused_added)} match no matmul (a typo? "
                        "each is searched in the names on a matmul's name stack, its weight's param path and "
                        "the functions that called it: see the audit's scope, weight and callers)")
    if not problems:
        return False
    degraded = report.half_fraction < threshold or bool(report.half_accumulations)
    advice = ""
    if report.autocast and report.half_fraction < threshold:
        advice = ("; under autocast, a float32 matmul is one the code keeps so (inside a jaxamp.autocast.disabled() "
                  "region, or a custom_vjp, which runs as written) or a float64 one: the cause names it")
    elif report.autocast and report.half_accumulations:
        advice = ("; under autocast, a half-precision sum comes from the model's own casts (a dtype=jnp.bfloat16 or "
                  "float16 in a Flax or Hugging Face config): build the model in float32 and let autocast choose")
    elif degraded:
        advice = ("; get_policy(..., autocast=True) computes the matmuls of unchanged float32 code in half precision "
                  "with float32 sums")
    text = (f"{where} under policy {report.policy!r}: " + "; ".join(problems)
            + f". {'jaxamp.nnx' if where.startswith('jaxamp.nnx') else 'jaxamp'}.precision_audit(...) lists every op"
            + advice)
    frame = _users_frame()
    if frame is None:
        warnings.warn(text, PrecisionWarning, stacklevel=3)
    else:  # at the user's line, and each time (once per compilation: no once-per-line registry)
        warnings.warn_explicit(text, PrecisionWarning, frame.f_code.co_filename, frame.f_lineno,
                               module=frame.f_globals.get("__name__") or frame.f_code.co_filename, registry={})
        # (no module_globals: a `python -c` program's __loader__ is BuiltinImporter, whose get_source raises)
    return True


def precision_audit(state, batch: PyTree, loss_fn, *, accum_steps: int = 1, carry: PyTree = None) -> PrecisionReport:
    """Traces (does not run) the gradient computation `train_step(state, batch, loss_fn)` would run and reports
    what runs in which precision, forward and backward (see the module docstring).

    Args:
      state: the `TrainState` (its policy, loss scale, params and trainable mask shape the program).
      batch: a batch as `train_step` takes it (arrays or `jax.ShapeDtypeStruct`s: nothing is computed).
      loss_fn: as for `train_step`.
      accum_steps: micro-batches, as for `train_step` (a `scan` body's FLOPs count `accum_steps` times).
      carry: a stateful loss's state, as for `jaxamp.step.train_step_with_carry`. None = the state's `model_state`
        (BatchNorm statistics, which `train_step` hands the loss as its fourth argument), or none when the state has
        none.

    Returns:
      A `PrecisionReport`; `str(report)` is a table, `report.summary()` one line.
    """

    def grads(state, batch, carry):
        rng = jax.random.fold_in(state.rng, state.step)
        return gradients(state, batch, loss_fn, state.loss_scale, rng, accum_steps, False, carry).grads

    carry = getattr(state, "model_state", None) if carry is None else carry
    check_loss_args(loss_fn, ("params", "batch", "rng") + (() if carry is None else ("model_state",)),
                    "precision_audit")
    closed = jax.make_jaxpr(grads)(state, batch, carry)
    return audit_jaxpr(closed, policy=policy_name(state.policy), compute_dtype=state.policy.compute_dtype,
                       fp8_exclude=_fp8_exclude(state.policy), autocast=uses_autocast(state.policy),
                       float32_results=_float32_results(state.policy), fp8=_asks_fp8(state.policy))


def check_program(closed_jaxpr, policy, *, where: str) -> None:
    """What `train_step` runs while it is traced: under a half-precision policy, audits the step's gradient program
    (the one it runs) and warns (`warn_if_degraded`), once per trace, i.e. once per compilation of a jitted step."""
    if _is_half(policy.compute_dtype):
        report = audit_jaxpr(closed_jaxpr, policy=policy_name(policy), compute_dtype=policy.compute_dtype,
                             fp8_exclude=_fp8_exclude(policy), autocast=uses_autocast(policy),
                             float32_results=_float32_results(policy), fp8=_asks_fp8(policy))
        warn_if_degraded(report, where=where)
