"""Reward models as a reward service: Hugging Face sequence-classification models score prompt + completion.

    rewards:
      functions:
        - {name: reward_model, kwargs: {path: runs/rm/reward_model, heads: [correct]}}

A model's heads are its ``num_labels`` outputs, named by its config's ``id2label`` (a single unnamed head is
``reward``); each head is a reward component. ``heads`` keeps some of them (train with a correctness head and a
length head, score with the first alone); ``rewards.weights`` can weigh the rest. ``path`` may list several models
with the same heads, an **ensemble**: each head's component is the members' mean, ``<head>_min`` their minimum and
``<head>_disagreement`` their standard deviation (population), so a run can penalise or gate on disagreement.

The function is **pointwise** (``pointwise = True``): the reward service hands it every sample of a call at once,
across groups, so the forward passes are batched across groups. Samples are sorted by length and cut into batches
of ``batch_size`` (less padding than batches in arrival order), run under ``torch.inference_mode``. Models load
once per process (the reward actor) and stay loaded; ``device: auto`` takes the GPU when there is one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlfabric.rewards.registry import RewardInput, pointwise

UNNAMED_HEAD = "reward"
_LOADED: dict[tuple[str, str], tuple[Any, Any, list[str]]] = {}  # (path, device) -> (model, tokenizer, heads)


def head_names(id2label: dict[Any, str] | None, num_labels: int) -> list[str]:
    """The component name of each output: ``id2label``'s labels in index order; transformers' placeholder names
    (``LABEL_0``...) of a single head become ``reward``, of several stay as they are."""
    labels = [str((id2label or {}).get(i, (id2label or {}).get(str(i), f"LABEL_{i}"))) for i in range(num_labels)]
    if num_labels == 1 and labels[0] == "LABEL_0":
        return [UNNAMED_HEAD]
    return labels


def resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_reward_model(path: str, device: str = "cpu") -> tuple[Any, Any, list[str]]:
    """(model, tokenizer, head names) of the sequence-classification model at ``path``, loaded once per process."""
    key = (str(path), device)
    if key not in _LOADED:
        from transformers import AutoModelForSequenceClassification

        from rlfabric.models.hf import load_tokenizer, quiet_transformers

        quiet_transformers()  # no weight-loading progress bars in the reward actors' logs
        model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        tokenizer = load_tokenizer(path)
        if model.config.pad_token_id is None:  # the model finds each row's last token by its pad id
            model.config.pad_token_id = tokenizer.pad_token_id
        _LOADED[key] = (model, tokenizer, head_names(model.config.id2label, model.config.num_labels))
    return _LOADED[key]


def score_texts(
    model: Any, tokenizer: Any, texts: Sequence[str], batch_size: int, max_length: int | None
) -> np.ndarray:
    """[N, H] float32: the model's outputs for each text, in the texts' order. Batches of ``batch_size`` texts
    of similar length (sorted by token count), each padded to its longest; texts longer than ``max_length``
    tokens keep their last ``max_length`` (the completion is at the end)."""
    import torch

    from rlfabric.models.sequences import right_padded

    ids = [list(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]
    if max_length is not None:
        ids = [row[-max_length:] for row in ids]
    order = np.argsort([len(row) for row in ids], kind="stable")
    out = np.zeros((len(ids), model.config.num_labels), np.float32)
    pad = model.config.pad_token_id
    device = next(model.parameters()).device
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            batch, mask = right_padded([ids[i] for i in rows], pad)
            logits = model(input_ids=batch.to(device), attention_mask=mask.to(device)).logits
            out[rows] = logits.float().cpu().numpy()
    return out


def ensemble_components(scores: np.ndarray, heads: Sequence[str]) -> list[dict[str, float]]:
    """Per sample, from ``scores`` [M, N, H] (M models): with one model, {head: score}; with several, {head: mean
    over models, head_min: min over models, head_disagreement: std over models (population)}."""
    members, n, _ = scores.shape
    out: list[dict[str, float]] = [{} for _ in range(n)]
    for h, head in enumerate(heads):
        values = scores[:, :, h]
        mean, low, spread = values.mean(0), values.min(0), values.std(0)
        for i in range(n):
            out[i][head] = float(mean[i])
            if members > 1:
                out[i][f"{head}_min"] = float(low[i])
                out[i][f"{head}_disagreement"] = float(spread[i])
    return out


def _paths(path: str | Sequence[str]) -> list[str]:
    return [path] if isinstance(path, (str, os.PathLike)) else [str(p) for p in path]


def check_reward_model_kwargs(
    path: str | Sequence[str] = "",
    heads: Sequence[str] | None = None,
    batch_size: int = 64,
    max_length: int | None = None,
    device: str = "cpu",
) -> None:
    """Checked on the driver before any actor starts: every path a model folder whose heads include ``heads``."""
    paths = _paths(path)
    if not paths or not all(paths):
        raise ValueError(
            "path: give the folder of a sequence-classification model (or a list of them: an ensemble), "
            "or set reward_model.pairs to train one in this run"
        )
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size = {batch_size!r}: must be an integer >= 1")
    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length = {max_length!r}: must be null or an integer >= 1")
    if device not in ("cpu", "cuda", "auto") and not str(device).startswith("cuda:"):
        raise ValueError(f"device = {device!r}: expected cpu, cuda, cuda:N or auto")
    from transformers import AutoConfig

    names = None
    for p in paths:
        if not (Path(p) / "config.json").is_file():
            raise ValueError(
                f"path = {p!r}: no reward model there (a folder with config.json; train one: rlfabric train-rm)"
            )
        config = AutoConfig.from_pretrained(p)
        found = head_names(config.id2label, config.num_labels)
        if names is not None and found != names:
            raise ValueError(f"path: ensemble members disagree on their heads: {names} and {found} ({p})")
        names = found
    missing = sorted(set(heads or []) - set(names or []))
    if missing:
        raise ValueError(f"heads = {list(heads or [])}: {missing} not among the model's heads {names}")


@pointwise
def reward_model_reward(
    inputs: list[RewardInput],
    *,
    path: str | Sequence[str] = "",
    heads: Sequence[str] | None = None,
    batch_size: int = 64,
    max_length: int | None = None,
    device: str = "cpu",
) -> list[dict[str, float]]:
    """Each sample's prompt + completion scored by the model(s) at ``path``; components as the module docstring."""
    texts = [sample.prompt + sample.completion for sample in inputs]
    resolved = resolve_device(device)
    loaded = [load_reward_model(p, resolved) for p in _paths(path)]
    names = loaded[0][2]
    scores = np.stack([score_texts(model, tok, texts, batch_size, max_length) for model, tok, _ in loaded])
    keep = [names.index(h) for h in heads] if heads else list(range(len(names)))
    return ensemble_components(scores[:, :, keep], [names[k] for k in keep])


reward_model_reward.check_kwargs = check_reward_model_kwargs
