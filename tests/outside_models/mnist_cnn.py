"""The Flax NNX MNIST tutorial's CNN (`docs_nnx/mnist_tutorial.md`): nnx.Conv, nnx.BatchNorm, nnx.Dropout,
avg_pool, nnx.Linear.

Source: Flax's PyPI sdist of the installed version (0.12.8 here), `docs_nnx/mnist_tutorial.md` (the MyST twin of
`mnist_tutorial.ipynb`): the code cells' `class CNN` and `def loss_fn` are run as published, with their cells'
import statements and nothing else of those cells (`sources.load_code_cell`). Licence: Apache-2.0, (c) The Flax
Authors.

Where its precision lives, as shipped: nowhere. No layer gets `dtype=` or `param_dtype=`: params float32, and each
`nnx.Conv`/`nnx.Linear` computes in the result dtype of its input and its kernel (`promote_dtype`), so under
jaxamp's cast policy the first conv meets a float32 image and a bf16 kernel (strict promotion: an error; standard:
float32). `nnx.BatchNorm` without `dtype=` returns float32 (its statistics are float32 and it promotes), so the
layer after each BatchNorm also sees a float32 input. Its running statistics (`nnx.BatchStat`) stay float32.

Size: fixed by the tutorial (`nnx.Linear(3136, 256)` needs 28x28x1 images): conv 32/64 channels, 0.82M params;
batch 4.

Train mode and randomness, as the tutorial does them: the trial's model is the tutorial's
`train_model = nnx.view(model, deterministic=False, use_running_average=False)`, and its `loss_fn(model, batch,
rngs)` gets an `nnx.Rngs` for dropout. jaxamp's NNX loss has no rng argument and this CNN holds no `nnx.Rngs`, so the
key comes in the batch (`batch["dropout_key"]`, new per `make_batch(key)`) and the trial's loss builds
`nnx.Rngs(batch["dropout_key"])` for the tutorial's loss. BatchNorm's statistics update in place through
`jaxamp.nnx.train_step`'s carry.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from . import sources
from .trial import Trial

BATCH = 4


def _tutorial():
    path = sources.flax_source() / "docs_nnx" / "mnist_tutorial.md"
    ns = sources.load_code_cell(path, ("CNN", "loss_fn"), {"__name__": "outside_mnist_tutorial", "jnp": jnp,
                                                          "optax": optax, "nnx": nnx})
    return ns["CNN"], ns["loss_fn"]


def make_batch(key, batch: int = BATCH):
    """{"image": f32[B, 28, 28, 1] in [0, 1] (the tutorial's /255 scaling), "label": i32[B], "dropout_key": u32[2]}."""
    k_img, k_lab, k_drop = jax.random.split(key, 3)
    return {"image": jax.random.uniform(k_img, (batch, 28, 28, 1), jnp.float32),
            "label": jax.random.randint(k_lab, (batch,), 0, 10, dtype=jnp.int32),
            "dropout_key": jax.random.key_data(k_drop)}


def trial(batch: int = BATCH) -> Trial:
    CNN, tutorial_loss_fn = _tutorial()
    model = CNN(rngs=nnx.Rngs(0))
    train_model = nnx.view(model, deterministic=False, use_running_average=False)

    def loss_fn(model, batch):
        """The tutorial's loss_fn(model, batch, rngs): softmax cross-entropy with integer labels, (loss, logits).

        Under "standard" promotion: Flax's `avg_pool` (`flax/linen/pooling.py`) divides a float32 sum by an int32
        window size, which strict promotion refuses.
        """
        with jax.numpy_dtype_promotion("standard"):
            return tutorial_loss_fn(model, batch, nnx.Rngs(batch["dropout_key"]))

    return Trial(
        name="mnist_cnn_nnx", kind="nnx", model=train_model,
        make_batch=functools.partial(make_batch, batch=batch), loss_fn=loss_fn,
        source=f"flax {sources.flax_version()} sdist: docs_nnx/mnist_tutorial.md (class CNN, loss_fn); Apache-2.0",
        precision="none set: no dtype/param_dtype; Conv/Linear compute in promote(input, kernel); BatchNorm "
                  "without dtype returns float32; BatchStat float32",
        notes="model = the tutorial's train view (nnx.view deterministic=False, use_running_average=False); "
              "dropout key in the batch, nnx.Rngs built in the loss; 28x28 fixed by Linear(3136, 256); loss under "
              "standard promotion (avg_pool is not strict-clean)")
