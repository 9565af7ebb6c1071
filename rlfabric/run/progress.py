"""What a run shows while it trains: the terminal's progress lines and what goes to TensorBoard."""

from __future__ import annotations

import math
import time
from typing import Any


def format_eta(seconds: float | None) -> str:
    """``1m05s`` / ``42s``; ``?`` before there is a rate to go by."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class EtaClock:
    """Time left of each phase at the rate measured since the first row of it this process saw:
    eta = (total - done) / ((done - done_first) / (now - t_first)); None until the rate is known."""

    def __init__(self) -> None:
        self.starts: dict[Any, tuple[float, int]] = {}  # phase -> (when its first row came, its count then)

    def eta(self, phase: Any, done: int, total: int) -> float | None:
        started, first = self.starts.setdefault(phase, (time.monotonic(), done))
        rate = (done - first) / max(time.monotonic() - started, 1e-9)
        return max(0.0, (total - done) / rate) if rate > 0 else None  # the last batch may pass the total


class PhaseProgressLine:
    """``grpo_progress_line`` of a GRPO config's rows, each with its phase's total and time left (``EtaClock``)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg, self.clock = cfg, EtaClock()

    def __call__(self, row: dict[str, Any]) -> str:
        total, done = phase_progress(self.cfg, row)
        return grpo_progress_line(row, total, self.clock.eta(row.get("phase"), done, total))


# How an evaluation row that is not at a GRPO step is shown (both are at step 0).
EVAL_LABELS = {"initial": "before training", "after_sft": "after SFT"}

# Step counter and total of each phase before the GRPO steps: (row field, config section, config field).
PHASE_STEPS = {
    "sft": ("sft_step", "sft", "steps"),
    "rm_lm": ("rm_lm_step", "reward_model", "lm_steps"),
    "rm": ("rm_step", "reward_model", "steps"),
    "rm_eval": ("rm_step", "reward_model", "steps"),
}


def phase_progress(cfg: Any, row: dict[str, Any]) -> tuple[int, int]:
    """(total, done) of a metrics row's phase: the SFT or reward-model steps, else the GRPO steps."""
    counter, section, total = PHASE_STEPS.get(row.get("phase"), ("step", "training", "total_steps"))
    return int(getattr(getattr(cfg, section), total)), int(row.get(counter, 0))


def unscored_note(row: dict[str, Any]) -> str:
    """ " (F of N unscored)" for an evaluation row whose rewards failed on F of its N samples; "" when none did."""
    failed = row.get("eval_failed") or 0
    return f" ({failed} of {row.get('eval_samples', '?')} unscored)" if failed else ""


def grpo_progress_line(row: dict[str, Any], total: int | None = None, eta_s: float | None = None) -> str:
    """The terminal line for a metrics row: ``total`` steps of its phase, and the time left when known."""
    of = f"/{total}" if total else ""
    eta = f" | ETA {format_eta(eta_s)}" if total else ""
    if row.get("phase") == "rm_lm":
        return f"rm backbone {row['rm_lm_step']:>5}{of} | loss {row['rm_lm_loss']:.3f} | {row['time_s']:6.0f}s{eta}"
    if row.get("phase") == "rm":
        # a classifier reward model's rows carry its batch's pair accuracy; a judge's (next-token loss) do not
        accuracy = f" | pair acc {row['rm_accuracy']:.3f}" if "rm_accuracy" in row else ""
        return f"rm   {row['rm_step']:>5}{of} | loss {row['rm_loss']:.3f}{accuracy} | {row['time_s']:6.0f}s{eta}"
    if row.get("phase") == "rm_eval":
        what = "verdict" if "rm_eval_accuracy_pointwise" in row else "pair"  # a judge's, by mode
        return f"rm eval {row['rm_step']:>5} | held-out {what} accuracy {row['rm_eval_accuracy']:.3f}"
    if row.get("phase") == "sft":
        return f"sft  {row['sft_step']:>5}{of} | loss {row['sft_loss']:.3f} | {row['time_s']:6.0f}s{eta}"
    if row.get("phase") == "eval":
        when = EVAL_LABELS.get(row.get("label"), f"step {row['step']:>5}")
        accuracy = "n/a" if row["eval_accuracy"] is None else f"{row['eval_accuracy']:.3f}"
        by_source = [  # held-out rows of several data sources: each one's accuracy after the whole
            f"{key.removeprefix('eval_accuracy/')} {value:.3f}"
            for key, value in row.items()
            if key.startswith("eval_accuracy/") and value is not None
        ]
        sources = f" ({', '.join(by_source)})" if by_source else ""
        return f"eval {when} | held-out accuracy {accuracy}{sources}{unscored_note(row)} | {row['time_s']:6.0f}s"
    accuracy = row.get("accuracy")
    lr = f" | lr {row['lr']:.1e}" if row.get("lr") is not None else ""  # the schedule's rate this step
    return (
        f"step {row['step']:>5}{of} | reward {row['reward_mean']:6.3f} | "
        f"acc {'  n/a' if accuracy is None else f'{accuracy:5.3f}'} | v{row['policy_version']}{lr} | "
        f"{row['samples_per_s']:6.1f} samples/s | failed {row['failed_samples']} | {row['time_s']:6.0f}s{eta}"
    )


def tensorboard_view(row: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """Where a metrics row goes in TensorBoard: SFT rows at their own SFT step under ``sft/``, evaluations under
    ``eval/``, GRPO rows at their GRPO step."""
    numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if row.get("phase") == "sft":
        return int(row["sft_step"]), {f"sft/{k.removeprefix('sft_')}": v for k, v in numbers.items() if k != "sft_step"}
    if row.get("phase") in ("rm_lm", "rm", "rm_eval"):
        counter = PHASE_STEPS[row["phase"]][0]
        skip = (counter, "step", "iteration")
        return int(row[counter]), {
            f"reward_model/{k.removeprefix('rm_')}": v for k, v in numbers.items() if k not in skip
        }
    if row.get("phase") == "eval":
        return int(row["step"]), {f"eval/{k.removeprefix('eval_')}": v for k, v in numbers.items() if "eval" in k}
    return int(row["step"]), {k: v for k, v in numbers.items() if k not in ("step", "iteration")}


def ppo_progress_line(row: dict[str, Any], total_env_steps: int, eta_s: float | None = None) -> str:
    """The PPO terminal line: iteration, env steps (and the share of ``total_env_steps``), rate, return, failures,
    time left."""
    ret = row.get("episode_return_mean")
    pct = 100.0 * row["env_steps"] / total_env_steps
    return (
        f"iter {row['iteration']:>4} | env steps {row['env_steps']:>10,} ({pct:5.1f}%) | "
        f"{row['env_steps_per_s']:>8,.0f} steps/s | return {'   n/a' if ret is None else f'{ret:9.2f}'} | "
        f"v{row['policy_version']} dropped {row['dropped_fragments']} restarts {row['runner_restarts']} | "
        f"ETA {format_eta(eta_s)}"
    )
