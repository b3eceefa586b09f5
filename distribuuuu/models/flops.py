"""A model's FLOPs per image, counted once by torch's own ``FlopCounterMode`` on one image."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

# Training FLOPs of a model per forward FLOP: the backward pass computes the gradients of the inputs
# and of the weights, each about a forward's worth (Kaplan et al. 2020's 6N per token = 3 x 2N;
# torchtitan and PaLM's MFU count the same). Recomputation by activation checkpointing is not model
# FLOPs: MFU counts the work the model needs, not the work the hardware did.
TRAINING_FLOPS_PER_FORWARD = 3


@torch.no_grad()
def forward_flops(model: nn.Module, image_size: int, device: torch.device, channels_last: bool = False) -> int:
    """FLOPs of one forward pass of one ``image_size`` image (a multiply-add counts 2), in eval mode: no
    BatchNorm statistics move, no dropout is drawn; the model's mode is put back."""
    was_training = model.training
    image = torch.zeros(1, 3, image_size, image_size, device=device)
    if channels_last:
        image = image.contiguous(memory_format=torch.channels_last)
    counter = FlopCounterMode(display=False)
    try:
        model.eval()
        with counter:
            model(image)
    finally:
        model.train(was_training)
    return counter.get_total_flops()
