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

import importlib
import inspect
from collections.abc import Callable

from .sources import SourceUnavailable
from .trial import Trial


def _factory(module: str) -> Callable[..., Trial]:
    """`module`'s `trial(**options)`, its module imported on first use (a trial's imports are heavy)."""
    def build(**options) -> Trial:
        return importlib.import_module(f"{__name__}.{module}").trial(**options)

    return build


_MODULES = {"lm1b": "lm1b", "imagenet_resnet": "imagenet", "gemma_nnx": "gemma", "mnist_cnn_nnx": "mnist_cnn",
            "esm2_equinox": "esm2", "gpt2_hf": "gpt2"}
TRIALS: dict[str, Callable[..., Trial]] = {name: _factory(module) for name, module in _MODULES.items()}


def trial_options(name: str) -> tuple[str, ...]:
    """The keyword options `TRIALS[name]` takes: `batch` for every trial, `dropout` for GPT-2 (imports the trial's
    module, not its model code)."""
    return tuple(inspect.signature(importlib.import_module(f"{__name__}.{_MODULES[name]}").trial).parameters)


__all__ = ["TRIALS", "SourceUnavailable", "Trial", "trial_options"]
