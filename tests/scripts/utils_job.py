"""A 2-process DDP job built on ``distribuuuu.utils`` alone.

    torchrun --nproc_per_node=2 tests/scripts/utils_job.py /tmp/utils_job

Runs unchanged under srun, mpirun or a plain ``python`` (one process, no process group).
"""

import os
import sys

import torch
from torch import nn

from distribuuuu import utils


def main(out_dir: str) -> None:
    env = utils.setup_distributed()  # reads torchrun/Slurm/MPI variables; gloo on CPU, nccl on GPU
    train_and_save(env, out_dir)  # returns with its DDP model gone: nothing holds the process group any more
    utils.cleanup_distributed()


def train_and_save(env: utils.DistEnv, out_dir: str) -> None:
    """Train a DDP model on each rank's own data, check the replicas and the reductions, save it on rank 0."""
    rank, world = utils.get_rank(), utils.get_world_size()

    # A tiny classifier, wrapped in DDP: it copies rank 0's initial weights to every rank and
    # averages gradients over ranks in backward().
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(env.device)
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loss_meter = utils.AverageMeter("loss", ":.4f")
    torch.manual_seed(100 + rank)  # each rank draws its own data
    for _ in range(5):
        images, targets = torch.randn(8, 16, device=env.device), torch.randint(0, 4, (8,), device=env.device)
        loss = nn.functional.cross_entropy(ddp(images), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_meter.update(loss.item(), n=images.size(0))
    assert loss_meter.count == 5 * 8

    # DDP kept the replicas identical although each rank saw other data.
    weights = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    assert all(torch.equal(weights, w) for w in utils.all_gather_object(weights))

    # Reductions: a sum, a mean (Distribuuuu's scaled_all_reduce) and a gather of Python objects.
    assert utils.all_reduce_sum(torch.tensor([rank + 1.0])).item() == world * (world + 1) / 2
    [mean] = utils.scaled_all_reduce([torch.tensor([float(rank)])])
    assert mean.item() == (world - 1) / 2
    assert utils.all_gather_object(rank) == list(range(world))

    # Top-k accuracy in percent: the right class is first in 2 of 4 rows, second in the other 2.
    logits = torch.tensor([[3.0, 2, 1, 0], [2, 3, 1, 0], [2, 3, 1, 0], [3, 2, 1, 0]])
    top1, top2 = utils.accuracy(logits, torch.tensor([0, 1, 0, 1]), topk=(1, 2))
    assert (top1.item(), top2.item()) == (50.0, 100.0)

    assert utils.unwrap_model(ddp) is model
    assert utils.count_parameters(ddp) == 16 * 32 + 32 + 32 * 4 + 4

    # Rank 0 writes the checkpoint (atomically); every rank reads it back after the barrier.
    path = os.path.join(out_dir, "model.pth.tar")
    utils.save_checkpoint({"model": utils.unwrap_model(ddp).state_dict(), "saved_by": rank}, path)
    utils.barrier()
    state = utils.load_checkpoint(path)
    assert state["saved_by"] == 0
    assert all(torch.equal(v, model.state_dict()[k].cpu()) for k, v in state["model"].items())

    utils.barrier()
    # One write per line: print() writes text and newline separately, and the ranks share a pipe.
    sys.stdout.write(f"OK rank={rank} world={world} loss={loss_meter.avg:.4f}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
