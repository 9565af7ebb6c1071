"""Combining named reward components into the scalar reward that advantages use (``rewards.combine``).

Pure functions over numpy arrays: ``components`` maps a component's name to its [N] values (one per row),
``group_ids`` [N] says which rows were sampled from one prompt. ``combine_rewards`` applies, in this order,

1. clipping:      x_c <- min(max(x_c, low_c), high_c)                for each clipped component c;
2. gating:        x_c <- x_c * [x_gate(c) > 0]                        a gated component counts only where its gate
                                                                      component passes (efficiency only on success);
3. normalization: x_c <- (x_c - mean_g x_c) / (std_g x_c + eps)       each component within each group (MO-GRPO,
                                                                      Ichihara et al. 2025), when asked;
4. the weighted sum: r = sum_c w_c * x_c                              (weight 1 for components not named).

Why normalize: in a plain weighted sum the component with the widest spread inside a group decides the group's
ranking, so the policy optimises it and ignores the rest (MO-GRPO's reward-hacking case); normalizing each one
first gives every component the same say, scaled only by its weight. A component that is constant in a group
carries no preference there and contributes 0. std_g is the unbiased group std, as in GRPO's advantages
(``rlfabric.algorithms.grpo``); a group of one row has std 0.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

EPS = 1e-6


def clip_components(
    components: Mapping[str, np.ndarray], bounds: Mapping[str, tuple[float, float]]
) -> dict[str, np.ndarray]:
    """Each component named in ``bounds`` clipped to [low, high]: x <- min(max(x, low), high); others as given."""
    out = dict(components)
    for name, (low, high) in bounds.items():
        if name in out:
            out[name] = np.clip(np.asarray(out[name], np.float64), low, high)
    return out


def gate_components(components: Mapping[str, np.ndarray], gates: Mapping[str, str]) -> dict[str, np.ndarray]:
    """Each gated component zeroed on the rows where its gate fails: x_c <- x_c * [x_gate > 0]. A gate component
    the record lacks is 0 on every row (nothing passed it), so its gated component counts nowhere."""
    out = dict(components)
    for name, gate in gates.items():
        if name in out:
            passed = np.asarray(components.get(gate, np.zeros_like(out[name])), np.float64) > 0
            out[name] = np.where(passed, np.asarray(out[name], np.float64), 0.0)
    return out


def group_normalize(values: np.ndarray, group_ids: np.ndarray, eps: float = EPS) -> np.ndarray:
    """(x_i - mean_g) / (std_g + eps) over the rows of each group g, std_g unbiased (0 for a group of one row)."""
    x = np.asarray(values, np.float64)
    groups = np.asarray(group_ids)
    out = np.zeros_like(x)
    for g in np.unique(groups):
        rows = groups == g
        shifted = x[rows] - x[rows].max()  # equal values centre to exactly 0 (as grpo_advantages)
        centered = shifted - shifted.mean()
        std = x[rows].std(ddof=1) if rows.sum() > 1 else 0.0
        out[rows] = centered / (std + eps)
    return out


def combine_rewards(
    components: Mapping[str, np.ndarray],
    group_ids: np.ndarray,
    weights: Mapping[str, float],
    *,
    clip: Mapping[str, tuple[float, float]] | None = None,
    gates: Mapping[str, str] | None = None,
    normalize: bool = False,
) -> np.ndarray:
    """[N] float32 scalar reward: clip, gate, (normalize per group), then sum_c w_c * x_c (see the module
    docstring). Gates read the clipped components; a component with weight 0 is still a valid gate."""
    n = len(group_ids)
    x = gate_components(clip_components(components, clip or {}), gates or {})
    total = np.zeros(n, np.float64)
    for name, values in x.items():
        weight = float(weights.get(name, 1.0))
        if weight == 0.0:
            continue
        values = group_normalize(values, group_ids) if normalize else np.asarray(values, np.float64)
        total += weight * values
    return total.astype(np.float32)
