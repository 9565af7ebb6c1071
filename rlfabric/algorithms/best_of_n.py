"""Best-of-N selection as exact expectations over subsets, pass@N, and reward by response length.

For one prompt, M completions were sampled; s_i is a selector's score of completion i (a reward model, a function,
the training reward) and v_i any value of it (1 when correct, its length, its score). Best-of-N draws N of the M
completions uniformly without replacement and keeps the one the selector scores highest. These functions give the
expected value of what it keeps, computed exactly over all C(M, N) subsets instead of by resampling, the way
pass@k is computed from n samples (Chen et al. 2021).
"""

from __future__ import annotations

from math import comb
from typing import Any

import numpy as np


def pick_probabilities(scores: np.ndarray, n: int) -> np.ndarray:
    """[M] float64: P(completion i is kept), best of a uniform random n-subset of the M completions.

    Sort the scores; for the block of t completions tied at score s, a of the others score lower. A subset's best
    score is s exactly when it holds none of the higher-scored M - a - t and at least one of the block:
    C(a + t, n) - C(a, n) of the C(M, n) subsets. Ties are broken uniformly at random, so by symmetry every member
    of the block is kept with the same probability:

        P(i) = [C(a + t, n) - C(a, n)] / (t * C(M, n))

    Without ties (t = 1) this is C(a, n - 1) / C(M, n): the subset holds i and n - 1 of the a lower-scored ones.
    A NaN score (a completion the selector failed to score) ranks below every scored one. The probabilities sum
    to 1; n = 1 gives 1/M each, n = M gives the top block 1/t each.
    """
    s = np.asarray(scores, np.float64)
    m = len(s)
    if not 1 <= n <= m:
        raise ValueError(f"n = {n!r}: must be an integer in [1, {m}] (the completions sampled)")
    s = np.where(np.isnan(s), -np.inf, s)
    total = comb(m, n)
    out = np.zeros(m, np.float64)
    for value in np.unique(s):
        block = s == value
        a, t = int((s < value).sum()), int(block.sum())
        out[block] = (comb(a + t, n) - comb(a, n)) / (t * total)
    return out


def best_of_n(scores: np.ndarray, values: np.ndarray, n: int) -> float:
    """E[v of the kept completion] = sum_i P(i) v_i (``pick_probabilities``): with v the 0/1 correctness, the
    best-of-n accuracy on this prompt; with v the response lengths, the expected length of what is kept."""
    return float(pick_probabilities(scores, n) @ np.asarray(values, np.float64))


def pass_at_n(correct: np.ndarray, n: int) -> float:
    """P(at least one of a uniform random n-subset is correct) = 1 - C(M - c, n) / C(M, n), c of the M correct:
    best-of-n with a selector that knows the answers (the oracle)."""
    c = np.asarray(correct, bool)
    m = len(c)
    if not 1 <= n <= m:
        raise ValueError(f"n = {n!r}: must be an integer in [1, {m}] (the completions sampled)")
    return 1.0 - comb(m - int(c.sum()), n) / comb(m, n)


def accuracy_by_source(sources: list[str], correct: np.ndarray, ns: list[int]) -> dict[str, dict[str, Any]]:
    """Per data source (each prompt's, ``rlfabric.data.data_sources``), over its prompts: ``prompts``,
    ``accuracy`` (the share of its completions correct, ``correct`` [prompts, M]) and ``pass_at_n`` per n of ``ns``
    (``pass_at_n`` averaged over its prompts)."""
    names = np.array(sources)
    correct = np.asarray(correct, bool)
    out = {}
    for name in sorted(set(names.tolist())):
        rows = correct[names == name]
        out[name] = {
            "prompts": len(rows),
            "accuracy": float(rows.mean()),
            "pass_at_n": [{"n": n, "accuracy": float(np.mean([pass_at_n(c, n) for c in rows]))} for n in ns],
        }
    return out


def length_bins(lengths: np.ndarray, scores: np.ndarray, correct: np.ndarray, num_bins: int = 8) -> list[dict]:
    """Reward and accuracy by response length: the lengths cut into at most ``num_bins`` bins of equal integer
    width w = ceil((max - min + 1) / num_bins), bin k holding [min + k w, min + (k + 1) w - 1]; per non-empty bin
    its ``tokens_min``, ``tokens_max``, ``samples``, ``score_mean`` (over the scored samples: NaN scores left out;
    None when none is scored) and ``accuracy`` (the share correct)."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size == 0:
        return []
    scores, correct = np.asarray(scores, np.float64), np.asarray(correct, np.float64)
    low = int(lengths.min())
    width = -(-(int(lengths.max()) - low + 1) // num_bins)
    out = []
    for k in range(num_bins):
        rows = (lengths >= low + k * width) & (lengths < low + (k + 1) * width)
        if not rows.any():
            continue
        scored = scores[rows][~np.isnan(scores[rows])]
        out.append(
            {
                "tokens_min": low + k * width,
                "tokens_max": low + (k + 1) * width - 1,
                "samples": int(rows.sum()),
                "score_mean": float(scored.mean()) if scored.size else None,
                "accuracy": float(correct[rows].mean()),
            }
        )
    return out


# How a process reward's step scores s_1..s_K rank a completion (a selector's ``aggregate``).
STEP_AGGREGATES = ("min", "mean", "last", "sum")


def step_aggregate(step_scores: np.ndarray, how: str) -> float:
    """A completion's score from its steps' scores s_1..s_K:

        min  = min_k s_k          (the weakest step: a solution is as good as its worst step)
        mean = (1/K) sum_k s_k
        last = s_K                (the score of the whole text, as an outcome reward model gives it)
        sum  = sum_k s_k

    NaN for a completion with no step."""
    s = np.asarray(step_scores, np.float64)
    if how not in STEP_AGGREGATES:
        raise ValueError(f"aggregate = {how!r}: expected one of {', '.join(STEP_AGGREGATES)}")
    if s.size == 0:
        return float("nan")
    return float({"min": s.min, "mean": s.mean, "last": lambda: s[-1], "sum": s.sum}[how]())
