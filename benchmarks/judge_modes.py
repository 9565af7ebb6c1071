"""LLM-judge modes side by side: a whole group judged in one listwise call against a pointwise call per sample
(and pairwise comparisons), on the same groups, the same judge and the same generator actor.

The judge is a small causal LM trained here with ``rlfabric train-rm`` (``reward_model.kind: judge``) on
arithmetic pairs whose rejected answers are non-numbers, which it learns in a few hundred steps, so every mode
has a judge that writes verdicts. The groups are GRPO-shaped: ``--groups`` prompts, ``--group-size`` completions
each, half the right sum and half a wrong one. Each mode scores every group through the reward service's core
(``RewardServiceCore``, one group per judge call set, as a reward worker does) and reports wall clock, judge
prompts sent, prompt tokens prefilled, tokens generated, verdicts that failed to parse, and how often the judge
ranks a right sum above a wrong one in the same group (the exact-sum verifier decides which
is which). Group size 2 runs too, labelled the easy case: there listwise has little prompt to share.

    python benchmarks/judge_modes.py                 # 16 groups of 8; group size 2 as the easy case
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
NON_DIGITS = "abcdefghijklmnopqrstuvwxyz+-*/=(). "


def write_pairs(path: Path, n: int, seed: int) -> None:
    """Right sums over 1 to 4 non-digit characters."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        rejected = "".join(rng.choice(NON_DIGITS) for _ in range(rng.randint(1, 4)))
        rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": rejected})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def train_judge(root: Path, steps: int, max_group: int) -> Path:
    from rlfabric.cli import main

    write_pairs(root / "pairs.jsonl", 600, seed=0)
    config = {
        "model": {"path": "builtin"},
        "grpo": {"group_size": max_group},
        "reward_model": {
            "kind": "judge",
            "pairs": str(root / "pairs.jsonl"),
            "heads": ["answer"],
            "num_pairs": 500,
            "num_eval": 50,
            "lm_steps": 0,
            "steps": steps,
            "eval_every": steps,
            "batch_size": 16,
        },
    }
    (root / "judge.yaml").write_text(yaml.safe_dump(config))
    assert main(["train-rm", str(root / "judge.yaml"), "--run-dir", str(root / "run"), "--quiet"]) == 0
    return root / "run" / "reward_model"


def make_groups(num_groups: int, group_size: int, seed: int) -> list[list]:
    from rlfabric.rewards import RewardInput

    rng = random.Random(seed)
    groups = []
    for _ in range(num_groups):
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        completions = [
            str(a + b) if rng.random() < 0.5 else "".join(rng.choice(NON_DIGITS) for _ in range(rng.randint(1, 4)))
            for _ in range(group_size)
        ]
        groups.append([RewardInput(f"{a}+{b}=", c, {"answer": str(a + b)}, "stop", len(c)) for c in completions])
    return groups


def measure(model: Path, mode: str, groups: list[list], seed: int) -> dict:
    """Score ``groups`` with the judge in ``mode`` through the reward service's core; the judge pool's counters
    before and after (a pool of its own per mode: ``seed`` keys it)."""
    from rlfabric.actors.reward_service import RewardServiceCore
    from rlfabric.judge import JUDGE_CPUS, JUDGE_TIMEOUT_S, judge_generators

    spec = {"name": "judge", "kwargs": {"model": str(model), "mode": mode, "criteria": ["answer"], "seed": seed}}
    service = RewardServiceCore([spec], group_timeout_s=600)
    pool = judge_generators(str(model), 1, JUDGE_CPUS, JUDGE_TIMEOUT_S, seed)
    service.score(groups[:1])  # warm-up: the actor has started and the engine has run once
    before = dict(vars(pool.stats))
    started = time.perf_counter()
    results = service.score(groups)
    wall = time.perf_counter() - started
    after = vars(pool.stats)
    samples = sum(len(g) for g in groups)
    failed = sum(r.error is not None for rs in results for r in rs)
    return {
        "mode": mode,
        "wall_s": round(wall, 3),
        "samples_per_s": round(samples / wall, 2),
        "judge_prompts": after["calls"] - before["calls"],
        "prompt_tokens": after["prompt_tokens"] - before["prompt_tokens"],
        "generated_tokens": after["generated_tokens"] - before["generated_tokens"],
        "unparsed": after["unparsed"] - before["unparsed"],
        "failed_samples": failed,
        "ranking_accuracy": round(ranking_accuracy(groups, results), 3),
        "samples": samples,
    }


def ranking_accuracy(groups: list[list], results: list[list]) -> float:
    """Over the (right, wrong) pairs of completions inside a group, both scored, the share the judge ranks right
    above wrong (a tie counts half): what GRPO's advantages take from a reward. Comparable across modes, whose
    scores differ in kind (a verdict, a win rate)."""
    points = pairs = 0.0
    for group, scored in zip(groups, results, strict=True):
        right = [
            r.components["judge_answer"]
            for s, r in zip(group, scored, strict=True)
            if r.error is None and s.completion == s.metadata["answer"]
        ]
        wrong = [
            r.components["judge_answer"]
            for s, r in zip(group, scored, strict=True)
            if r.error is None and s.completion != s.metadata["answer"]
        ]
        for a in right:
            for b in wrong:
                points += 1.0 if a > b else 0.5 if a == b else 0.0
                pairs += 1
    return points / pairs if pairs else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--train-steps", type=int, default=400)
    parser.add_argument("--out", default=str(HERE / "results" / "judge_modes.json"))
    args = parser.parse_args()

    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = train_judge(Path(tmp), args.train_steps, args.group_size)
        for label, size, num_groups in (
            ("GRPO groups", args.group_size, args.groups),
            ("easy case: groups of 2", 2, args.groups * args.group_size // 2),
        ):
            groups = make_groups(num_groups, size, seed=1)
            for k, mode in enumerate(("pointwise", "listwise", "pairwise")):
                row = {"workload": label, "group_size": size, "groups": num_groups, **measure(model, mode, groups, k)}
                rows.append(row)
                print(json.dumps(row))
    ray.shutdown()
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
