"""What the LLM learner reports for each update (``LLMLearnerCore.train_on``), and how the driver combines the
reports of data-parallel learners: the learners' side of the contract and the driver's, in one place.
"""

from __future__ import annotations

from rlfabric.compact import FloatFields

# What the batch's builder measured (each present when its setting is on): reported as they are.
BATCH_STATISTICS = ("efficiency_penalty", "step_group_share", "overlong_filtered")
# Reported from an update's last pass over its batch: the first pass's ratio is 1 by construction.
MOVED_BY_THE_UPDATE = ("clip_fraction", "ratio_mean", "approx_kl")
# What ``train_on`` reports, in the order the driver unpacks it (absent ones, e.g. kl without a reference, NaN).
LEARNER_METRICS = FloatFields(
    "pg_loss",
    "clip_fraction",
    "ratio_mean",
    "approx_kl",
    "entropy",
    "kl",
    "grad_norm",
    "logprob_gap",
    "trained_rows",
    "skipped_rows",
    "trained_tokens",
    "trained_sequences",
    "trained_positions",
    "trained_head_positions",
    "drifted_trajectories",  # rows whose tokens (or logprobs) were not what the generator sampled: never trained
    "efficiency_penalty",  # the batch rows' mean efficiency penalty (rewards.efficiency.weight > 0)
    "step_group_share",  # grpo.step_credit gigpo: the share of steps in a step group of more than one
    "overlong_filtered",  # grpo.overlong_filter: the batch's rows cut at the length limit, given no loss
    "batch_time_s",  # inside the learner: the records read and turned into the batch
    "compute_time_s",  # inside the learner: forward, backward and optimizer step
)
# The metrics that are each rank's share of the whole batch's value (one shared denominator, or counts): summed
# over data-parallel learners; the others are averaged.
ADDITIVE_LEARNER_METRICS = frozenset(
    {
        "pg_loss",
        "kl",
        "entropy",
        "trained_rows",
        "skipped_rows",
        "trained_tokens",
        "trained_sequences",
        "trained_positions",
        "trained_head_positions",
    }
)
