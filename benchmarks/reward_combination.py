"""MO-GRPO's per-component normalization against the plain weighted sum, on two conflicting components.

Trains ``examples/mo_grpo.yaml`` (or ``--config``) twice with the same seed and budget, one run after the other
(2 cores: never two at once): ``rewards.combine.normalize=false`` (the weighted sum) and ``true`` (MO-GRPO). It
plots, per GRPO step, each raw component of both runs (``reward_correct``: the sampled answers' accuracy,
``reward_length_penalty``) and the held-out accuracy, in one figure (``benchmarks/results/mo_grpo.png``), and
writes the curves to ``benchmarks/results/mo_grpo.json``.

    python benchmarks/reward_combination.py
    python benchmarks/reward_combination.py --steps 60 --seed 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from training_runs import plot_panels, train_run

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RUNS = {"weighted sum": ["rewards.combine.normalize=false"], "MO-GRPO": ["rewards.combine.normalize=true"]}
COMPONENTS = ("reward_correct", "reward_length_penalty")


def curves(rows: list[dict]) -> dict[str, list]:
    """Per GRPO step each raw component's mean over the step's samples; held-out accuracy by step."""
    grpo = [r for r in rows if r.get("phase") == "grpo"]
    evals = [r for r in rows if r.get("phase") == "eval"]
    return {
        "steps": [r["step"] for r in grpo],
        **{c: [r.get(c) for r in grpo] for c in COMPONENTS},
        "eval_steps": [r["step"] for r in evals],
        "eval_accuracy": [r["eval_accuracy"] for r in evals],
    }


def plot(runs: dict[str, dict[str, list]], path: Path) -> None:
    panels = [
        ("steps", "reward_correct", "component: correct (sampled)"),
        ("steps", "reward_length_penalty", "component: length_penalty (sampled)"),
        ("eval_steps", "eval_accuracy", "held-out accuracy (greedy)"),
    ]
    plot_panels(runs, panels, "Two conflicting components: weighted sum against MO-GRPO normalization", path)


def mean_of_last(values: list, k: int = 10) -> float:
    tail = [v for v in values[-k:] if v is not None]
    return sum(tail) / max(len(tail), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(HERE.parent / "examples" / "mo_grpo.yaml"))
    parser.add_argument("--steps", type=int, help="training.total_steps of both runs (default: the config's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    common = [f"training.seed={args.seed}"] + ([f"training.total_steps={args.steps}"] if args.steps else [])
    runs = {}
    for label, overrides in RUNS.items():
        with tempfile.TemporaryDirectory() as tmp:
            rows, wall = train_run(args.config, common + overrides, Path(tmp) / "run")
        runs[label] = {**curves(rows), "wall_s": wall, "overrides": overrides}
        c = runs[label]
        print(
            f"{label}: held-out {c['eval_accuracy']} at steps {c['eval_steps']}; last 10 steps: correct "
            f"{mean_of_last(c['reward_correct']):.3f}, length_penalty {mean_of_last(c['reward_length_penalty']):.3f}; "
            f"{wall:.0f} s",
            flush=True,
        )
    RESULTS.mkdir(exist_ok=True)
    plot(runs, RESULTS / "mo_grpo.png")
    (RESULTS / "mo_grpo.json").write_text(
        json.dumps({"config": args.config, "seed": args.seed, "runs": runs}, indent=1)
    )


if __name__ == "__main__":
    main()
