"""Learning benchmark for games: MAPPO on mpe2 simple_spread_v3 and self-play on tic-tac-toe, from the examples.

simple_spread: trains ``examples/spread_mappo.yaml`` for a fixed budget and reports the per-agent episode return
(mean of the last 100 training episodes, stochastic policy; and the greedy evaluation), the wall clock, and a
uniformly random policy's return measured here on the same env. Reward convention: mpe2's default
``local_ratio=0.5``, each agent's reward is half the shared team reward (minus the sum over landmarks of the
nearest agent's distance, minus collisions) plus half its own collision penalty; the return is per agent over a
25-step episode. The MAPPO paper (Yu et al. 2022) reports about -120 at convergence for its own MPE code's
Spread, whose reward is the team reward summed over the 3 agents and over 25 steps: divide by 3 (about -40) and
mind the different local/global split before comparing. The curve goes next to a random policy's line.

tic-tac-toe: trains ``examples/tictactoe_selfplay.yaml`` and reports the final greedy win rate against a uniformly
random player and against the scripted player (200 games each, half as each side), and the learner's Elo.

Usage::

    python benchmarks/game_learning.py [--spread-steps 400000] [--tictactoe-steps 600000] [--only spread|tictactoe]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
MAPPO_PAPER_SPREAD = -120.0  # team return summed over 3 agents, the paper's own MPE code


def random_spread_return(episodes: int = 200) -> float:
    """Per-agent episode return of uniformly random actions on simple_spread_v3 (seeded episodes)."""
    warnings.simplefilter("ignore", DeprecationWarning)
    from mpe2 import simple_spread_v3

    from rlfabric.multiagent.baselines import random_policy_return

    return random_policy_return(simple_spread_v3.parallel_env(), episodes)


def train(config: Path, steps: int, name: str) -> tuple[Path, float]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"rlfabric-{name}-"))
    cmd = ["rlfabric", "train", str(config), f"training.total_env_steps={steps}", "--run-dir", str(run_dir)]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    start = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return run_dir, time.monotonic() - start


def spread(steps: int) -> dict:
    run_dir, wall = train(EXAMPLES / "spread_mappo.yaml", steps, "spread")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    random_return = random_spread_return()
    plot_spread(rows, random_return, HERE / "results" / "spread_mappo_curve.png")
    return {
        "env_steps": summary["env_steps"],
        "episode_return_mean": summary["episode_return_mean"],
        "eval_return_mean": summary["eval_return_mean"],
        "random_policy_return": random_return,
        "mappo_paper_spread_team_return": MAPPO_PAPER_SPREAD,
        "wall_s": wall,
        "train_time_s": summary["time_total_s"],
        "env_steps_per_s": summary["env_steps_per_s"],
    }


def plot_spread(rows: list[dict], random_return: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["env_steps"] for r in rows], [r["episode_return_mean"] for r in rows], label="MAPPO (rlfabric)")
    ax.axhline(random_return, color="gray", ls="--", label=f"random policy ({random_return:.1f})")
    ax.set_xlabel("env steps")
    ax.set_ylabel("episode return per agent (last 100 episodes)")
    ax.set_title("simple_spread_v3, 3 agents")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def tictactoe(steps: int) -> dict:
    run_dir, wall = train(EXAMPLES / "tictactoe_selfplay.yaml", steps, "tictactoe")
    summary = json.loads((run_dir / "summary.json").read_text())
    (HERE / "results" / "tictactoe_selfplay.png").write_bytes((run_dir / "self_play.png").read_bytes())
    keep = ("env_steps", "eval_games", "learner_elo", "opponent_pool_size", "time_total_s", "env_steps_per_s")
    out = {k: summary[k] for k in keep}
    out.update({k: v for k, v in summary.items() if k.startswith("eval_") and "_rate_vs_" in k})
    out["wall_s"] = wall
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spread-steps", type=int, default=400_000)
    parser.add_argument("--tictactoe-steps", type=int, default=600_000)
    parser.add_argument("--only", choices=["spread", "tictactoe"])
    args = parser.parse_args()
    out_path = HERE / "results" / "game_learning.json"
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    if args.only in (None, "spread"):
        results["simple_spread_mappo"] = spread(args.spread_steps)
    if args.only in (None, "tictactoe"):
        results["tictactoe_selfplay"] = tictactoe(args.tictactoe_steps)
    out_path.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
