"""A precise-BN job: each rank recomputes the tiny CNN's BatchNorm statistics over its fixed batches
of BN.PRECISE_IMAGES digits images, one all-reduce sums them, and rank 0 saves the result.

    torchrun --nproc_per_node=3 tests/scripts/precise_bn_job.py OUT_FILE

Runs as a plain ``python`` process too (world size 1). ``cfg`` and ``tiny_model`` are the test's.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from distribuuuu import utils  # noqa: E402
from distribuuuu.config import get_cfg_defaults, validate_cfg  # noqa: E402
from distribuuuu.data import build_precise_bn_split  # noqa: E402
from distribuuuu.training.evaluation import precise_bn  # noqa: E402
from distribuuuu.training.precise_bn import bn_layers  # noqa: E402

DIGITS = str(Path(__file__).resolve().parents[2] / "data" / "digits")


def tiny_model() -> nn.Module:
    """The tiny CNN (two conv-BN blocks) with non-trivial BN affine weights, so the second BN's
    input depends on the first's normalisation."""
    from scripts.fault_train import TinyNet

    torch.manual_seed(0)
    model = TinyNet(10)
    for m in bn_layers(model):
        nn.init.uniform_(m.weight, 0.5, 2.0)
        nn.init.uniform_(m.bias, -1.0, 1.0)
    return model


def cfg(images: int, transform: str = "train"):
    """Digits at 16 px, batches of 4, ``images`` precise-BN images read with ``transform``."""
    c = get_cfg_defaults()
    c.merge_from_list(["MODEL.ARCH", "fault_tiny", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16"])
    c.merge_from_list(["TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS, "TRAIN.BATCH_SIZE", "4", "TRAIN.WORKERS", "0"])
    c.merge_from_list(["BN.PRECISE_IMAGES", str(images), "BN.PRECISE_TRANSFORM", transform])
    validate_cfg(c)
    return c


def main(out_file: str) -> None:
    env = utils.setup_distributed()
    model, config = tiny_model(), cfg(22)
    precise_bn({"model": model}, build_precise_bn_split(config, env), config, env)
    if env.rank == 0:
        torch.save([(m.running_mean, m.running_var) for m in bn_layers(model)], out_file)
    utils.cleanup_distributed()
    sys.stdout.write(f"OK rank={env.rank} world={env.world_size}\n")


if __name__ == "__main__":
    main(sys.argv[1])
