"""Learning on the MCP task servers: GiGPO against GRPO, and the adaptive efficiency penalty against success alone.

Each comparison trains ``examples/agent_mcp_grpo.yaml`` (or ``--config``) twice with the same seed and budget,
differing only in the setting under test, one run after the other (2 cores: never two at once). The warm-up
plays ``wasteful_player`` (``--player``): it guesses without calling on a third of its episodes and repeats a
lookup on about a third, so the policy GRPO starts from solves tasks in one call or in two, and steps taken from
one state differ in what they lead to (answer now, look again, guess): work for both settings under test.

* ``credit``: ``grpo.step_credit: none`` (GRPO: one advantage per episode) against ``gigpo`` (the episode advantage
  plus a step advantage among steps that acted in the same server state);
* ``efficiency``: success alone against ``rewards.efficiency`` (weight 0.2 on the ``calls`` count, on successful
  episodes only).

It reads each run's metrics.jsonl and plots, per comparison, the held-out success (``eval_accuracy``), the sampled
policy's success on training tasks and the tool calls per solved episode, both runs in one figure
(``benchmarks/results/mcp_agent_<comparison>.png``), and writes the figures to
``benchmarks/results/mcp_agent_learning.json``.

    python benchmarks/mcp_agent_learning.py                       # both comparisons
    python benchmarks/mcp_agent_learning.py --only credit --steps 20 --sft-steps 300
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from training_runs import plot_panels, train_run

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
COMPARISONS = {
    "credit": {"GRPO": ["grpo.step_credit=none"], "GiGPO": ["grpo.step_credit=gigpo"]},
    "efficiency": {
        "success only": ["rewards.efficiency.weight=0.0"],
        "success + efficiency penalty": [
            "rewards.efficiency.weight=0.2",
            "rewards.efficiency.counts=[calls]",
            "rewards.efficiency.apply=on_success",
        ],
    },
}


def curves(rows: list[dict]) -> dict[str, list]:
    """Held-out success by step, and per GRPO step the sampled success and the calls per solved episode."""
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if r.get("phase") == "eval"]
    grpo = [r for r in rows if r.get("phase") == "grpo"]
    return {
        "eval_steps": [s for s, _ in evals],
        "eval_accuracy": [a for _, a in evals],
        "steps": [r["step"] for r in grpo],
        "train_success": [r.get("accuracy") for r in grpo],
        "calls_per_solved": [r.get("solved_tool_calls", 0) / max(r.get("solved_episodes", 0), 1) for r in grpo],
        "solved_episodes": [r.get("solved_episodes", 0) for r in grpo],
        "solved_tool_calls": [r.get("solved_tool_calls", 0) for r in grpo],
    }


def calls_per_solved(c: dict[str, list], last: int) -> float:
    """Tool calls per solved episode over the last ``last`` steps: their solved episodes' calls over their count
    (a step without a solved episode adds nothing, rather than a 0)."""
    solved = sum(c["solved_episodes"][-last:])
    return sum(c["solved_tool_calls"][-last:]) / solved if solved else float("nan")


def plot(name: str, runs: dict[str, dict[str, list]], path: Path) -> None:
    panels = [
        ("eval_steps", "eval_accuracy", "held-out success (greedy)"),
        ("steps", "train_success", "success on training tasks (sampled)"),
        ("steps", "calls_per_solved", "tool calls per solved episode"),
    ]
    plot_panels(runs, panels, f"MCP task servers: {name}", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(HERE.parent / "examples" / "agent_mcp_grpo.yaml"))
    parser.add_argument("--only", choices=sorted(COMPARISONS), help="run one comparison")
    parser.add_argument("--steps", type=int, help="training.total_steps of every run (default: the config's)")
    parser.add_argument("--sft-steps", type=int, help="sft.steps of every run (default: the config's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--player", default="rlfabric.envs.mcp_tasks:wasteful_player", help="sft.player of every run")
    args = parser.parse_args()
    common = [f"training.seed={args.seed}", f"sft.player={args.player}"] + (
        [f"training.total_steps={args.steps}"] if args.steps else []
    )
    common += [f"sft.steps={args.sft_steps}"] if args.sft_steps else []
    out_json = RESULTS / "mcp_agent_learning.json"
    report = json.loads(out_json.read_text()) if out_json.exists() else {}
    for name in [args.only] if args.only else list(COMPARISONS):
        runs = {}
        for label, overrides in COMPARISONS[name].items():
            with tempfile.TemporaryDirectory() as tmp:
                rows, wall = train_run(args.config, common + overrides, Path(tmp) / "run")
            runs[label] = {**curves(rows), "wall_s": wall, "overrides": overrides}
            c = runs[label]
            tail = [x for x in c["train_success"][-5:] if x is not None]
            print(
                f"{name} / {label}: held-out {c['eval_accuracy']} at steps {c['eval_steps']}; sampled success, last 5 "
                f"steps {sum(tail) / max(len(tail), 1):.3f}; calls per solved episode, last 10 steps "
                f"{calls_per_solved(c, 10):.2f}; {wall:.0f} s",
                flush=True,
            )
        plot(name, runs, RESULTS / f"mcp_agent_{name}.png")
        report[name] = {"config": args.config, "seed": args.seed, "player": args.player, "runs": runs}
        out_json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
