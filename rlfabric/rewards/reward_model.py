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
across groups, so the forward passes are batched across groups. The completions of a prompt that recurs (a GRPO
group's) are scored behind one copy of it: prompt and completions in one packed row, each completion seeing its
prompt and itself at the positions it has after the prompt (``rlfabric.models.prefix_packing``), the ``score``
head on each completion's last token, which gives the scores of prompt + completion alone. That happens where it
is exact (the prompt and the completion tokenized apart give the joined text's tokens, no ``max_length`` cut) and
costs the model fewer FLOPs than the samples alone; the other samples are sorted by length and cut into batches of
``batch_size`` (less padding than batches in arrival order). All under ``torch.inference_mode``. Models load once
per process (the reward actor) and stay loaded; ``device: auto`` takes the GPU when there is one.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rlfabric.rewards.registry import RewardInput, pointwise

if TYPE_CHECKING:
    from rlfabric.models.prefix_packing import SharedPrefixPack

UNNAMED_HEAD = "reward"
_LOADED: dict[tuple[str, str], tuple[Any, Any, list[str]]] = {}  # (path, device) -> (model, tokenizer, heads)


def head_names(id2label: dict[Any, str] | None, num_labels: int) -> list[str]:
    """The component name of each output: ``id2label``'s labels in index order; transformers' placeholder names
    (``LABEL_0``...) of a single head become ``reward``, of several stay as they are."""
    labels = [str((id2label or {}).get(i, (id2label or {}).get(str(i), f"LABEL_{i}"))) for i in range(num_labels)]
    if num_labels == 1 and labels[0] == "LABEL_0":
        return [UNNAMED_HEAD]
    return labels


def check_device(device: Any) -> None:
    """ValueError unless ``device`` is cpu, cuda, cuda:N or auto (the model-backed rewards' ``device``)."""
    if device not in ("cpu", "cuda", "auto") and not str(device).startswith("cuda:"):
        raise ValueError(f"device = {device!r}: expected cpu, cuda, cuda:N or auto")


def resolve_device(device: str) -> str:
    """``auto``: the GPU when this process has one, else the CPU; any other device as it is."""
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


def token_rows(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Each text's token ids, no special tokens added."""
    if not texts:
        return []
    return [list(row) for row in tokenizer(list(texts), add_special_tokens=False).input_ids]


def score_token_rows(model: Any, rows: Sequence[Sequence[int]], batch_size: int) -> np.ndarray:
    """[N, H] float32: the model's outputs for each row of token ids, in the rows' order. Batches of
    ``batch_size`` rows of similar length (sorted by token count), each right-padded to its longest, under
    ``torch.inference_mode``."""
    import torch

    from rlfabric.models.sequences import right_padded

    order = np.argsort([len(row) for row in rows], kind="stable")
    out = np.zeros((len(rows), model.config.num_labels), np.float32)
    pad = model.config.pad_token_id
    device = next(model.parameters()).device
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            picked = order[start : start + batch_size]
            batch, mask = right_padded([rows[i] for i in picked], pad)
            logits = model(input_ids=batch.to(device), attention_mask=mask.to(device)).logits
            out[picked] = logits.float().cpu().numpy()
    return out


def score_texts(
    model: Any, tokenizer: Any, texts: Sequence[str], batch_size: int, max_length: int | None
) -> np.ndarray:
    """[N, H] float32: the model's outputs for each text, in the texts' order (``score_token_rows``); texts
    longer than ``max_length`` tokens keep their last ``max_length`` (the completion is at the end)."""
    ids = token_rows(tokenizer, texts)
    if max_length is not None:
        ids = [row[-max_length:] for row in ids]
    return score_token_rows(model, ids, batch_size)


def shares_prompts(model: Any) -> bool:
    """Whether the model can score completions behind one shared copy of their prompt: a ``score`` head on the
    last hidden state of its base model (Hugging Face's ``*ForSequenceClassification`` of decoder models), whose
    attention takes the shared-prefix mask."""
    import torch

    from rlfabric.models.prefix_packing import maskable

    head, base = getattr(model, "score", None), getattr(model, model.base_model_prefix, None)
    return isinstance(head, torch.nn.Module) and isinstance(base, torch.nn.Module) and maskable(model)


def splits_exactly(
    prompt: Sequence[int], completion: Sequence[int], joined: Sequence[int], pad_id: int | None, max_length: int | None
) -> bool:
    """Whether a sample scores the same behind a shared prompt as alone: the completion is not empty, prompt
    tokens + completion tokens = the joined text's tokens (a tokenizer may merge across the seam), no
    ``max_length`` cut, and the last token is not the pad id (the model pools the last non-pad token)."""
    return (
        len(completion) > 0
        and len(prompt) + len(completion) == len(joined)
        and (max_length is None or len(joined) <= max_length)
        and joined[-1] != pad_id
        and list(prompt) == list(joined[: len(prompt)])
        and list(completion) == list(joined[len(prompt) :])
    )


def prompt_chunks(keys: Sequence[str], lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices of ``keys`` (prompt texts) cut into chunks of at most ``batch_size``: the samples of each prompt
    that appears more than once, prompts ordered by ``lengths`` (token counts, so a chunk's blocks are of about
    one length) and each prompt's samples together (a prompt may straddle two chunks). Prompts seen once are left
    out: nothing to share."""
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    shared = sorted((g for g in groups.values() if len(g) > 1), key=lambda g: lengths[g[0]])
    flat = [i for g in shared for i in g]
    return [flat[start : start + batch_size] for start in range(0, len(flat), batch_size)]


def plain_row_flops(lengths: Sequence[int], hidden: int, parameters_per_layer: float) -> float:
    """Per-layer FLOPs of scoring rows of these lengths one per sample, without padding (``layer_flops``): a lower
    bound of the length-sorted batches' cost, so sharing must beat the plain path at its best."""
    from rlfabric.models.prefix_packing import layer_flops

    return layer_flops(list(lengths), hidden, parameters_per_layer)


def cheapest_shared_pack(
    model: Any, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
) -> SharedPrefixPack | None:
    """The shared-prefix pack (``rlfabric.models.prefix_packing``) of prompt + completion rows that costs the
    fewest FLOPs per layer (``layer_flops`` of its padded packed rows), over the row budgets d 2^k (d the hidden
    size) and each block's length; None when none beats scoring each row alone (``plain_row_flops``)."""
    from rlfabric.models.packed_batch import pack_sequences
    from rlfabric.models.prefix_packing import (
        balanced_rows,
        layer_flops,
        pack_shared_prefix,
        prefix_blocks,
        projection_parameters_per_layer,
    )

    hidden, parameters = int(model.config.hidden_size), projection_parameters_per_layer(model)
    rows = [(tuple(p), list(c)) for p, c in zip(prompts, completions, strict=True)]
    whole = prefix_blocks(rows, max_tokens=sum(len(p) + len(c) for p, c in rows))
    sizes = [len(prompt) + sum(len(rows[i][1]) for i in members) for prompt, members in whole]
    budgets = sorted({hidden * 2**k for k in range(8) if hidden * 2 ** (k - 1) < max(sizes)} | set(sizes))
    best, best_cost = None, plain_row_flops([len(p) + len(c) for p, c in rows], hidden, parameters)
    for budget in budgets:
        blocks = prefix_blocks(rows, budget)
        block_sizes = [len(prompt) + sum(len(rows[i][1]) for i in members) for prompt, members in blocks]
        placed = balanced_rows(block_sizes, budget)
        length = max(sum(block_sizes[b] for b in row) for row in placed)
        cost = layer_flops([length] * len(placed), hidden, parameters)
        if cost < best_cost:
            best, best_cost = budget, cost
    if best is None:
        return None
    batch = pack_sequences(prompts, completions, int(model.config.pad_token_id or 0))
    return pack_shared_prefix(
        batch["input_ids"], batch["attention_mask"], int(batch["prompt_len"]), best, feed_last=True
    )


def score_shared_pack(model: Any, pack: SharedPrefixPack) -> np.ndarray:
    """[N, H] float32: the ``score`` head on each completion's last token in the packed rows, where a token sees
    its prompt and the earlier tokens of its own completion, at the positions it has in prompt + completion
    alone: the score of prompt + completion as one row."""
    from rlfabric.models.prefix_packing import response_ends

    return score_pack_positions(model, pack, response_ends(pack))


def score_pack_positions(model: Any, pack: SharedPrefixPack, positions: np.ndarray) -> np.ndarray:
    """[len(positions), H] float32: the ``score`` head on the hidden states at ``positions`` (flat indices into
    the packed rows), each the score of the text up to and including that token (``score_shared_pack``)."""
    import torch

    from rlfabric.models.prefix_packing import attention_mask_for, shared_prefix_attention

    device = next(model.parameters()).device
    as_tensor = lambda values: torch.from_numpy(values).to(device)  # noqa: E731
    allowed = shared_prefix_attention(as_tensor(pack.segment_ids), as_tensor(pack.prefix_ids))
    with torch.inference_mode():
        hidden = getattr(model, model.base_model_prefix)(
            input_ids=as_tensor(pack.input_ids),
            attention_mask=attention_mask_for(model, allowed),
            position_ids=as_tensor(pack.position_ids),
            use_cache=False,
        ).last_hidden_state
        picked = hidden.reshape(-1, hidden.shape[-1])[as_tensor(np.asarray(positions, np.int64))]
        return model.score(picked).float().cpu().numpy()


def score_samples(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    completions: Sequence[str],
    batch_size: int,
    max_length: int | None,
) -> np.ndarray:
    """[N, H] float32: each prompt + completion scored as ``score_texts`` scores it, with the completions of a
    prompt that recurs (a GRPO group's) scored behind one copy of it where that is exact (``splits_exactly``) and
    costs fewer FLOPs (``cheapest_shared_pack``): ``batch_size`` completions per packed forward, prompts of about
    one length together. The other samples take the length-sorted batches."""
    texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    joined = token_rows(tokenizer, texts)
    out = np.zeros((len(texts), model.config.num_labels), np.float32)
    shared: set[int] = set()
    counts = Counter(prompts)
    repeated = [i for i, p in enumerate(prompts) if counts[p] > 1] if shares_prompts(model) else []
    if repeated:
        unique = sorted({prompts[i] for i in repeated})
        prompt_ids = dict(zip(unique, token_rows(tokenizer, unique), strict=True))
        completion_ids = dict(zip(repeated, token_rows(tokenizer, [completions[i] for i in repeated]), strict=True))
        pad = model.config.pad_token_id
        exact = [
            i for i in repeated if splits_exactly(prompt_ids[prompts[i]], completion_ids[i], joined[i], pad, max_length)
        ]
        keys, lengths = [prompts[i] for i in exact], [len(prompt_ids[prompts[i]]) for i in exact]
        for chunk in prompt_chunks(keys, lengths, batch_size):
            members = [exact[k] for k in chunk]
            pack = cheapest_shared_pack(
                model, [prompt_ids[prompts[i]] for i in members], [completion_ids[i] for i in members]
            )
            if pack is not None:
                out[members] = score_shared_pack(model, pack)
                shared.update(members)
    rest = [i for i in range(len(texts)) if i not in shared]
    rows = [joined[i] if max_length is None else joined[i][-max_length:] for i in rest]
    if rest:
        out[rest] = score_token_rows(model, rows, batch_size)
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


def model_paths(path: str | Sequence[str]) -> list[str]:
    """A ``path`` kwarg as a list of folders: one folder, or an ensemble's."""
    return [path] if isinstance(path, (str, os.PathLike)) else [str(p) for p in path]


def check_reward_model_kwargs(
    path: str | Sequence[str] = "",
    heads: Sequence[str] | None = None,
    batch_size: int = 64,
    max_length: int | None = None,
    device: str = "cpu",
) -> None:
    """Checked on the driver before any actor starts: every path a model folder whose heads include ``heads``."""
    paths = model_paths(path)
    if not paths or not all(paths):
        raise ValueError(
            "path: give the folder of a sequence-classification model (or a list of them: an ensemble), "
            "or set reward_model.pairs to train one in this run"
        )
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size = {batch_size!r}: must be an integer >= 1")
    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length = {max_length!r}: must be null or an integer >= 1")
    check_device(device)
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
    prompts, completions = [s.prompt for s in inputs], [s.completion for s in inputs]
    resolved = resolve_device(device)
    loaded = [load_reward_model(p, resolved) for p in model_paths(path)]
    names = loaded[0][2]
    scores = np.stack(
        [score_samples(model, tok, prompts, completions, batch_size, max_length) for model, tok, _ in loaded]
    )
    keep = [names.index(h) for h in heads] if heads else list(range(len(names)))
    return ensemble_components(scores[:, :, keep], [names[k] for k in keep])


reward_model_reward.check_kwargs = check_reward_model_kwargs
