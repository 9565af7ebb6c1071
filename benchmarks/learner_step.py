"""The GRPO learner's update in one process, side by side with a minimal TRL-style step on the same batch.

Where the learner's time goes, without Ray: ``LLMLearnerCore.train_step`` (rlfabric's update: micro-batches,
entropy, the loss's shared denominator, fused AdamW) against the least a framework can do for the same update
(one forward with ``logits_to_keep``, token logprobs, the clipped-ratio loss at ratio 1, backward, gradient
clipping, AdamW), which is what TRL's training part runs. Same model as ``grpo_step_vs_trl.py`` (4 x 256
character Qwen2), 64 rows (8 prompts x 8 completions, as GRPO samples them), every row trained, at two widths:
short completions (what a warmed-up model writes, 2-5 tokens) and long ones (a tenth of the rows at 32 tokens).
rlfabric runs twice: with its default shared-prefix packing (each prompt once, no padding between responses) and
with ``learner.sequence_packing: padded`` (the TRL layout: one padded row per completion).

    python benchmarks/learner_step.py [--threads 2] [--reps 8]

Prints the median seconds per update of each, and their ratio, per width.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from rlfabric.actors.llm_learner import LLMLearnerCore
from rlfabric.grpo_config import GRPOConfig
from rlfabric.models.hf import build_small_model_dir, load_causal_lm
from rlfabric.models.packed_batch import pack_sequences


def make_batch(long_fraction: float, seed: int = 0) -> dict[str, np.ndarray]:
    """8 prompts of 5-8 tokens, 8 rows each; responses of 2-5 tokens, or 32 for ``long_fraction`` of the rows."""
    rng = random.Random(seed)
    prompts = [
        p for p in [[rng.randrange(3, 60) for _ in range(rng.randrange(5, 9))] for _ in range(8)] for _ in range(8)
    ]
    lengths = [32 if rng.random() < long_fraction else rng.randrange(2, 6) for _ in range(64)]
    responses = [[rng.randrange(3, 60) for _ in range(n)] for n in lengths]
    batch = pack_sequences(prompts, responses, 0)
    batch["advantages"] = np.random.default_rng(seed).standard_normal(64).astype(np.float32)
    batch["behaviour_logprobs"] = np.zeros_like(batch["response_mask"])
    return batch


def median_seconds(step: Callable[[], object], reps: int, warmup: int = 2) -> float:
    times = []
    for _ in range(warmup + reps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times[warmup:])


def minimal_step(model_dir: str, batch: dict[str, np.ndarray]) -> Callable[[], None]:
    """One TRL-style update on ``batch``: loss = -sum(ratio * A * mask) / sum(mask) at ratio 1, then AdamW."""
    model = load_causal_lm(model_dir, dtype="float32", device="cpu")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids, attention = torch.tensor(batch["input_ids"]), torch.tensor(batch["attention_mask"])
    mask, advantages = torch.tensor(batch["response_mask"]), torch.tensor(batch["advantages"])
    prompt_len = int(batch["prompt_len"])

    def step() -> None:
        logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=ids.shape[1] - prompt_len + 1).logits
        logp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, prompt_len:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        loss = -(ratio * advantages[:, None] * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_small_model_dir(Path(tmp) / "model", num_layers=4, hidden_size=256, num_heads=4))
        grpo = {
            **dataclasses.asdict(GRPOConfig()),
            "norm_length": 32,
            "skip_zero_advantage_rows": False,
            "micro_batch_size": 64,
        }
        for label, long_fraction in (("short completions", 0.0), ("a tenth at 32 tokens", 0.1)):
            batch = make_batch(long_fraction)
            seconds = {}
            for packing in ("shared_prefix", "padded"):
                learner = LLMLearnerCore(model_dir, grpo, {"lr": 1e-3}, temperature=1.0, sequence_packing=packing)
                seconds[packing] = median_seconds(lambda b=batch, ln=learner: ln.train_step(b, 1e-5), args.reps)
            theirs = median_seconds(minimal_step(model_dir, batch), args.reps)
            width = batch["input_ids"].shape[1]
            print(
                f"{label} (64 x {width}): minimal TRL-style step {theirs:.3f} s; rlfabric train_step, shared prefix "
                f"{seconds['shared_prefix']:.3f} s ({theirs / seconds['shared_prefix']:.2f}x), padded "
                f"{seconds['padded']:.3f} s ({theirs / seconds['padded']:.2f}x)"
            )


if __name__ == "__main__":
    main()
