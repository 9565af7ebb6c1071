"""Shadow verifiers (``rewards.shadow``): a second reward run beside the training reward on a share of the
groups, never used for learning, whose verdicts are compared with the training reward's.

A sample *passes* a reward when its verdict component exceeds that reward's threshold. Over the samples both
scored:

    disagreement   = #(train passes != shadow passes) / n
    false_positive = #(train passes and shadow fails) / n     (the training reward accepts what the shadow rejects:
                                                               the policy may be gaming it)
    false_negative = #(train fails and shadow passes) / n

so a run that starts to game its reward shows false positives rising while its training reward climbs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

import numpy as np

SHADOW_COUNTS = ("shadow_samples", "shadow_disagree", "shadow_false_positive", "shadow_false_negative")


def verdict_counts(train_pass: np.ndarray, shadow_pass: np.ndarray) -> dict[str, int]:
    """The counts behind the rates (``SHADOW_COUNTS``) of two [n] bool verdict arrays."""
    train, shadow = np.asarray(train_pass, bool), np.asarray(shadow_pass, bool)
    return {
        "shadow_samples": int(train.size),
        "shadow_disagree": int((train != shadow).sum()),
        "shadow_false_positive": int((train & ~shadow).sum()),
        "shadow_false_negative": int((~train & shadow).sum()),
    }


def shadow_rates(counts: Mapping[str, float]) -> dict[str, float]:
    """Rates over the checked samples (see the module docstring); nothing when no sample was checked."""
    n = counts.get("shadow_samples", 0)
    if not n:
        return {}
    return {
        "shadow_samples": float(n),
        "shadow_disagreement": counts["shadow_disagree"] / n,
        "shadow_false_positive": counts["shadow_false_positive"] / n,
        "shadow_false_negative": counts["shadow_false_negative"] / n,
    }


def sampled_groups(num_groups: int, share: float, seed: int) -> list[int]:
    """ceil(share * num_groups) of the group indices 0..num_groups-1, drawn by ``random.Random(seed)``, sorted."""
    count = min(num_groups, math.ceil(share * num_groups))
    return sorted(random.Random(seed).sample(range(num_groups), count))
