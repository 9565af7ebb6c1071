"""Training a generative judge from preference pairs (``reward_model.kind: judge``): a causal LM taught to write
the verdicts the judge service asks for (``rlfabric.judge``), on the service's own prompts.

Each pair ``{prompt, chosen, rejected[, head]}`` judges one criterion, its head, on a scale of 1 (Zhang et al.'s
generative verifiers, 2024: the verdict is the judge's next tokens). From a pair come examples of every mode:

* pointwise: the chosen completion gets ``head=1``, the rejected ``head=0``;
* pairwise: the two in a random order, the verdict naming the chosen (``head=A`` or ``head=B``); a quarter of the
  time one completion against itself, ``head=tie``;
* listwise: 2 to ``max_candidates`` candidates, each the chosen or the rejected at even odds, one verdict line each.

First ``lm_steps`` of next-token training on the chosen texts (as for a reward model: the judge must first know
what a good answer looks like), then ``steps`` of next-token training on the examples with the loss on the verdict
(and EOS) alone. Held-out pairs (prompts the training pairs do not have) measure, before training and every
``eval_every`` steps, the share of examples whose whole verdict the judge predicts token for token (greedy
decoding writes exactly that verdict): ``rm_eval_accuracy`` (pointwise) and ``rm_eval_accuracy_<mode>``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlfabric.models.sequences import right_padded
from rlfabric.reward_model_training import (
    base_language_model,
    load_pair_rows,
    optimizer_step,
    pair_head,
    warm_up_backbone,
)
from rlfabric.rewards.judge_format import (
    MODES,
    listwise_prompt,
    listwise_verdict,
    make_rubric,
    pairwise_prompt,
    pairwise_verdict,
    pointwise_prompt,
    pointwise_verdict,
)


@dataclass(frozen=True)
class JudgeExample:
    mode: str
    prompt: str  # what the judge service sends
    verdict: str  # what the judge must write


def judge_examples(row: dict[str, Any], head: str, rng: np.random.Generator, max_candidates: int) -> list[JudgeExample]:
    """The examples of every mode one pair gives (module docstring)."""
    rubric = make_rubric([head])
    prompt, good, bad = row["prompt"], row["chosen"], row["rejected"]
    out = [
        JudgeExample("pointwise", pointwise_prompt(prompt, good, rubric), pointwise_verdict({head: 1}, rubric)),
        JudgeExample("pointwise", pointwise_prompt(prompt, bad, rubric), pointwise_verdict({head: 0}, rubric)),
    ]
    if rng.random() < 0.25:
        same = good if rng.random() < 0.5 else bad
        out.append(
            JudgeExample(
                "pairwise", pairwise_prompt(prompt, same, same, rubric), pairwise_verdict({head: "tie"}, rubric)
            )
        )
    else:
        first, second, winner = (good, bad, "A") if rng.random() < 0.5 else (bad, good, "B")
        out.append(
            JudgeExample(
                "pairwise", pairwise_prompt(prompt, first, second, rubric), pairwise_verdict({head: winner}, rubric)
            )
        )
    picks = rng.random(int(rng.integers(2, max_candidates + 1))) < 0.5
    candidates = [good if p else bad for p in picks]
    scores = [{head: int(p)} for p in picks]
    out.append(JudgeExample("listwise", listwise_prompt(prompt, candidates, rubric), listwise_verdict(scores, rubric)))
    return out


def examples_of(
    rows: Sequence[dict[str, Any]], heads: Sequence[str], seed: int, max_candidates: int, field: str
) -> list[JudgeExample]:
    """Every row's examples; a ConfigError naming ``field`` and the row for one that is not a pair."""
    rng = np.random.default_rng(seed)
    out: list[JudgeExample] = []
    for i, row in enumerate(rows):
        out.extend(judge_examples(row, pair_head(row, i, heads, field), rng, max_candidates))
    return out


