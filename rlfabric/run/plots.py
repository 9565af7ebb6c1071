"""Learning curves of a run, as PNG files in its run directory."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rlfabric.run.log import read_metrics

PLOT_FILE = "learning_curve.png"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, imported only when a plot is drawn (runs without plots never pay it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_learning_curve(run_dir: Path, title: str) -> Path | None:
    """env steps vs episode_return_mean, as a PNG; None when there is nothing to plot."""
    rows = [r for r in read_metrics(run_dir) if r.get("episode_return_mean") is not None]
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["env_steps"] for r in rows], [r["episode_return_mean"] for r in rows], lw=1.5)
    ax.set_xlabel("env steps")
    ax.set_ylabel("episode return (mean)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = run_dir / PLOT_FILE
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_self_play(run_dir: Path, title: str) -> Path | None:
    """A self-play run: the learner's Elo against its opponent pool (left axis) and its win rates against the
    evaluation baselines (right axis) by iteration, as ``self_play.png``; None when there is nothing to plot."""
    rows = [r for r in read_metrics(run_dir) if r.get("learner_elo") is not None]
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["iteration"] for r in rows], [r["learner_elo"] for r in rows], color="tab:blue", label="Elo vs pool")
    ax.set_xlabel("iteration")
    ax.set_ylabel("Elo (learner, against its pool)")
    rates = sorted({k for r in rows for k in r if k.startswith("win_rate_vs_")})
    right = ax.twinx()
    for i, key in enumerate(rates):
        points = [r for r in rows if r.get(key) is not None]
        right.plot(
            [r["iteration"] for r in points],
            [r[key] for r in points],
            "o-",
            color=f"C{i + 1}",
            lw=1.2,
            label=key.replace("_", " "),
        )
    right.set_ylabel("win rate (greedy games)")
    right.set_ylim(-0.02, 1.02)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="lower right")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = run_dir / "self_play.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_llm_curves(run_dir: Path, title: str) -> Path | None:
    """Train reward / accuracy per step and held-out accuracy at each evaluation, as one PNG."""
    rows = read_metrics(run_dir)
    train = [r for r in rows if r.get("phase") == "grpo"]
    evals = [r for r in rows if r.get("phase") == "eval"]
    if not train and not evals:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        steps = [r["step"] for r in train]
        reward, accuracy = [r["reward_mean"] for r in train], [r.get("accuracy") for r in train]
        same = accuracy == reward  # the reward is the accuracy (the other components weigh 0): one line, said so
        label = "train reward (= train accuracy)" if same else "train reward"
        ax.plot(steps, reward, color="tab:blue", lw=1.2, alpha=0.8, label=label)
        if not same and None not in accuracy:
            ax.plot(steps, accuracy, color="tab:orange", ls="--", lw=1.2, alpha=0.8, label="train accuracy")
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [math.nan if r["eval_accuracy"] is None else r["eval_accuracy"] for r in evals],  # none scored: a gap
            "o-",
            color="tab:green",
            lw=2,
            label="held-out accuracy (greedy)",
        )
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = run_dir / PLOT_FILE
    fig.savefig(path)
    plt.close(fig)
    return path
