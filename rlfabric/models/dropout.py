"""Dropout off for policy-gradient training.

The generators sample with dropout off (an inference forward), so a learner that trained with it on would score
every token under a randomly thinned network: its logprobs would differ from the behaviour logprobs by noise (a
GPT-2 model at the default 0.1 showed a logprob gap of 0.04-0.05 in float32), the ratio would wander off 1 and
rows would be dropped as drifted. TRL's GRPOTrainer turns dropout off for the same reason.
"""

from __future__ import annotations

import torch


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every ``nn.Dropout``'s ``p`` and every float attribute named ``*dropout*`` on a module (attention
    implementations keep their rate as a float: ``attention_dropout``) to 0, leaving the model's config (what is
    saved) as it was. Returns how many were changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p != 0:
            module.p = 0.0
            changed += 1
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float) and value != 0:
                setattr(module, name, 0.0)
                changed += 1
    return changed
