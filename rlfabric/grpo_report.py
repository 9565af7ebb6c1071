"""What a GRPO run reports, as pure functions of what the driver collected: one step's metrics row, one held-out
evaluation's row, and the run's summary. The driver (``rlfabric.llm_driver``) logs them; nothing here talks to
an actor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlfabric.llm_run_state import Counters
from rlfabric.llm_text_env import episode_totals
from rlfabric.rewards.shadow import SHADOW_COUNTS, shadow_rates

# The counters a summary reports as they stand at the end of the run.
SUMMARY_COUNTERS = (
    "failed_samples",
    "stale_samples",
    "filtered_groups",
    "generator_restarts",
    "rollout_worker_restarts",
    "resampled_samples",
    "reward_worker_restarts",
)


def step_row(
    scored: Sequence[Mapping[str, Any]],
    groups: Sequence[tuple[Any, int, int]],
    counters: Counters,
    version: int,
    elapsed_s: float,
) -> dict[str, Any]:
    """The metrics of one GRPO step from its rollouts' metadata (``scored``: one dict per rollout, with ``rows``,
    ``samples``, ``component_means``, ``group_stats`` [G, 4] of (count, mean, std, rows), ``response_length_mean``,
    and ``shadow`` counts) and the groups it trained (``groups``: (group, samples trained, policy version)).

    reward_mean = sum_g mean_g * rows_g / sum_g rows_g; each component's mean is weighted by its rollout's rows;
    policy_lag = (version - 1) - the version that sampled a group, averaged over trained samples.
    """
    rows = sum(m["rows"] for m in scored)
    samples = sum(m["samples"] for m in scored)
    components: dict[str, float] = {}
    for m in scored:
        for name, value in m["component_means"].items():
            components[name] = components.get(name, 0.0) + value * m["rows"] / max(rows, 1)
    reward_sum = sum(float(np.nansum(m["group_stats"][:, 1] * m["group_stats"][:, 3])) for m in scored)
    shadow = {k: sum(m.get("shadow", {}).get(k, 0) for m in scored) for k in SHADOW_COUNTS}
    elapsed_s = max(elapsed_s, 1e-9)
    trained = sum(n for _, n, _ in groups)
    c = counters
    return {
        "phase": "grpo",
        "reward_mean": reward_sum / rows if rows else float("nan"),
        **{f"reward_{name}": value for name, value in components.items()},
        "accuracy": components.get("correct"),
        **shadow_rates(shadow),
        "trained_samples": trained,
        "response_length_mean": sum(m["response_length_mean"] * m["samples"] for m in scored) / max(samples, 1),
        "samples_per_s": rows / elapsed_s,
        "tokens_generated": c.tokens_generated,
        "policy_lag_mean": sum(n * (version - 1 - v) for _, n, v in groups) / trained if trained else 0.0,
        "policy_lag_max": max((version - 1 - v for _, n, v in groups if n), default=0),
        **{key: getattr(c, key) for key in SUMMARY_COUNTERS},
        **episode_totals(list(scored), samples),
        "step_time_s": elapsed_s,
    }


# Said once by a run whose rewards give no ``correct`` component: its held-out accuracy is n/a, not 0%.
NO_ACCURACY_NOTE = (
    "held-out accuracy is n/a: it is the mean of a 'correct' component, and none of the rewards gives one "
    "(the evaluation's mean reward is logged as eval_reward_mean)"
)


def gives_accuracy(meta: Mapping[str, Any]) -> bool:
    """Whether an evaluation's rewards (or its env) gave a ``correct`` component, the one accuracy is the mean of:
    the rollout reports ``correct_sum`` only then."""
    return "correct_sum" in meta


def eval_row(meta: Mapping[str, Any], label: str) -> dict[str, Any]:
    """An evaluation's row from its rollout's metadata: accuracy = correct / scored (None without a ``correct``
    component: n/a, not 0) and the mean reward = reward /
    scored, over the samples the rewards scored (scored = samples - failed; both None when none was). A sample some
    reward failed is not a wrong answer: it is counted apart, as ``eval_failed`` of ``eval_samples``. With
    ``meta["by_source"]`` (``sums_by_source``: held-out rows of several data sources) both again per source."""
    n, failed = meta["samples"], meta.get("failed", meta["samples"])
    scored = n - failed
    row = {
        "phase": "eval",
        "label": label,
        "eval_accuracy": meta["correct_sum"] / scored if scored > 0 and gives_accuracy(meta) else None,
        "eval_reward_mean": meta["reward_sum"] / scored if scored > 0 else None,
        "eval_failed": failed,
        "eval_samples": n,
    }
    # held-out rows from several data sources: the same two figures per source (``eval_accuracy/<source>``)
    for source, sums in sorted(meta.get("by_source", {}).items()):
        scored = sums["scored"]
        # a source none of whose samples got 'correct' is 0, as in the totals, where the evaluation gives accuracy
        row[f"eval_accuracy/{source}"] = (
            sums.get("correct_sum", 0.0) / scored if scored and gives_accuracy(meta) else None
        )
        row[f"eval_reward_mean/{source}"] = sums["reward_sum"] / scored if scored else None
    return row


def run_summary(
    task: str,
    counters: Counters,
    version: int,
    evals: Mapping[str, float | None],
    elapsed_s: float,
    extra: Mapping[str, Any],
    eval_failed: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The run's summary (summary.json and the printed table): its counters, the held-out accuracy ``evals``
    (initial, after_sft, final) with ``eval_failed`` (by label: the samples the rewards failed, where any did)
    and rate = samples / elapsed seconds, then ``extra`` (paths, transports)."""
    c = counters
    return {
        "algo": "grpo",
        "task": task,
        "steps": c.step,
        "policy_version": version,
        "samples": c.samples,
        **{f"eval_accuracy_{label}": value for label, value in evals.items()},
        **{f"eval_failed_{label}": count for label, count in (eval_failed or {}).items() if count},
        "time_total_s": elapsed_s,
        "samples_per_s": c.samples / max(elapsed_s, 1e-9),
        **{key: getattr(c, key) for key in SUMMARY_COUNTERS},
        "trained_samples": c.trained_samples,
        **extra,
    }
