"""Process-reward-model scoring: every step prefix of every completion, rlfabric against a plain transformers loop.

A process reward model scores prompt + steps[0] + ... + steps[k] for each step k of each completion. All sides
score the same prefixes with the same sequence-classification model (a 4 x 256 Qwen2 with the character
tokenizer, random weights) and the same batch size, one after the other in this process, with the same torch
threads, and their scores are checked equal (atol 1e-4) before timing:

* anchor, a plain transformers loop: every prefix a text of its own, in arrival order, batches right-padded to
  their longest, one forward each under ``torch.no_grad`` (what scoring a PRM with TRL's or transformers' own
  tools does);
* rlfabric, prefix by prefix (``score_samples`` on the prefixes, the path before ``prefix_scores``: the prefixes
  of a prompt behind one copy of it where cheaper, the rest length-sorted), labelled;
* rlfabric (``rlfabric.rewards.prefix_scores.score_step_prefixes``, what ``process_reward_model`` runs): one
  forward over each whole text, the score of each prefix read at its last token, a group's texts behind one copy
  of their prompt where cheaper.

Workloads: GRPO groups of ``--group-size`` completions behind prompts of ``--prompt-chars`` characters, each
completion ``--steps`` lines of ``--step-chars`` characters (the work the one-forward path removes grows with
the steps); and the easy case, one step per completion (nothing to remove: every prefix is the whole text).

    python benchmarks/process_reward_scoring.py      # 256 completions a workload, 8 steps of 32 characters
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from reward_model_scoring import build_model, counting_positions, letters, plain_loop, timed  # noqa: E402


def stepped_groups(
    n: int, group_size: int, prompt_chars: tuple[int, int], steps: int, step_chars: int, seed: int
) -> tuple[list[str], list[list[str]]]:
    """(prompts, steps): n completions in groups sharing a prompt, each ``steps`` lines of about ``step_chars``."""
    rng = random.Random(seed)
    prompts: list[str] = []
    completions: list[list[str]] = []
    while len(prompts) < n:
        prompt = letters(rng, rng.randint(*prompt_chars))
        for _ in range(min(group_size, n - len(prompts))):
            prompts.append(prompt)
            lines = [letters(rng, rng.randint(step_chars // 2, step_chars)) for _ in range(steps)]
            completions.append([line + "\n" for line in lines[:-1]] + [lines[-1]])
    return prompts, completions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=256, help="completions per workload")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-chars", type=int, nargs=2, default=(100, 200))
    parser.add_argument("--steps", type=int, default=8, help="steps per completion")
    parser.add_argument("--step-chars", type=int, default=32, help="longest step")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side; the best counts")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, the same for every side")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "process_reward_scoring.json")
    args = parser.parse_args()
    from rlfabric.rewards.prefix_scores import score_step_prefixes
    from rlfabric.rewards.reward_model import load_reward_model, score_samples

    torch.set_num_threads(args.threads)
    low, high = args.prompt_chars
    workloads = {
        f"{args.steps} steps of up to {args.step_chars} characters, groups of {args.group_size}": stepped_groups(
            args.samples, args.group_size, (low, high), args.steps, args.step_chars, seed=1
        ),
        "easy case: one step per completion": stepped_groups(
            args.samples, args.group_size, (low, high), 1, args.steps * args.step_chars, seed=1
        ),
    }
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp) / "prm", args.layers, args.hidden)
        model, tokenizer, _ = load_reward_model(str(Path(tmp) / "prm"))
        counts = counting_positions(model)
        b = args.batch_size
        for label, (prompts, steps) in workloads.items():
            prefix_prompts = [p for p, s in zip(prompts, steps, strict=True) for _ in s]
            prefixes = ["".join(s[: k + 1]) for s in steps for k in range(len(s))]
            texts = [p + c for p, c in zip(prefix_prompts, prefixes, strict=True)]
            sides = {
                "rlfabric": lambda p=prompts, s=steps: np.concatenate(
                    score_step_prefixes(model, tokenizer, p, s, b, None)
                ),
                "rlfabric, prefix by prefix": lambda p=prefix_prompts, c=prefixes: score_samples(
                    model, tokenizer, p, c, b, None
                ),
                "plain transformers loop": lambda t=texts: plain_loop(model, tokenizer, t, b),
            }
            scores, positions = {}, {}
            for side, fn in sides.items():
                counts.update(positions=0, tokens=0)
                scores[side], positions[side] = fn(), counts["positions"]
            for side in sides:
                np.testing.assert_allclose(scores[side], scores["plain transformers loop"], atol=1e-4)
            seconds = {side: timed(fn, args.repeats) for side, fn in sides.items()}
            anchor = seconds["plain transformers loop"]
            row = {
                side: {
                    "prefixes_per_s": len(texts) / seconds[side],
                    "positions": positions[side],
                    "vs_plain_loop": anchor / seconds[side],
                }
                for side in sides
            }
            report["workloads"][label] = {"prefixes": len(texts), **row}
            print(f"{label} ({len(texts)} prefixes of {len(prompts)} completions):", flush=True)
            for side, r in row.items():
                print(
                    f"  {side:28s} {r['prefixes_per_s']:8.1f} prefixes/s, {r['positions']:7d} positions, "
                    f"{r['vs_plain_loop']:.2f}x the plain loop",
                    flush=True,
                )
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
