"""Flax linen ImageNet ResNet V1.5 (`examples/imagenet/models.py`), BatchNorm with `batch_stats`.

Source: Flax's PyPI sdist of the installed version (0.12.8 here), `examples/imagenet/models.py`, imported unchanged;
the loss is `cross_entropy_loss` of `examples/imagenet/train.py`, run as published (its `NUM_CLASSES` global set to
the trial's 10 classes), plus train.py's `loss_fn` body (weight decay 1e-4 on every param with ndim > 1,
`mutable=['batch_stats']`). Licence: Apache-2.0, (c) The Flax Authors.

Where its precision lives, as shipped:
- `ResNet.dtype` (default float32) goes to every `nn.Conv` (`partial(conv, use_bias=False, dtype=self.dtype)`), every
  `nn.BatchNorm` (`dtype=self.dtype`) and the final `nn.Dense`; the logits are cast with `jnp.asarray(x, self.dtype)`.
  train.py's `create_model` sets it to float16 on GPU / bfloat16 on TPU when `config.half_precision`, and then uses
  Flax's own `DynamicScale` on GPU.
- No `param_dtype`: params and `batch_stats` float32. BatchNorm computes mean/var in float32
  (`promote_types(dtype, float32)`) and its running statistics stay float32 whatever `dtype` is.
- `nn.Conv(dtype=float32)` promotes a bf16 kernel (jaxamp's cast policy) back to float32: the cast policy alone
  runs every convolution in float32.

Trial: `ResNet(stage_sizes=[1, 1], block_cls=ResNetBlock, num_classes=10, num_filters=8, dtype=float32)` (the
example's own `_ResNet1` pattern with two stages), 8x8x3 float32 images, batch 4, train mode.

BatchNorm without pmap: the model builds `nn.BatchNorm(axis_name='batch')` unconditionally (no constructor argument
turns it off; `conv` is the only layer argument), and train.py runs it under `jax.pmap(..., axis_name='batch')`.
Under plain `jax.jit` that is "unbound axis name: batch". The trial keeps the model as published and binds the axis
the way pmap would on one device: the loss runs the model under `jax.vmap(..., axis_name='batch')` over a leading
device axis of size 1 (`images[None]`), so BatchNorm's `pmean` of its batch statistics is the mean over one device,
exactly what a one-device pmap computes.

Mutable state: `batch_stats` is kept outside the TrainState, as the jaxamp README says: it goes in the batch
(`batch["batch_stats"]`) and the updated statistics come back in aux (`aux["batch_stats"]`, with the logits);
`make_batch` puts the initial statistics in (a test that trains feeds each step's `aux["batch_stats"]` to the next).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax.training import common_utils

from . import sources
from .trial import Trial

NUM_CLASSES, SIZE, BATCH = 10, 8, 4


def _modules():
    root = sources.flax_source() / "examples" / "imagenet"
    models = sources.load_module(root / "models.py", "outside_imagenet_models")
    train = sources.load_functions(root / "train.py", ("cross_entropy_loss",),
                                   {"jnp": jnp, "optax": optax, "common_utils": common_utils,
                                    "NUM_CLASSES": NUM_CLASSES})
    return models, train["cross_entropy_loss"]


def trial(batch: int = BATCH) -> Trial:
    models, cross_entropy_loss = _modules()
    model = models.ResNet(stage_sizes=[1, 1], block_cls=models.ResNetBlock, num_classes=NUM_CLASSES,
                          num_filters=8, dtype=jnp.float32)
    # train.py's initialized(): a jitted model.init (Flax's BatchNorm skips its pmean while initializing)
    variables = jax.jit(model.init)({"params": jax.random.key(0)}, jnp.ones((1, SIZE, SIZE, 3), jnp.float32))
    params, batch_stats = variables["params"], variables["batch_stats"]

    def make_batch(key):
        """{"image": f32[batch, 8, 8, 3], "label": i32[batch], "batch_stats": the model's initial statistics}."""
        k_img, k_lab = jax.random.split(key)
        return {"image": jax.random.normal(k_img, (batch, SIZE, SIZE, 3), jnp.float32),
                "label": jax.random.randint(k_lab, (batch,), 0, NUM_CLASSES, dtype=jnp.int32),
                "batch_stats": batch_stats}

    def loss_fn(params, batch, rng):
        """imagenet train.py's loss_fn: cross-entropy + 1e-4/2 * sum of squares of the ndim > 1 params."""
        del rng  # the ResNet has no dropout

        def apply(image):  # one "device" of train.py's pmap
            return model.apply({"params": params, "batch_stats": batch["batch_stats"]}, image,
                               mutable=["batch_stats"])

        logits, new_model_state = jax.vmap(apply, axis_name="batch")(batch["image"][None])
        logits, new_model_state = logits[0], jax.tree.map(lambda x: x[0], new_model_state)
        loss = cross_entropy_loss(logits, batch["label"])
        weight_penalty_params = jax.tree_util.tree_leaves(params)
        weight_decay = 0.0001
        weight_l2 = sum(jnp.sum(x**2) for x in weight_penalty_params if x.ndim > 1)
        weight_penalty = weight_decay * 0.5 * weight_l2
        loss = loss + weight_penalty
        return loss, {"batch_stats": new_model_state["batch_stats"], "logits": logits}

    return Trial(
        name="imagenet_resnet", kind="linen", model=model, params=params, make_batch=make_batch, loss_fn=loss_fn,
        source=f"flax {sources.flax_version()} sdist: examples/imagenet/models.py (+ train.py's loss); Apache-2.0",
        precision="ResNet.dtype (float32 here; train.py: float16/bfloat16 if half_precision) on Conv, BatchNorm, "
                  "Dense; params and batch_stats float32; BatchNorm statistics float32",
        notes="BatchNorm(axis_name='batch') bound by jax.vmap(axis_name='batch') over a size-1 device axis instead "
              "of pmap; batch_stats in the batch, updated ones in aux['batch_stats']")
