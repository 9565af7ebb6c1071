"""A verl reward module, written as verl users write them (tests/test_verl_compat.py runs it unchanged)."""

from __future__ import annotations

from typing import Any


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, bonus: float = 0.0
) -> dict[str, Any]:
    """verl's dict form: "score" is the reward; "acc" its accuracy; "pred" and "source" are extra info (strings),
    "bonus" a numeric extra that must not change the reward."""
    answer = solution_str.strip().split(" ")[0] if solution_str.strip() else ""
    acc = answer == str(ground_truth)
    return {"score": 1.0 if acc else -0.5, "acc": acc, "pred": answer, "source": data_source, "bonus": 5.0 + bonus}


def compute_score_float(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """verl's number form."""
    return float(solution_str.strip() == str(ground_truth))
