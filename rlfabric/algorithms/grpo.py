"""The GRPO family's math, top to bottom: group advantages, ratios, clipped loss, aggregation, penalties, filters.

Shapes: N sequences of T response tokens, right-padded. ``mask`` is a bool or float ``[N, T]`` loss mask (1 = a
model token that is trained on; float weights are allowed). Values at masked positions may be garbage (NaN, inf):
every function here selects them away with ``torch.where`` before any arithmetic that could turn them into NaN
values or NaN gradients.

Micro-batching: an aggregated loss is numerator / denominator. Both are sums over sequences, so to get the
full-batch loss from micro-batches, compute ``D = sum(aggregate_denominator(mb.mask, mode, norm_length))`` over
the whole batch first, then call ``aggregate_loss(..., denominator=D)`` (or ``policy_objective(...,
denominator=D)``) on each micro-batch and backpropagate each; the sum of those losses (and of their gradients)
equals the full-batch value. With several data-parallel ranks, all-reduce D as a sum first.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlfabric.objectives import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, POLICY_RATIOS

LOG_RATIO_CLAMP = 20.0  # |log ratio| beyond this would overflow exp in float32 long before it means anything


# -- masked reductions ----------------------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(x * mask) over ``dim`` (all elements when None); masked positions count as 0 even if x is NaN there."""
    weights = mask.to(x.dtype)
    picked = torch.where(weights != 0, x * weights, torch.zeros_like(x))
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(x * mask) / sum(mask) over ``dim``; 0 where the mask is empty (not NaN)."""
    weight = mask.to(x.dtype)
    total = weight.sum() if dim is None else weight.sum(dim)
    return masked_sum(x, mask, dim) / torch.where(total > 0, total, torch.ones_like(total))


def _zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), x, torch.zeros_like(x))


# -- advantages ---------------------------------------------------------------------------------------------


def _as_float(rewards: Tensor) -> Tensor:
    return rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())


def _group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per sample: r - group mean, group size, and the group's unbiased variance (0 for a group of one).

    The mean is taken of r - max_g (shifted, then shifted back): a group of equal rewards then centres to exactly
    0. Unshifted, eight float32 rewards of 0.1 sum to a mean one rounding off 0.1, and dividing that by
    (std + eps) gave every sample of the group an advantage of -0.0074 instead of 0: a gradient from a group with
    no signal, and rows the learner could not skip.
    """
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards and group_ids must be [N]; got {tuple(rewards.shape)}, {tuple(group_ids.shape)}")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    counts = counts.to(rewards.dtype)
    peaks = torch.full_like(counts, -torch.inf).scatter_reduce(0, inverse, rewards, "amax")
    shifted = rewards - peaks[inverse]
    sums = torch.zeros_like(counts).index_add_(0, inverse, shifted)
    centered = shifted - (sums / counts)[inverse]
    squares = torch.zeros_like(counts).index_add_(0, inverse, centered**2)
    variance = squares / (counts - 1).clamp_min(1)
    return centered, counts[inverse], variance[inverse]


def grpo_advantages(rewards: Tensor, group_ids: Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean_g) / (std_g + eps), std_g unbiased (as TRL).

    ``scale_by_std=False`` is Dr. GRPO (Liu et al. 2025): A_i = r_i - mean_g. Groups (samples sharing a group id,
    any order, any size) are reduced with index_add; a group of one, or of equal rewards, gets advantage 0.
    """
    centered, _, variance = _group_stats(_as_float(rewards), group_ids)
    return centered / (variance.sqrt() + eps) if scale_by_std else centered


def rloo_advantages(rewards: Tensor, group_ids: Tensor, *, scale_by_std: bool = True) -> Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i in g} r_j = n/(n-1) * (r_i - mean_g); 0 when n = 1.
    (``scale_by_std``: the estimators' shared signature; only "grpo" reads it.)"""
    centered, size, _ = _group_stats(_as_float(rewards), group_ids)
    return centered * size / (size - 1).clamp_min(1)


