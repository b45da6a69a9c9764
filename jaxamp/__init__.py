"""jaxamp: mixed-precision training for JAX (float16/bfloat16 compute, float32 master weights, loss scaling)."""

from typing import TYPE_CHECKING

from jaxamp.audit import PrecisionReport, PrecisionWarning, precision_audit
from jaxamp.autocasting import AutocastError, autocast, float32_reference
from jaxamp.finite import all_finite, finite_leaves
from jaxamp.gradients import WeightedLoss
from jaxamp.loss_scale import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale
from jaxamp.precision import PRESETS, Policy, get_policy
from jaxamp.scaled import select_tree, value_and_grad
from jaxamp.state import TrainState
from jaxamp.step import eval_step, train_step

if TYPE_CHECKING:
    from jaxamp.checkpoint import Checkpointer, CheckpointError, CheckpointMismatchError, CheckpointSaveError

__version__ = "0.1.0"

__all__ = [
    "AutocastError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "Checkpointer",
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "PRESETS",
    "Policy",
    "PrecisionReport",
    "PrecisionWarning",
    "StaticLossScale",
    "TrainState",
    "WeightedLoss",
    "all_finite",
    "autocast",
    "eval_step",
    "finite_leaves",
    "float32_reference",
    "get_policy",
    "precision_audit",
    "select_tree",
    "train_step",
    "value_and_grad",
]

# jaxamp.checkpoint's names, imported on first use: orbax-checkpoint adds 1-2 s to `import jaxamp` otherwise.
_CHECKPOINT_NAMES = frozenset({"CheckpointError", "CheckpointMismatchError", "CheckpointSaveError", "Checkpointer"})


def __getattr__(name: str):
    if name in _CHECKPOINT_NAMES:
        from jaxamp import checkpoint

        value = globals()[name] = getattr(checkpoint, name)
        return value
    raise AttributeError(f"module 'jaxamp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _CHECKPOINT_NAMES)
