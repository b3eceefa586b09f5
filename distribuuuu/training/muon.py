"""OPTIM.OPTIMIZER muon: ``torch.optim.Muon`` on the hidden layers' 2-D weight matrices and
``torch.optim.AdamW`` on every other parameter, stepped as one optimizer.

The routing (Keller Jordan's Muon; Moonshot's "Muon is Scalable"; what torch's own docstring asks):
2-D weights of hidden layers go to Muon; biases and norms (1-D), embeddings (``nn.Embedding``, and
the names a timm model's ``no_weight_decay()`` lists: position embeddings, class tokens), the
classifier head and convolution kernels go to AdamW. Kernels because ``torch.optim.Muon`` takes 2-D
parameters only (timm's Muon flattens them; torch's refuses them), so a CNN's Muon touches only its
2-D hidden Linear weights (ConvNeXt's MLPs), a ViT's every attention and MLP matrix.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn


def muon_parameter_names(model: nn.Module, head: set[str]) -> list[str]:
    """Names of the parameters Muon steps: trainable 2-D weights that are neither ``head``'s nor an embedding's."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    no_decay = tuple(getattr(model, "no_weight_decay", lambda: ())())  # timm: pos_embed, cls_token, ...
    return [
        name
        for name, p in model.named_parameters()
        if p.requires_grad
        and p.ndim == 2
        and name not in head
        and id(p) not in embeddings
        and not any(fnmatch.fnmatchcase(name, pattern) for pattern in no_decay)
    ]


def split_for_muon(groups: list[dict], muon_ids: set[int]) -> list[dict]:
    """Each parameter group in two, its Muon parameters (``muon`` True) and the rest, with the same
    decay and LR scale; empty halves dropped."""
    split = []
    for group in groups:
        for use_muon in (True, False):
            params = [p for p in group["params"] if (id(p) in muon_ids) == use_muon]
            if params:
                name = group["name"] + ("_muon" if use_muon else "")
                split.append(dict(group, params=params, muon=use_muon, name=name))
    return split


class MuonWithAdamW(torch.optim.Optimizer):
    """torch's Muon on the groups marked ``muon``, torch's AdamW on the others, as one optimizer.

    The two are torch's own optimizers over the same group dicts and one state dict, so
    ``param_groups`` (the LR schedule writes each group's ``lr``), ``state_dict`` and DCP's
    ``get_optimizer_state_dict`` see one optimizer and one set of parameters, as every other
    OPTIM.OPTIMIZER. Written here because torch has no such pair; torchtitan's OptimizersContainer
    holds several optimizers the same way. With ``adjust_lr_fn`` match_rms_adamw (Moonshot's) Muon's
    update has AdamW's RMS, so one LR and one weight decay serve both.
    """

    def __init__(
        self,
        groups: list[dict],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        momentum: float = 0.95,
        nesterov: bool = True,
        adjust_lr_fn: str = "match_rms_adamw",
        fused: bool = False,
    ):
        defaults = dict(lr=lr, weight_decay=0.0, muon=False)
        self.settings = dict(betas=tuple(betas), momentum=momentum, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
        self.fused = fused
        super().__init__(groups, defaults)
        self._link()

    def _link(self) -> None:
        """Build torch's Muon and AdamW over this optimizer's group dicts, sharing its state."""
        s, self.optimizers = self.settings, []
        muon = [g for g in self.param_groups if g["muon"]]
        adamw = [g for g in self.param_groups if not g["muon"]]
        if muon:
            self.optimizers.append(
                torch.optim.Muon(
                    muon, lr=self.defaults["lr"], momentum=s["momentum"], nesterov=s["nesterov"],
                    adjust_lr_fn=s["adjust_lr_fn"],
                )
            )  # fmt: skip
        if adamw:
            self.optimizers.append(
                torch.optim.AdamW(adamw, lr=self.defaults["lr"], betas=s["betas"], fused=self.fused or None)
            )
        for optimizer in self.optimizers:
            optimizer.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        """One step of each: Muon's and AdamW's."""
        loss = torch.enable_grad()(closure)() if closure is not None else None
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """Load as any optimizer (new group dicts and state), then point Muon and AdamW at them."""
        super().load_state_dict(state_dict)
        self._link()
