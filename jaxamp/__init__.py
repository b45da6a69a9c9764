"""jaxamp: mixed-precision training for JAX (float16/bfloat16 compute, float32 master weights, loss scaling)."""

from jaxamp.audit import PrecisionReport, PrecisionWarning, precision_audit
from jaxamp.autocasting import AutocastError, autocast, float32_reference
from jaxamp.finite import all_finite, finite_leaves
from jaxamp.loss_scale import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale
from jaxamp.precision import PRESETS, Policy, get_policy
from jaxamp.state import TrainState
from jaxamp.step import eval_step, train_step

__version__ = "0.1.0"

__all__ = [
    "AutocastError",
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "PRESETS",
    "Policy",
    "PrecisionReport",
    "PrecisionWarning",
    "StaticLossScale",
    "TrainState",
    "all_finite",
    "autocast",
    "eval_step",
    "finite_leaves",
    "float32_reference",
    "get_policy",
    "precision_audit",
    "train_step",
]
