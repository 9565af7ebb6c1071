"""Training a reward model from preference pairs (``reward_model`` in a GRPO config; ``rlfabric train-rm``).

A pair is a row ``{"prompt", "chosen", "rejected"}`` plus, for a model of several heads, ``"head"`` (which head
the preference trains; the first head when absent): the ``reward_model.pairs`` file (.jsonl or .parquet) or a
generated task (``task:arithmetic_pairs``). The model is a Hugging Face sequence-classification model with one
output per head, named in its config's ``id2label``: with ``model.path: builtin``, a small Qwen2 of the
``model.builtin`` sizes on the same character tokenizer as the policy; else ``model.path`` with a new head.

First ``lm_steps`` of next-token training on the chosen texts (the supervised model InstructGPT starts its reward
model from), then a score layer of one output per head on that backbone. Each step scores the chosen and rejected
texts (prompt + completion) of ``batch_size`` pairs in one padded batch and minimises the Bradley-Terry loss on each
pair's head (``rlfabric.algorithms.preference``). Held-out pairs (prompts the training pairs do not have) are
ranked before training and every ``eval_every`` steps: pair accuracy per head. The model is saved in Hugging Face
format, where ``{name: reward_model, kwargs: {path: ...}}`` serves it.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlfabric.algorithms.preference import bradley_terry_loss, pair_accuracy, pick_heads
from rlfabric.config import ConfigError
from rlfabric.data import RowFields, load_heldout, load_prompts
from rlfabric.models.sequences import right_padded
from rlfabric.rewards.reward_model import score_texts

PAIR_COLUMNS = ("prompt", "chosen", "rejected")
# What a pairs file's errors name: its columns are fixed, and its held-out pairs are the rows training leaves.
PAIR_FIELDS = RowFields(
    count="reward_model.num_pairs",
    count_takes_null=False,
    heldout_count="reward_model.num_eval",
    heldout="",
    prompt_key="",
    columns=PAIR_COLUMNS,
)


@dataclass
class PreferencePairs:
    """Pairs as parallel lists: the two texts to score (prompt + completion) and the head each pair trains."""

    chosen: list[str]
    rejected: list[str]
    head: np.ndarray  # [P] int64: index into the model's heads

    def __len__(self) -> int:
        return len(self.chosen)


def pair_head(row: dict[str, Any], i: int, heads: Sequence[str], field: str) -> str:
    """The head row ``i`` trains (the first head when it names none); a ConfigError naming ``field``, the row and
    the column for a row that is not a pair."""
    for column in PAIR_COLUMNS:
        if not isinstance(row.get(column), str):
            raise ConfigError(f"{field}: row {i} has no text column {column!r} (a pair is {', '.join(PAIR_COLUMNS)})")
    name = row.get("head", heads[0])
    if name not in heads:
        raise ConfigError(f"{field}: row {i} trains head {name!r}, not one of reward_model.heads {list(heads)}")
    return name


def preference_pairs(rows: Sequence[dict[str, Any]], heads: Sequence[str], field: str) -> PreferencePairs:
    """The rows as pairs; a ConfigError naming ``field``, the row and the column for a row that is not one."""
    chosen, rejected, head = [], [], []
    for i, row in enumerate(rows):
        name = pair_head(row, i, heads, field)
        chosen.append(row["prompt"] + row["chosen"])
        rejected.append(row["prompt"] + row["rejected"])
        head.append(heads.index(name))
    return PreferencePairs(chosen, rejected, np.asarray(head, np.int64))


def load_pair_rows(spec: str, num_pairs: int, num_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Training rows and held-out rows (whose prompts are not training prompts) of ``spec``
    (``reward_model.pairs``)."""
    field = "reward_model.pairs"
    train = load_prompts(spec, num_rows=num_pairs, seed=seed, field=field, fields=PAIR_FIELDS, keep_out=num_eval)
    if not train:
        raise ConfigError(f"{field} = {spec!r}: holds no pairs")
    return train, load_heldout(
        spec,
        train_rows=train,
        num_rows=num_eval,
        seed=seed,
        field=field,
        count_field=PAIR_FIELDS.heldout_count,
        fields=PAIR_FIELDS,
    )


def load_pairs(
    spec: str, num_pairs: int, num_eval: int, heads: Sequence[str], seed: int
) -> tuple[PreferencePairs, PreferencePairs]:
    """Training pairs and held-out pairs (whose prompts are not training prompts) from ``spec``."""
    train, heldout = load_pair_rows(spec, num_pairs, num_eval, seed)
    return preference_pairs(train, heads, "reward_model.pairs"), preference_pairs(heldout, heads, "reward_model.pairs")


def optimizer_step(model: Any, optimizer: Any, loss: Any) -> None:
    """One update on ``loss``, the gradient's norm clipped to 1 (every stage of reward-model and judge training)."""
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def base_language_model(base: str, tokenizer: Any, builtin: Any, seed: int) -> Any:
    """The causal LM the reward model grows from: the builtin Qwen2 of ``builtin``'s sizes (``base`` "builtin",
    seeded) or the model at ``base``."""
    from rlfabric.models.hf import build_small_qwen2, load_causal_lm

    if base != "builtin":
        return load_causal_lm(base)
    return build_small_qwen2(
        tokenizer,
        num_layers=builtin.num_layers,
        hidden_size=builtin.hidden_size,
        num_heads=builtin.num_heads,
        max_positions=builtin.max_positions,
        seed=seed,
    )


