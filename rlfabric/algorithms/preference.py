"""Preference learning for reward models: the Bradley-Terry loss and pair accuracy.

Pure functions over tensors. A pair is a prompt with a chosen and a rejected completion; the reward model scores
both, r_c and r_r. Bradley-Terry (Bradley & Terry 1952; Ouyang et al. 2022) models P(chosen > rejected) as
sigma(r_c - r_r), so maximum likelihood minimises -log sigma(r_c - r_r); a margin m (Llama 2) asks for a gap of at
least m before the loss fades.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, margin: float = 0.0) -> Tensor:
    """L = mean_i -log sigma(r_c,i - r_r,i - m), computed as softplus(-(r_c - r_r - m)) (stable for large gaps)."""
    return F.softplus(-(chosen - rejected - margin)).mean()


def pair_accuracy(chosen: Tensor, rejected: Tensor) -> float:
    """The share of pairs the model ranks right: mean_i [r_c,i > r_r,i] (a tie counts as wrong)."""
    if chosen.numel() == 0:
        return float("nan")
    return float((chosen > rejected).float().mean())


def pick_heads(logits: Tensor, head_index: Tensor) -> Tensor:
    """[B] each row's score on its own head: logits[i, head_index[i]] (pairs of one batch may train different
    heads)."""
    return torch.gather(logits, 1, head_index.view(-1, 1)).squeeze(1)
