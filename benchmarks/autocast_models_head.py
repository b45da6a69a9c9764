"""`autocast_models.py` on the two outside trials whose output head no default `float32_results` pattern names
(Flax's ImageNet ResNet `Dense_0`, the NNX MNIST tutorial's `linear2`), with the policy the precision audit suggests
for them beside plain `bf16;autocast`: does float32 logits move their 40-step figures?

    python benchmarks/autocast_models_head.py imagenet_resnet     # ~20 min on 2 cores
    python benchmarks/autocast_models_head.py mnist_cnn_nnx

Each writes `benchmarks/results/autocast_models_head_<trial>.md` (autocast_models.py's report; its command line
names autocast_models.py, whose policies this script replaces in-process).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the trials (tests/outside_models)

import jaxamp  # noqa: E402
from benchmarks import autocast_models, harness  # noqa: E402

HEADS = {"imagenet_resnet": "Dense_0", "mnist_cnn_nnx": "linear2"}  # what the audit's head note names


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in HEADS:
        print(f"usage: python benchmarks/autocast_models_head.py {{{','.join(HEADS)}}}", file=sys.stderr)
        return 2
    trial = argv[0]
    autocast_models.POLICIES = {f"bf16;autocast;float32_results+=^{HEADS[trial]}$": jaxamp.NoOpLossScale,
                                "bf16;autocast": jaxamp.NoOpLossScale}
    return autocast_models.main(["--trials", trial, "--out",
                                 str(harness.RESULTS / f"autocast_models_head_{trial}.md")])


if __name__ == "__main__":
    sys.exit(main())
