"""A train_net.py epoch's logged images/s against a minimal hand-written DDP loop's, from outside.

Alternates (ABBA) two 2-process torchrun jobs of one thread each and prints every round and the
median ratio: ``tools/train_net.py`` for one epoch (resnet18 at 32 px, MODEL.DUMMY_INPUT, batch 64
per process, TRAIN.WORKERS 0, 28 steps; its train record's ``images_per_s`` in metrics.jsonl), and
this script's own loop (``--plain``): the same model, batch, optimizer and step count on
in-memory tensors, timed from its first step to its last, as the trainer times its epoch::

    python docs/scripts/epoch_vs_plain.py [--rounds 5] [--steps 28]

Each job is a fresh pair of processes: both measurements include their first steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BATCH, IM_SIZE, PROCESSES = 64, 32, 2


def plain_loop(steps: int) -> None:
    """One rank of the minimal DDP loop; rank 0 prints its images/s."""
    import torch
    import torch.distributed as dist
    import torchvision
    from torch import nn

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(torchvision.models.resnet18(num_classes=10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-5)
    images = torch.randn(steps, BATCH, 3, IM_SIZE, IM_SIZE)
    targets = torch.randint(0, 10, (steps, BATCH))
    dist.barrier()
    start = time.perf_counter()
    for x, y in zip(images, targets):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    if dist.get_rank() == 0:
        print(json.dumps({"images_per_s": steps * BATCH * dist.get_world_size() / elapsed}))
    dist.destroy_process_group()


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={PROCESSES}", *args]


def run_plain(steps: int) -> float:
    out = subprocess.run(
        torchrun(__file__, "--plain", "--steps", str(steps)), capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["images_per_s"]


def run_train_net(steps: int) -> float:
    with tempfile.TemporaryDirectory(prefix="epoch-vs-plain-") as out:
        opts = [
            "MODEL.ARCH",
            "resnet18",
            "MODEL.DUMMY_INPUT",
            "True",
            "DATA.DUMMY_SIZE",
            str(steps * BATCH * PROCESSES),
        ]
        opts += ["TRAIN.IM_SIZE", str(IM_SIZE), "TEST.IM_SIZE", str(IM_SIZE), "TRAIN.BATCH_SIZE", str(BATCH)]
        opts += ["TRAIN.WORKERS", "0", "OPTIM.MAX_EPOCH", "1", "LOG.PROGRESS", "False", "OUT_DIR", out]
        subprocess.run(torchrun(os.path.join(REPO, "tools", "train_net.py"), *opts), capture_output=True, check=True)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    return next(r["images_per_s"] for r in records if r["split"] == "train")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--plain", action="store_true", help="be one rank of the plain loop (under torchrun)")
    args = parser.parse_args()
    if args.plain:
        plain_loop(args.steps)
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    ratios = []
    for i in range(args.rounds):
        order = (run_train_net, run_plain) if i % 2 == 0 else (run_plain, run_train_net)
        result = {fn.__name__: fn(args.steps) for fn in order}
        ratios.append(result["run_train_net"] / result["run_plain"])
        print(
            f"round {i + 1}: train_net.py {result['run_train_net']:.1f} img/s, plain {result['run_plain']:.1f} img/s, "
            f"ratio {ratios[-1]:.3f}",
            flush=True,
        )
    print(f"median ratio {statistics.median(ratios):.3f} over {args.rounds} alternated rounds")


if __name__ == "__main__":
    main()
