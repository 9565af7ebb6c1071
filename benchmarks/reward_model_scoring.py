"""Reward-model scoring: rlfabric's reward service path against a plain transformers forward loop.

Both score the same samples (prompt + completion texts) with the same sequence-classification model and the same
batch size, one after the other in this process:

* anchor, the way TRL scores with a colocated reward model: the samples in arrival order, each batch tokenized
  with padding to its longest text, one forward under ``torch.no_grad``;
* rlfabric (``rlfabric.rewards.reward_model.score_texts``, what the reward service runs on all the groups of a
  call at once): the samples sorted by token count, so each batch pads to texts of about its own length, under
  ``torch.inference_mode``.

The workload has real work for the sort: completion lengths spread like a GRPO batch's (uniform over 8 to
``--max-chars`` characters). The easy case, every completion of one length (nothing to gain from sorting), runs
too, labelled. Scores are checked equal (atol 1e-4) before timing.

    python benchmarks/reward_model_scoring.py            # 512 samples, batch 64, a 4 x 256 model
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


def texts_of(n: int, max_chars: int, equal: bool, seed: int) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghij 0123456789+="
    out = []
    for _ in range(n):
        length = max_chars if equal else rng.randint(8, max_chars)
        out.append(f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=" + "".join(rng.choice(letters) for _ in range(length)))
    return out


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


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-chars", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from rlfabric.rewards.reward_model import load_reward_model, score_texts

    torch.set_num_threads(2)
    report = {"args": vars(args), "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp) / "rm", args.layers, args.hidden)
        model, tokenizer, _ = load_reward_model(str(Path(tmp) / "rm"))
        for label, equal in (("spread lengths", False), ("easy case: equal lengths", True)):
            texts = texts_of(args.samples, args.max_chars, equal, seed=1)
            ours = score_texts(model, tokenizer, texts, args.batch_size, None)
            anchor = plain_loop(model, tokenizer, texts, args.batch_size)
            np.testing.assert_allclose(ours, anchor, atol=1e-4)
            t_ours = timed(lambda t=texts: score_texts(model, tokenizer, t, args.batch_size, None), args.repeats)
            t_anchor = timed(lambda t=texts: plain_loop(model, tokenizer, t, args.batch_size), args.repeats)
            row = {
                "rlfabric_samples_per_s": args.samples / t_ours,
                "plain_loop_samples_per_s": args.samples / t_anchor,
                "ratio": t_anchor / t_ours,
            }
            report["workloads"][label] = row
            print(
                f"{label}: rlfabric {row['rlfabric_samples_per_s']:.0f} samples/s, plain transformers loop "
                f"{row['plain_loop_samples_per_s']:.0f} samples/s: {row['ratio']:.2f}x",
                flush=True,
            )
    (HERE / "results" / "reward_model_scoring.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