def with_score_heads(language_model: Any, tokenizer: Any, heads: Sequence[str], folder: Path, seed: int) -> Any:
    """The sequence-classification model of ``language_model``'s backbone and a new (seeded) score layer of one
    output per head, named in ``id2label``: saved to ``folder`` and loaded back the way transformers maps a
    causal LM's weights onto a classifier."""
    from transformers import AutoModelForSequenceClassification

    from rlfabric.models.hf import save_pretrained

    save_pretrained(language_model, tokenizer, folder)
    labels = {"id2label": dict(enumerate(heads)), "label2id": {h: i for i, h in enumerate(heads)}}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=len(heads), **labels)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def encode(tokenizer: Any, texts: Sequence[str], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of ``texts``, right-padded: the model pools each row's last real token."""
    return right_padded([tokenizer(t, add_special_tokens=False).input_ids for t in texts], pad_id)


def pair_scores(
    model: Any, tokenizer: Any, pairs: PreferencePairs, rows: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_chosen, r_rejected) of ``rows`` on each pair's head, chosen and rejected in one forward pass."""
    texts = [pairs.chosen[i] for i in rows] + [pairs.rejected[i] for i in rows]
    ids, mask = encode(tokenizer, texts, model.config.pad_token_id)
    logits = model(input_ids=ids, attention_mask=mask).logits
    head = torch.from_numpy(np.concatenate([pairs.head[rows], pairs.head[rows]]))
    scores = pick_heads(logits, head)
    return scores[: len(rows)], scores[len(rows) :]


def warm_up_backbone(
    model: Any, tokenizer: Any, texts: Sequence[str], rm: Any, rng: np.random.Generator, log: Callable[..., None]
) -> None:
    """``rm.lm_steps`` steps of next-token training of the causal LM ``model`` on ``texts`` (the chosen
    completions after their prompts, closed with EOS), ``2 * rm.batch_size`` texts a step (as many as a ranking
    step reads): the supervised model InstructGPT starts its reward model from. A ranking loss alone teaches a
    small model from scratch what a good answer is far too slowly."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=rm.lr)
    model.train()
    for step in range(1, rm.lm_steps + 1):
        rows = rng.choice(len(texts), size=min(2 * rm.batch_size, len(texts)), replace=False)
        ids, mask = encode(tokenizer, [texts[i] + tokenizer.eos_token for i in rows], tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        optimizer_step(model, optimizer, loss)
        log({"phase": "rm_lm", "rm_lm_step": step, "rm_lm_loss": float(loss.detach())})


def heldout_accuracy(
    model: Any, tokenizer: Any, pairs: PreferencePairs, heads: Sequence[str], batch_size: int
) -> dict[str, float]:
    """Pair accuracy on ``pairs``, overall (``rm_eval_accuracy``) and per head (``rm_eval_accuracy_<head>``),
    the texts scored the way the reward service scores them (``score_texts``)."""
    model.eval()
    rows = np.arange(len(pairs))
    c = torch.from_numpy(score_texts(model, tokenizer, pairs.chosen, batch_size, None)[rows, pairs.head])
    r = torch.from_numpy(score_texts(model, tokenizer, pairs.rejected, batch_size, None)[rows, pairs.head])
    out = {"rm_eval_accuracy": pair_accuracy(c, r)}
    for k, head in enumerate(heads):
        on_head = torch.from_numpy(pairs.head == k)
        if on_head.any():
            out[f"rm_eval_accuracy_{head}"] = pair_accuracy(c[on_head], r[on_head])
    return out


def train_reward_model(
    rm: Any,
    *,
    base: str,
    builtin: Any,
    tokenizer: Any,
    out_dir: Path,
    seed: int,
    log: Callable[[dict[str, Any]], None],
) -> dict[str, float]:
    """Train the reward model ``rm`` (the config's ``reward_model`` section) and save it with ``tokenizer`` in
    ``out_dir``; each step's and each evaluation's metrics go to ``log`` (rows with ``phase`` "rm" and
    "rm_eval"). Returns the last held-out accuracies."""
    from rlfabric.models.hf import save_pretrained

    train, heldout = load_pairs(rm.pairs, rm.num_pairs, rm.num_eval, rm.heads, seed)
    rng = np.random.default_rng(seed)
    started = time.perf_counter()

    def timed(row: dict[str, Any]) -> None:
        log({**row, "time_s": round(time.perf_counter() - started, 2)})

    language_model = base_language_model(base, tokenizer, builtin, seed)
    if rm.lm_steps:
        warm_up_backbone(language_model, tokenizer, train.chosen, rm, rng, timed)
    model = with_score_heads(language_model, tokenizer, rm.heads, out_dir / "backbone", seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=rm.lr, weight_decay=0.0)

    def evaluate(step: int) -> dict[str, float]:
        scores = heldout_accuracy(model, tokenizer, heldout, rm.heads, rm.batch_size)
        timed({"phase": "rm_eval", "rm_step": step, **scores})
        return scores

    scores = evaluate(0)
    for step in range(1, rm.steps + 1):
        model.train()
        rows = rng.choice(len(train), size=min(rm.batch_size, len(train)), replace=False)
        chosen, rejected = pair_scores(model, tokenizer, train, rows)
        loss = bradley_terry_loss(chosen, rejected, rm.margin)
        optimizer_step(model, optimizer, loss)
        timed(
            {
                "phase": "rm",
                "rm_step": step,
                "rm_loss": float(loss.detach()),
                "rm_accuracy": pair_accuracy(chosen.detach(), rejected.detach()),
            }
        )
        if step % rm.eval_every == 0 or step == rm.steps:
            scores = evaluate(step)
    save_pretrained(model.eval(), tokenizer, out_dir)
    shutil.rmtree(out_dir / "backbone", ignore_errors=True)
    return scores
