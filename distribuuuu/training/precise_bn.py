"""Precise BatchNorm (pycls's precise BN): running statistics recomputed over a fixed set of images.

The running statistics a training run leaves are an exponential average over the last few
hundred batches, of weights that kept changing. Before an evaluation they are replaced by the
statistics of the current weights over N training images, summed exactly across ranks.

Each BatchNorm layer normalises with its batch's statistics (train mode, as during training and
as pycls does); every other module is in eval mode, so dropout and drop-path draw nothing and the
result is a function of the weights and the images alone. The images are cut into fixed batches
whatever the world size (data/loader.py: batch k on rank k mod world size), so each batch's
statistics are the same on any number of ranks, and only the float64 sums meet in another order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from distribuuuu.runtime.process_group import all_reduce_sum


def bn_layers(model: nn.Module) -> list[_BatchNorm]:
    """The model's BatchNorm layers that keep running statistics, in module order."""
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


@torch.no_grad()
def bn_moment_sums(
    model: nn.Module, batches: Iterable[torch.Tensor], forward_context: Callable = contextlib.nullcontext
) -> torch.Tensor:
    """This rank's sums over ``batches``, per BatchNorm layer: [n, sum n*mean (C), sum n*(var + mean^2) (C)].

    ``n`` is a batch's values per channel (images x positions) and mean/var its per-channel mean
    and biased variance, so the sums are the layer input's sum and sum of squares, in float64 on
    the model's device. One flat tensor: one all-reduce sums every layer. Each forward runs under
    ``forward_context()`` (autocast); the moments are taken in float32, summed in float64.
    """
    layers = bn_layers(model)
    device = next(model.parameters()).device
    sums = [torch.zeros(1 + 2 * m.num_features, dtype=torch.float64, device=device) for m in layers]

    def hook(index: int) -> Callable:
        def add(module: nn.Module, inputs: tuple) -> None:
            x = inputs[0]
            if x.numel() == 0:
                return
            dims = [d for d in range(x.dim()) if d != 1]
            var, mean = torch.var_mean(x.float(), dim=dims, correction=0)
            n = x.numel() // x.shape[1]
            mean = mean.double()
            sums[index][0] += n
            sums[index][1 : 1 + module.num_features] += n * mean
            sums[index][1 + module.num_features :] += n * (var.double() + mean * mean)

        return add

    modes = {m: m.training for m in model.modules()}
    tracked = [m.num_batches_tracked.clone() for m in layers]
    handles = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(layers)]
    try:
        model.eval()
        for m in layers:
            m.train()  # batch statistics, as in training; their running update is overwritten after
        for images in batches:
            with forward_context():
                model(images)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.train(training)
        for m, count in zip(layers, tracked):
            m.num_batches_tracked.copy_(count)  # the training's count: precise BN is no training step
    return torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64, device=device)


@torch.no_grad()
def set_bn_stats(model: nn.Module, totals: torch.Tensor) -> int:
    """Set every BatchNorm layer's running mean and running variance from the summed moments; return
    the values per channel they cover.

    running_var is the unbiased variance over all M values of a channel (M / (M - 1) times the
    biased one), as BatchNorm's own running_var is unbiased.
    """
    offset, count = 0, 0
    for m in bn_layers(model):
        c = m.num_features
        n, s1, s2 = totals[offset], totals[offset + 1 : offset + 1 + c], totals[offset + 1 + c : offset + 1 + 2 * c]
        offset += 1 + 2 * c
        count = int(n.item())
        if count < 2:
            raise ValueError(f"precise BN saw {count} value(s) per channel: too few for a variance")
        mean = s1 / n
        var = (s2 / n - mean * mean).clamp(min=0) * (n / (n - 1))
        m.running_mean.copy_(mean.to(m.running_mean.dtype))
        m.running_var.copy_(var.to(m.running_var.dtype))
    return count


def recompute_bn_stats(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    reduce: Callable[[torch.Tensor], torch.Tensor] = all_reduce_sum,
    forward_context: Callable = contextlib.nullcontext,
) -> int:
    """Recompute ``model``'s BatchNorm running statistics over this rank's ``batches`` and every other
    rank's (``reduce``: one all-reduce); return the images seen by all ranks (0: no BatchNorm layer).

    Every rank calls it (a collective), with its disjoint part of the images; every rank then holds
    the same statistics.
    """
    if not bn_layers(model):
        return 0
    images = 0

    def counted(batches: Iterable[torch.Tensor]):
        nonlocal images
        for x in batches:
            images += x.shape[0]
            yield x

    sums = bn_moment_sums(model, counted(batches), forward_context)
    head = torch.tensor([float(images)], dtype=torch.float64, device=sums.device)
    totals = reduce(torch.cat([head, sums]))
    set_bn_stats(model, totals[1:])
    return int(totals[0].item())
