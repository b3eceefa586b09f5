"""A 2-process evaluation job: each rank counts its ExactEvalSampler shard into a ConfusionMatrix.

    torchrun --nproc_per_node=2 tests/scripts/confusion_job.py OUT_DIR

The data is one seeded set of logits and targets that every rank builds alike; rank 0 writes the
reduced matrix with save_evaluation. Runs as a plain ``python`` process too (world size 1).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from distribuuuu import utils  # noqa: E402
from distribuuuu.data.samplers import ExactEvalSampler  # noqa: E402
from distribuuuu.records.eval_outputs import ConfusionMatrix, save_evaluation  # noqa: E402

NUM_SAMPLES, NUM_CLASSES = 53, 4


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and targets of the whole evaluation set, the same on every rank and in the test."""
    g = torch.Generator().manual_seed(11)
    return torch.randn(NUM_SAMPLES, NUM_CLASSES, generator=g), torch.randint(
        0, NUM_CLASSES, (NUM_SAMPLES,), generator=g
    )


def main(out_dir: str) -> None:
    env = utils.setup_distributed()
    rank, world = utils.get_rank(), utils.get_world_size()
    logits, targets = dataset()
    shard = torch.tensor(list(ExactEvalSampler(NUM_SAMPLES, world, rank)))
    matrix = ConfusionMatrix(NUM_CLASSES, env.device)
    for batch in shard.split(5):  # batches of 5, the last one shorter
        matrix.update(logits[batch].to(env.device), targets[batch].to(env.device))
    reduced = matrix.reduce()
    names = [f"class_{c}" for c in range(NUM_CLASSES)]
    written = save_evaluation(out_dir, "val", reduced, names)
    assert (written != []) == (rank == 0), written  # only the main process writes
    utils.cleanup_distributed()  # no barrier: no collective follows, and the test reads after exit
    # One write per line (print writes text and newline apart, and the ranks share a pipe).
    sys.stdout.write(f"OK rank={rank} world={world} local={int(matrix.counts.sum())}\n")


if __name__ == "__main__":
    main(sys.argv[1])