def reinforce_pp_advantages(
    rewards: Tensor,
    group_ids: Tensor | None = None,
    subtract_group_mean: bool = False,
    eps: float = 1e-6,
    *,
    scale_by_std: bool = True,
) -> Tensor:
    """REINFORCE++ (Hu 2025): A_i = (a_i - mean_batch a) / (std_batch a + eps), std unbiased, over the whole batch.

    a = r (REINFORCE++), or a = r - mean_g with ``subtract_group_mean`` (REINFORCE++-baseline). Outcome rewards
    only: one advantage per sequence. A batch of one sample gets advantage 0.
    """
    rewards = _as_float(rewards)
    if subtract_group_mean:
        if group_ids is None:
            raise ValueError("reinforce_pp_advantages: subtract_group_mean=True needs group_ids")
        rewards = _group_stats(rewards, group_ids)[0]
    centered = rewards - rewards.mean()
    std = rewards.std() if rewards.numel() > 1 else torch.zeros_like(rewards.mean())
    return centered / (std + eps)


def reinforce_pp_baseline_advantages(rewards: Tensor, group_ids: Tensor, *, scale_by_std: bool = True) -> Tensor:
    """REINFORCE++-baseline (Hu 2025): a_i = r_i - mean_g, then A_i = (a_i - mean_batch a) / (std_batch a + eps)."""
    return reinforce_pp_advantages(rewards, group_ids, subtract_group_mean=True)


def compute_advantages(estimator: str, rewards: Tensor, group_ids: Tensor, *, scale_by_std: bool = True) -> Tensor:
    """Advantages by the estimator's name in ``rlfabric.objectives.ADVANTAGE_ESTIMATORS``.

    ``scale_by_std`` applies to "grpo" only (False = Dr. GRPO); the others ignore it.
    """
    return ADVANTAGE_ESTIMATORS.resolve(estimator)(rewards, group_ids, scale_by_std=scale_by_std)


# -- ratios and the clipped surrogate -------------------------------------------------------------------------


