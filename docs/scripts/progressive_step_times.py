"""Median training-step time (forward, backward, SGD step) of shufflenet_v2_x0_5 at each size of
docs/recipe.md's progressive-resizing ramp, batch 32 of random inputs, one process; the rounds
alternate over the sizes so that a change of load hits every size alike."""

import statistics
import time

import torch
import torchvision

SIZES = [32, 40, 48, 56, 64]


def main() -> None:
    torch.manual_seed(0)
    model = torchvision.models.get_model("shufflenet_v2_x0_5", num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    times: dict[int, list[float]] = {s: [] for s in SIZES}
    for s in SIZES:  # warm-up
        step(torch.randn(32, 3, s, s), torch.randint(0, 10, (32,)))
    for _ in range(4):
        for s in SIZES:
            x, y = torch.randn(32, 3, s, s), torch.randint(0, 10, (32,))
            for _ in range(3):
                start = time.perf_counter()
                step(x, y)
                times[s].append(time.perf_counter() - start)
    largest = statistics.median(times[SIZES[-1]])
    for s in SIZES:
        median = statistics.median(times[s])
        print(f"{s} px: {median * 1000:.0f} ms, x{median / largest:.2f} of {SIZES[-1]} px")


if __name__ == "__main__":
    main()