def encode_examples(
    tokenizer: Any, examples: Sequence[JudgeExample]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) right-padded; labels are -100 except on the verdict and EOS."""
    rows, targets = [], []
    for ex in examples:
        asked = tokenizer(ex.prompt, add_special_tokens=False).input_ids
        answer = tokenizer(ex.verdict, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append(asked + answer)
        targets.append([-100] * len(asked) + answer)
    ids, mask = right_padded(rows, tokenizer.pad_token_id)
    labels, _ = right_padded(targets, -100)
    return ids, mask, labels


def verdict_accuracy(model: Any, tokenizer: Any, examples: Sequence[JudgeExample], batch_size: int) -> float:
    """The share of ``examples`` whose every verdict token (and EOS) is the model's argmax after the tokens
    before it: what greedy decoding would write."""
    model.eval()
    right = 0
    with torch.inference_mode():
        for start in range(0, len(examples), batch_size):
            ids, mask, labels = encode_examples(tokenizer, examples[start : start + batch_size])
            predicted = model(input_ids=ids, attention_mask=mask).logits[:, :-1].argmax(-1)
            target = labels[:, 1:]
            counted = target != -100
            right += int(((predicted == target) | ~counted).all(dim=1).sum())
    return right / max(len(examples), 1)


def judge_positions(examples: Sequence[JudgeExample], tokenizer: Any) -> int:
    """Positions the judge model needs: the longest example, rounded up to a multiple of 64."""
    longest = max(len(tokenizer(e.prompt + e.verdict, add_special_tokens=False).input_ids) + 1 for e in examples)
    return -(-longest // 64) * 64


def train_judge(
    rm: Any,
    *,
    base: str,
    builtin: Any,
    tokenizer: Any,
    out_dir: Path,
    seed: int,
    max_candidates: int,
    log: Callable[[dict[str, Any]], None],
) -> dict[str, float]:
    """Train the judge of ``rm`` (the ``reward_model`` section, ``kind: judge``) and save it with ``tokenizer`` in
    ``out_dir``; rows with ``phase`` rm_lm, rm and rm_eval go to ``log``. Returns the last held-out accuracies."""
    from rlfabric.models.hf import save_pretrained

    field = "reward_model.pairs"
    train_rows, heldout_rows = load_pair_rows(rm.pairs, rm.num_pairs, rm.num_eval, seed)
    train = examples_of(train_rows, rm.heads, seed, max_candidates, field)
    heldout = examples_of(heldout_rows, rm.heads, seed + 1, max_candidates, field)
    sizes = dataclasses.replace(builtin, max_positions=max(builtin.max_positions, judge_positions(train, tokenizer)))
    model = base_language_model(base, tokenizer, sizes, seed)
    rng = np.random.default_rng(seed)
    started = time.perf_counter()

    def timed(row: dict[str, Any]) -> None:
        log({**row, "time_s": round(time.perf_counter() - started, 2)})

    if rm.lm_steps:
        chosen = [r["prompt"] + r["chosen"] for r in train_rows]
        warm_up_backbone(model, tokenizer, chosen, rm, rng, timed)

    def evaluate(step: int) -> dict[str, float]:
        by_mode = {
            m: verdict_accuracy(model, tokenizer, [e for e in heldout if e.mode == m], rm.batch_size) for m in MODES
        }
        scores = {"rm_eval_accuracy": by_mode["pointwise"], **{f"rm_eval_accuracy_{m}": a for m, a in by_mode.items()}}
        timed({"phase": "rm_eval", "rm_step": step, **scores})
        return scores

    scores = evaluate(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=rm.lr, weight_decay=0.0)
    for step in range(1, rm.steps + 1):
        model.train()
        rows = rng.choice(len(train), size=min(rm.batch_size, len(train)), replace=False)
        ids, mask, labels = encode_examples(tokenizer, [train[i] for i in rows])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer_step(model, optimizer, loss)
        timed({"phase": "rm", "rm_step": step, "rm_loss": float(loss.detach())})
        if step % rm.eval_every == 0 or step == rm.steps:
            scores = evaluate(step)
    save_pretrained(model.eval(), tokenizer, out_dir)
    return scores
