"""What ``rlfabric eval`` shows of its report (``rlfabric.evaluation``): the printed table and the two plots,
best-of-N accuracy against N per selector (log2 axis) and selector score against response length."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rlfabric.run.plots import pyplot


def format_report(report: dict[str, Any]) -> str:
    """The printed table: best-of-N accuracy per selector beside pass@N and a random pick, then score and
    accuracy by response length for each selector."""
    labels = list(report["selectors"])
    width = max(10, *(len(label) + 2 for label in labels))
    header = f"{'N':>4}" + "".join(f"{label:>{width}}" for label in [*labels, "pass@N", "random"])
    lines = [
        f"== rlfabric eval: {report['policy']} ==",
        f"  config: {report['config']}; prompts: {report['data']}",
        f"  {report['prompts']} prompts x {report['samples_per_prompt']} completions "
        f"(temperature {report['sampling']['temperature']:g}); correct: {report['correct_component']} > 0; "
        f"verifier failures: {report['verifier_failed_samples']}",
        "  best-of-N accuracy (expected over the N-subsets of each prompt's completions):",
        "    " + header,
    ]
    for k, n in enumerate(report["n"]):
        cells = [report["selectors"][label]["best_of_n"][k]["accuracy"] for label in labels]
        cells += [report["pass_at_n"][k]["accuracy"], report["accuracy"]]
        lines.append("    " + f"{n:>4}" + "".join(f"{100 * v:>{width - 1}.1f}%" for v in cells))
    for source, sums in report.get("by_source", {}).items():
        passes = ", ".join(f"pass@{row['n']} {100 * row['accuracy']:.1f}%" for row in sums["pass_at_n"])
        lines.append(f"  {source} ({sums['prompts']} prompts): accuracy {100 * sums['accuracy']:.1f}%, {passes}")
    for label in labels:
        sel = report["selectors"][label]
        r = sel["length_score_correlation"]
        picked = ", ".join(f"N={row['n']}: {row['response_tokens']:.1f}" for row in sel["best_of_n"])
        lines.append(f"  {label}: by response length (correlation of score and tokens: {_num(r, '.2f')})")
        lines.append(f"    tokens of the pick: {picked}")
        lines.append(f"    {'tokens':>9}{'samples':>9}{'score':>10}{'accuracy':>10}")
        for b in sel["length_bins"]:
            lo, hi = b["tokens_min"], b["tokens_max"]
            span = f"{lo}" if lo == hi else f"{lo}-{hi}"
            lines.append(
                f"    {span:>9}{b['samples']:>9}{_num(b['score_mean'], '.3f'):>10}{100 * b['accuracy']:>9.1f}%"
            )
    return "\n".join(lines)


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def plot_best_of_n(report: dict[str, Any], path: Path) -> Path:
    """Best-of-N accuracy against N (log2 axis), one line per selector, with pass@N (the oracle) and a random
    pick (the mean accuracy) for reference."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ns = report["n"]
    for label, sel in report["selectors"].items():
        ax.plot(ns, [row["accuracy"] for row in sel["best_of_n"]], "o-", lw=1.5, label=f"best-of-N by {label}")
    ax.plot(ns, [row["accuracy"] for row in report["pass_at_n"]], "k--", lw=1.2, label="pass@N (oracle)")
    ax.axhline(report["accuracy"], color="gray", ls=":", lw=1.2, label="random pick")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("N (completions to choose from)")
    ax.set_ylabel(f"accuracy ({report['correct_component']} > 0)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"best-of-N, {report['prompts']} prompts x {report['samples_per_prompt']} samples", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_reward_vs_length(report: dict[str, Any], samples: list[dict[str, Any]], path: Path) -> Path:
    """One panel per selector: each completion's score against its response tokens (correct ones green, the
    rest red, jittered sideways so equal lengths stay visible), and the mean score per length bin."""
    plt = pyplot()
    labels = list(report["selectors"])
    fig, axes = plt.subplots(1, len(labels), figsize=(4.5 * len(labels), 3.8), dpi=100, squeeze=False)
    rng = np.random.default_rng(0)
    tokens = np.array([s["response_tokens"] for s in samples], np.float64)
    correct = np.array([s["correct"] for s in samples], bool)
    jitter = rng.uniform(-0.25, 0.25, tokens.size)
    for ax, label in zip(axes[0], labels, strict=True):
        score = np.array([np.nan if s["scores"][label] is None else s["scores"][label] for s in samples])
        for mask, color, name in ((correct, "tab:green", "correct"), (~correct, "tab:red", "wrong")):
            ax.scatter(tokens[mask] + jitter[mask], score[mask], s=8, alpha=0.35, color=color, label=name)
        bins = [b for b in report["selectors"][label]["length_bins"] if b["score_mean"] is not None]
        centers = [(b["tokens_min"] + b["tokens_max"]) / 2 for b in bins]
        ax.plot(centers, [b["score_mean"] for b in bins], "k-o", lw=1.5, ms=4, label="mean per bin")
        ax.set_xlabel("response tokens")
        ax.set_ylabel(f"{label} score")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
