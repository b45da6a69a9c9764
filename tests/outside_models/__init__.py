"""Six public model codebases, their model code unchanged, as trials for jaxamp's tests and benchmarks.

`TRIALS[name]()` builds a `Trial` (see `trial.py`): the model at a tiny size with float32 params, `make_batch(key)`
(4 sequences or images; `TRIALS[name](batch=32)` for 32), and the loss in jaxamp's form, written as the codebase's
own training script writes it.

| name | kind | model | code from |
| --- | --- | --- | --- |
| lm1b | linen | Flax lm1b `TransformerLM` + `TransformerConfig` | flax sdist `examples/lm1b/models.py` |
| imagenet_resnet | linen | Flax ImageNet `ResNet` (BatchNorm, `batch_stats`) | flax sdist `examples/imagenet/models.py` |
| gemma_nnx | nnx | Flax NNX Gemma `Transformer` | flax sdist `examples/gemma/*.py` |
| mnist_cnn_nnx | nnx | the NNX MNIST tutorial's `CNN` | flax sdist `docs_nnx/mnist_tutorial.md` |
| esm2_equinox | equinox | ESM2 (BERT-style MLM encoder) in Equinox | PyPI `esm2quinox` |
| gpt2_hf | hf | `transformers.FlaxGPT2LMHeadModel` | PyPI `transformers==4.57.*` |

No outside code is copied into this repository: the Flax files are read from the PyPI sdist of the installed Flax
version, fetched by pip on first use and cached (`sources.py`); the others are installed packages. Each module's
docstring records where the model's precision lives as its authors ship it, and what the trial does differently
from the original training script. `measure.matmul_dtypes` counts the float32 vs bf16 matmuls a cast policy leaves.
See LICENSES in this folder.

Usage (params kinds): `TrainState.create(params=t.params, tx=..., policy=..., loss_scale=..., rng=...)`, then
`train_step(state, t.make_batch(key), t.loss_fn)`. NNX: `Optimizer(t.model, tx, policy=..., loss_scale=...)`, then
`jaxamp.nnx.train_step(t.model, opt, t.make_batch(key), t.loss_fn)`. imagenet_resnet returns its new `batch_stats`
in `metrics["aux"]["batch_stats"]`: put them in the next batch (`{**batch, "batch_stats": ...}`).
"""

from __future__ import annotations

from collections.abc import Callable

from .sources import SourceUnavailable
from .trial import Trial


def _lm1b(**options) -> Trial:
    from . import lm1b

    return lm1b.trial(**options)


def _imagenet(**options) -> Trial:
    from . import imagenet

    return imagenet.trial(**options)


def _gemma(**options) -> Trial:
    from . import gemma

    return gemma.trial(**options)


def _mnist(**options) -> Trial:
    from . import mnist_cnn

    return mnist_cnn.trial(**options)


def _esm2(**options) -> Trial:
    from . import esm2

    return esm2.trial(**options)


def _gpt2(**options) -> Trial:
    from . import gpt2

    return gpt2.trial(**options)


TRIALS: dict[str, Callable[..., Trial]] = {
    "lm1b": _lm1b,
    "imagenet_resnet": _imagenet,
    "gemma_nnx": _gemma,
    "mnist_cnn_nnx": _mnist,
    "esm2_equinox": _esm2,
    "gpt2_hf": _gpt2,
}

__all__ = ["TRIALS", "SourceUnavailable", "Trial"]
