"""The `Trial` record: one outside model, its float32 state, a batch maker and its loss in jaxamp's form."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class Trial:
    """One outside model at a tiny size, ready for `jaxamp.train_step` / `jaxamp.nnx.train_step`.

    kind: "linen" (a flax.linen module), "nnx" (an `nnx.Module`), "equinox" (an `eqx.Module`, trained as its
      `eqx.partition(model, eqx.is_inexact_array)` params), "hf" (a Hugging Face Flax model, trained as its params).
    params: the float32 params to give `TrainState.create(params=...)` (linen, hf, equinox); None for nnx.
    model: the model object: the linen module, the HF model, the equinox module (whole), the NNX module (which
      `jaxamp.nnx.Optimizer(model, ...)` and `jaxamp.nnx.train_step(model, ...)` take, and update in place).
    static: equinox: the static half of the partition, which `loss_fn` combines with the params; else None.
    make_batch: `make_batch(key) -> batch`: a tiny, realistic batch (int32 ids, float32 images, ...).
    loss_fn: params kinds: `loss_fn(params, batch, rng) -> loss | (loss, aux)`; nnx: `loss_fn(model, batch)`. Written
      as the codebase's own training script writes its loss, with no casts of ours.
    source: where the model code comes from (package or sdist file, version, licence).
    precision: where the model's precision lives, as its authors ship it.
    notes: what the trial does that the original training script does differently (mutable state, pmap, ...).
    """

    name: str
    kind: str
    model: Any
    make_batch: Callable[[Any], Any]
    loss_fn: Callable
    params: Any = None
    static: Any = None
    source: str = ""
    precision: str = ""
    notes: str = ""
