"""Reward-model scoring: rlfabric's reward service path against a plain transformers forward loop.

Both score the same samples (prompt + completion texts) with the same sequence-classification model and the same
batch size, one after the other in this process, with the same number of torch threads:

* anchor, the way TRL scores with a colocated reward model: the samples in arrival order, each batch tokenized
  with padding to its longest text, one forward under ``torch.no_grad``;
* rlfabric (``rlfabric.rewards.reward_model.score_samples``, what the reward service runs on all the groups of a
  call at once): the completions of a prompt that recurs scored behind one copy of it (a packed row, each
  completion seeing its prompt and itself) where that costs fewer FLOPs, the rest sorted by token count so each
  batch pads to texts of about its own length, under ``torch.inference_mode``.

Three workloads, each scored equal (atol 1e-4) before timing:

* shared prompts: GRPO groups, ``--group-size`` completions (8 to ``--completion-chars`` characters) behind each
  prompt of ``--prompt-chars`` characters, groups arriving together: the prompt is most of every text;
* spread lengths, one completion per prompt (8 to ``--max-chars`` characters): work for the sort only;
* easy case: one completion per prompt, every one ``--max-chars`` characters: nothing for sorting or sharing.

    python benchmarks/reward_model_scoring.py            # 512 samples a workload, batch 64, a 4 x 256 model
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
LETTERS = "abcdefghij 0123456789+="


def build_model(folder: Path, layers: int, hidden: int) -> None:
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from rlfabric.models.hf import build_char_tokenizer, save_pretrained

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
    )
    torch.manual_seed(0)
    save_pretrained(Qwen2ForSequenceClassification(config).eval(), tokenizer, folder)


def letters(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(n))


def one_per_prompt(n: int, max_chars: int, equal: bool, seed: int) -> tuple[list[str], list[str]]:
    """(prompts, completions): a short sum prompt each, completions of ``max_chars`` or 8 to ``max_chars``."""
    rng = random.Random(seed)
    prompts = [f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=" for _ in range(n)]
    return prompts, [letters(rng, max_chars if equal else rng.randint(8, max_chars)) for _ in range(n)]


def grouped(
    n: int, group_size: int, prompt_chars: tuple[int, int], completion_chars: int, seed: int
) -> tuple[list[str], list[str]]:
    """(prompts, completions): n samples in groups of ``group_size`` sharing a prompt, groups one after another."""
    rng = random.Random(seed)
    prompts, completions = [], []
    while len(prompts) < n:
        prompt = letters(rng, rng.randint(*prompt_chars))
        for _ in range(min(group_size, n - len(prompts))):
            prompts.append(prompt)
            completions.append(letters(rng, rng.randint(8, completion_chars)))
    return prompts, completions


def plain_loop(model, tokenizer, texts: list[str], batch_size: int) -> np.ndarray:
    """The anchor: arrival order, each batch padded to its longest on the right (the model pools the last real
    token)."""
    tokenizer.padding_side = "right"
    out = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            )
            out.append(model(**batch).logits.float().numpy())
    return np.concatenate(out)


def counting_positions(model) -> dict[str, int]:
    """Counters of the positions (padding included) and the real tokens every forward of the decoder runs on."""
    counts = {"positions": 0, "tokens": 0}
    pad = model.config.pad_token_id

    def count(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        counts["positions"] += int(ids.numel())
        counts["tokens"] += int((ids != pad).sum())

    model.get_decoder().register_forward_pre_hook(count, with_kwargs=True)
    return counts


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=512, help="samples per workload")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-chars", type=int, default=256, help="longest completion, one-per-prompt workloads")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-chars", type=int, nargs=2, default=(200, 400), help="shared prompt length range")
    parser.add_argument("--completion-chars", type=int, default=128, help="longest completion behind a shared prompt")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side; the best counts")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, the same for both sides")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "reward_model_scoring.json")
    args = parser.parse_args()
    from rlfabric.rewards.reward_model import load_reward_model, score_samples

    torch.set_num_threads(args.threads)
    low, high = args.prompt_chars
    workloads = {
        f"shared prompts: groups of {args.group_size} behind prompts of {low}-{high} characters": grouped(
            args.samples, args.group_size, (low, high), args.completion_chars, seed=1
        ),
        "spread lengths, one completion per prompt": one_per_prompt(args.samples, args.max_chars, False, seed=1),
        "easy case: equal lengths, one completion per prompt": one_per_prompt(
            args.samples, args.max_chars, True, seed=1
        ),
    }
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp) / "rm", args.layers, args.hidden)
        model, tokenizer, _ = load_reward_model(str(Path(tmp) / "rm"))
        counts = counting_positions(model)
        for label, (prompts, completions) in workloads.items():
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
            ours = lambda p=prompts, c=completions: score_samples(model, tokenizer, p, c, args.batch_size, None)  # noqa: E731
            anchor = lambda t=texts: plain_loop(model, tokenizer, t, args.batch_size)  # noqa: E731
            counts.update(positions=0, tokens=0)
            scores_ours, ran_ours = ours(), dict(counts)
            counts.update(positions=0, tokens=0)
            scores_anchor, ran_anchor = anchor(), dict(counts)
            np.testing.assert_allclose(scores_ours, scores_anchor, atol=1e-4)
            t_ours, t_anchor = timed(ours, args.repeats), timed(anchor, args.repeats)
            row = {
                "rlfabric_samples_per_s": args.samples / t_ours,
                "plain_loop_samples_per_s": args.samples / t_anchor,
                "ratio": t_anchor / t_ours,
                "rlfabric_positions": ran_ours["positions"],
                "rlfabric_tokens": ran_ours["tokens"],
                "plain_loop_positions": ran_anchor["positions"],
                "plain_loop_tokens": ran_anchor["tokens"],
            }
            report["workloads"][label] = row
            print(
                f"{label}: rlfabric {row['rlfabric_samples_per_s']:.1f} samples/s "
                f"({ran_ours['positions']} positions, {ran_ours['tokens']} real), plain transformers loop "
                f"{row['plain_loop_samples_per_s']:.1f} samples/s ({ran_anchor['positions']} positions, "
                f"{ran_anchor['tokens']} real): {row['ratio']:.2f}x",
                flush=True,
            )
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