def token_log_ratio(new_logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """PPO / GRPO: log r_{i,t} = new_{i,t} - old_{i,t}, 0 at masked positions."""
    return _zero_masked(new_logp - old_logp, mask)


def sequence_log_ratio(new_logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token (Zheng et al. 2025): log r_{i,t} = sg[log s_i] + new_{i,t} - sg[new_{i,t}], with
    log s_i = masked mean_t (new - old), 0 at masked positions.

    The value is the sequence's length-normalized log ratio at every token, while the gradient is that of
    new_{i,t} alone. With A constant over a sequence and "seq_mean_token_mean" aggregation this is exactly GSPO's
    sequence-level gradient.
    """
    seq = masked_mean(token_log_ratio(new_logp, old_logp, mask), mask, dim=-1).detach().unsqueeze(-1)
    return _zero_masked(seq + new_logp - new_logp.detach(), mask)


def log_ratio(new_logp: Tensor, old_logp: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """log r_{i,t} by the ratio's name in ``rlfabric.objectives.POLICY_RATIOS`` ("token", "sequence")."""
    return POLICY_RATIOS.resolve(level)(new_logp, old_logp, mask)


def clamped_ratio(new_logp: Tensor, old_logp: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """The importance ratio the policy losses use: r = exp(clamp(log r, -20, 20)), log r at ``level``."""
    return log_ratio(new_logp, old_logp, mask, level).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def _per_token(advantages: Tensor) -> Tensor:
    """[N] advantages as [N, 1], broadcasting over tokens; [N, T] ones as they are."""
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def surrogate_terms(
    new_logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    ratio_level: str = "token",
) -> tuple[Tensor, Tensor, Tensor]:
    """The clipped surrogate's parts: (A per token, -r A, -clip(r, 1 - clip_low, 1 + clip_high) A), with
    r = exp(clamp(log r, -20, 20)) at ``ratio_level``."""
    advantages, ratio = _per_token(advantages), clamped_ratio(new_logp, old_logp, mask, ratio_level)
    return advantages, -advantages * ratio, -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)


def clipped_policy_loss(
    new_logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    ratio_level: str = "token",
) -> tuple[Tensor, Tensor]:
    """PPO-clip per token with an asymmetric range (DAPO's clip-higher, Yu et al. 2025).

    loss_{i,t} = -min(r A_i, clip(r, 1 - clip_low, 1 + clip_high) A_i),  r = exp(clamp(log r, -20, 20))
    Returns ([N, T] loss, 0 at masked positions; clip fraction = masked share of tokens where the clipped term
    wins, i.e. whose gradient is zero). ``advantages`` is [N] (or [N, T] for per-token advantages).
    """
    _, unclipped, clipped = surrogate_terms(new_logp, old_logp, advantages, mask, clip_low, clip_high, ratio_level)
    loss = _zero_masked(torch.maximum(unclipped, clipped), mask)
    clip_fraction = masked_mean((clipped > unclipped).to(loss.dtype), mask).detach()
    return loss, clip_fraction


DUAL_CLIP_C = 3.0  # dual-clip PPO's bound on a negative advantage's loss, in |A| (Ye et al. 2020; verl's default)


def dual_clip_policy_loss(
    new_logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    ratio_level: str = "token",
) -> tuple[Tensor, Tensor]:
    """Dual-clip PPO (Ye et al. 2020; verl's default policy loss): PPO-clip, and where the advantage is negative
    the loss is also capped at c |A|, so a token whose ratio has grown far past 1 under a negative advantage (a
    stale or off-policy sample) cannot dominate the update.

    loss_{i,t} = max(-r A_i, -clip(r, 1 - clip_low, 1 + clip_high) A_i)              for A_i >= 0
    loss_{i,t} = min(max(-r A_i, -clip(r, 1 - clip_low, 1 + clip_high) A_i), -c A_i)  for A_i < 0,  c = 3
    Returns ([N, T] loss, 0 at masked positions; clip fraction = masked share of tokens whose gradient is zero:
    the clipped term wins, or the cap does). ``advantages`` is [N] (or [N, T]).
    """
    advantages, unclipped, clipped = surrogate_terms(
        new_logp, old_logp, advantages, mask, clip_low, clip_high, ratio_level
    )
    ppo = torch.maximum(unclipped, clipped)
    cap = -DUAL_CLIP_C * advantages
    capped = (advantages < 0) & (ppo > cap)
    loss = _zero_masked(torch.where(capped, cap.expand_as(ppo), ppo), mask)
    clip_fraction = masked_mean(((clipped > unclipped) | capped).to(loss.dtype), mask).detach()
    return loss, clip_fraction


def cispo_policy_loss(
    new_logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    ratio_level: str = "token",
) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped importance ratio, held constant.

    loss_{i,t} = -sg(clip(r, 1 - clip_low, 1 + clip_high)) A_i logp_{i,t},  r = exp(clamp(log r, -20, 20))
    Unlike the clipped surrogate, every token keeps a gradient (-w A through logp); clipping bounds only its
    weight. Returns ([N, T] loss, 0 at masked positions; clip fraction = masked share of tokens whose weight was
    clipped). ``advantages`` is [N] (or [N, T]).
    """
    advantages, ratio = _per_token(advantages), clamped_ratio(new_logp, old_logp, mask, ratio_level).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = _zero_masked(-weight * advantages * new_logp, mask)
    clip_fraction = masked_mean((weight != ratio).to(loss.dtype), mask)
    return loss, clip_fraction


def named_policy_loss(
    name: str,
    new_logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    ratio_level: str = "token",
) -> tuple[Tensor, Tensor]:
    """The policy loss by its name in ``rlfabric.objectives.POLICY_LOSSES``: ([N, T] loss, clip fraction)."""
    fn = POLICY_LOSSES.resolve(name)
    return fn(new_logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high, ratio_level=ratio_level)


# -- aggregation ---------------------------------------------------------------------------------------------


def _token_count(mask: Tensor) -> float:
    return float(mask.to(torch.float64).sum())


def _sequence_count(mask: Tensor) -> float:
    """Sequences with at least one loss token (an all-masked one, e.g. overlong-filtered, does not count)."""
    return float((mask.to(torch.float64).sum(-1) > 0).sum())


def token_mean(loss_per_token: Tensor, mask: Tensor, norm_length: int | None = None) -> tuple[Tensor, float]:
    """DAPO: loss = sum_{i,t} m l / sum_{i,t} m, as (numerator, denominator)."""
    return masked_sum(loss_per_token, mask), _token_count(mask)


def seq_mean_token_mean(loss_per_token: Tensor, mask: Tensor, norm_length: int | None = None) -> tuple[Tensor, float]:
    """Original GRPO: loss = sum_i [sum_t m l / sum_t m] / #sequences, as (numerator, denominator)."""
    return masked_mean(loss_per_token, mask, dim=-1).sum(), _sequence_count(mask)


def seq_mean_token_sum_norm(
    loss_per_token: Tensor, mask: Tensor, norm_length: int | None = None
) -> tuple[Tensor, float]:
    """Dr. GRPO: loss = sum_i [sum_t m l / norm_length] / #sequences, as (numerator, denominator);
    norm_length > 0."""
    if norm_length is None or norm_length <= 0:
        raise ValueError(f"aggregation 'seq_mean_token_sum_norm' needs norm_length > 0; got {norm_length!r}")
    return masked_sum(loss_per_token, mask) / norm_length, _sequence_count(mask)


def aggregate_loss_sum(
    loss_per_token: Tensor, mask: Tensor, mode: str, norm_length: int | None = None
) -> tuple[Tensor, float]:
    """(numerator, denominator) with aggregate_loss = numerator / denominator, by the aggregation's name in
    ``rlfabric.objectives.LOSS_AGGREGATIONS``; both add up over micro-batches."""
    return LOSS_AGGREGATIONS.resolve(mode)(loss_per_token, mask, norm_length)


def aggregate_denominator(mask: Tensor, mode: str, norm_length: int | None = None) -> float:
    """The denominator of ``aggregate_loss``: sum(mask) for "token_mean", else the number of sequences with at
    least one loss token. Additive over micro-batches."""
    return aggregate_loss_sum(torch.zeros_like(mask, dtype=torch.float32), mask, mode, norm_length)[1]


def aggregate_loss(
    loss_per_token: Tensor,
    mask: Tensor,
    mode: str,
    norm_length: int | None = None,
    denominator: float | None = None,
) -> Tensor:
    """Scalar loss: numerator / denominator of ``aggregate_loss_sum`` (0 when nothing is trained on).

    Pass the whole batch's ``denominator`` (summed ``aggregate_denominator`` of every micro-batch) so that the
    micro-batch losses add up to the full-batch loss.
    """
    numerator, local = aggregate_loss_sum(loss_per_token, mask, mode, norm_length)
    denominator = local if denominator is None else denominator
    return numerator / (denominator if denominator > 0 else 1.0)


# -- penalties and distributions --------------------------------------------------------------------------------


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = logp - ref_logp (Schulman 2020): unbiased for KL(pi || pi_ref) under samples of pi, can be negative."""
    return logp - ref_logp


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(d) - d - 1, d = clamp(ref_logp - logp, -20, 20) (Schulman 2020): unbiased, nonnegative, lower
    variance than k1."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(d) - d


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, by the estimator's name in
    ``rlfabric.objectives.KL_ESTIMATORS`` ("k1", "k3")."""
    return KL_ESTIMATORS.resolve(estimator)(logp, ref_logp)


def adaptive_kl_coef(
    coef: float, kl: float, target: float, samples: int, horizon: int, max_error: float = 0.2
) -> float:
    """The KL coefficient after one update, by Ziegler et al. (2019)'s adaptive controller:
    e = clip(kl / target - 1, -max_error, max_error), coef' = coef * (1 + e * samples / horizon).

    It grows while the measured KL (``kl``, the update's as logged: its loss aggregation's mean of the per-token
    estimate) is above ``target`` and shrinks while below, by at most ``max_error`` per ``horizon`` samples trained
    (so with ``samples`` <= ``horizon`` it stays positive). A KL that was not measured (NaN) leaves it as it is.
    """
    if math.isnan(kl):
        return coef
    error = min(max(kl / target - 1.0, -max_error), max_error)
    return coef * (1.0 + error * samples / horizon)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v, p = softmax(z); [N, T, V] -> [N, T]."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def token_logprobs_from_logits(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(z / tau)[y] = z_y / tau - logsumexp(z / tau); gathers instead of keeping a [N, T, V] log_softmax.

    Sampling at temperature tau means the behaviour policy is softmax(z / tau), so the learner must use the same tau.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


# -- the whole objective --------------------------------------------------------------------------------------


def _ratio_metrics(new_logp: Tensor, old_logp: Tensor, mask: Tensor, ratio_level: str) -> dict[str, float]:
    """ratio_mean: masked mean of the ratio the loss used; approx_kl: masked mean of (r - 1) - log r per token."""
    with torch.no_grad():
        level_ratio = log_ratio(new_logp, old_logp, mask, ratio_level).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        token = log_ratio(new_logp, old_logp, mask, "token").clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return {
            "ratio_mean": masked_mean(level_ratio.exp(), mask).item(),
            "approx_kl": masked_mean(torch.expm1(token) - token, mask).item(),
        }


def row_logprob_gaps(learner_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> Tensor:
    """[N] each row's mean absolute logprob gap per loss token: gap_i = sum_t m_it |l_it - b_it| / max(sum_t m_it, 1)
    (l: the learner's logprobs, b: the behaviour ones, m: the loss mask)."""
    return masked_sum((learner_logp - behaviour_logp).abs(), mask, dim=-1) / mask.sum(-1).clamp(min=1)


def logprob_drifted(gaps: Tensor, sampled_version: Tensor, version: int, max_gap: float) -> Tensor:
    """[N] bool, the trace check's logprob half: drifted_i = (v_i == version) and (gap_i > max_gap).

    Only rows sampled by the very weights that recomputed them (``v_i``, a row's one sampled version, equals the
    learner's ``version``) can be held to their behaviour logprobs; older or mixed-version rows differ rightly.
    """
    return (sampled_version == version) & (gaps > max_gap)


def policy_objective(
    new_logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ratio_level: str = "token",
    policy_loss: str = "clip",
    aggregation: str = "token_mean",
    norm_length: int | None = None,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """loss = agg(pg loss) + kl_coef * agg(kl(new || ref)) - entropy_coef * agg(entropy), one aggregation; the pg
    loss is ``policy_loss``'s (``POLICY_LOSSES``: the clipped surrogate by default).

    Metrics (python floats): pg_loss, kl (with ref_logp), entropy (with entropy) are aggregated like the loss, so
    with a shared ``denominator`` they add up over micro-batches; clip_fraction, ratio_mean, approx_kl are token
    means over this call's mask.
    """
    if kl_coef != 0 and ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logp")
    if entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy")
    if denominator is None:
        denominator = aggregate_denominator(mask, aggregation, norm_length)

    def agg(per_token: Tensor) -> Tensor:
        return aggregate_loss(per_token, mask, aggregation, norm_length, denominator)

    pg, clip_fraction = named_policy_loss(
        policy_loss, new_logp, old_logp, advantages, mask, clip_low, clip_high, ratio_level
    )
    total = agg(pg)
    metrics = {"pg_loss": total.item(), "clip_fraction": clip_fraction.item()}
    metrics.update(_ratio_metrics(new_logp, old_logp, mask, ratio_level))
    if ref_logp is not None:
        kl = agg(kl_penalty(new_logp, ref_logp, kl_estimator))
        total, metrics["kl"] = total + kl_coef * kl, kl.item()
    if entropy is not None:
        ent = agg(entropy)
        total, metrics["entropy"] = total - entropy_coef * ent, ent.item()
    return total, metrics


# -- sample filters and reward shaping (DAPO) -------------------------------------------------------------------


def overlong_mask(truncated: Tensor) -> Tensor:
    """Overlong filtering (DAPO): a float [N] weight, 0 for sequences cut off at the length limit, else 1."""
    return (~truncated.bool()).to(torch.get_default_dtype())


def soft_overlong_penalty(lengths: Tensor, max_length: int, buffer: int) -> Tensor:
    """Soft overlong punishment (DAPO), added to the reward; L = max_length, B = buffer:

    0 for len <= L - B;  (L - B - len) / B for L - B < len <= L;  -1 for len > L.
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"soft_overlong_penalty needs 0 < buffer <= max_length; got buffer={buffer}, {max_length=}")
    excess = (max_length - buffer) - lengths.to(torch.get_default_dtype())
    return (excess / buffer).clamp(-1.0, 0.0)
