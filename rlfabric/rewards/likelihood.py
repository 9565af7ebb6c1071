"""Likelihood rewards: how probable a causal LM finds a text after the prompt and the sampled completion.

    rewards:
      functions:
        - {name: likelihood, kwargs: {target: answer, weights: policy}}           # the current policy, synced
        - {name: likelihood, kwargs: {target: "= {answer}", weights: DIR}}        # a frozen model
        - {name: teacher_logprob, kwargs: {path: DIR}}                            # on-policy distillation

``likelihood`` scores, teacher-forced, a target y = (y_1 .. y_T) after the context c = prompt + completion +
``separator``:

    log p(y | c) = sum_t log pi(y_t | c, y_<t)          reduce: sum
                   (1/T) sum_t log pi(y_t | c, y_<t)    reduce: mean (the default: comparable across lengths)
                   (1/T) sum_t pi(y_t | c, y_<t)        reduce: mean_prob (RLPR's mean token probability)

so reasoning that makes the reference answer likely is rewarded without a verifier: the policy's own likelihood
of the reference answer (VeriFree, Zhou et al. 2025; RLPR, Yu et al. 2025), or a frozen model's (VR-CLI, Gurung &
Lapata 2025). ``improvement: true`` subtracts the same score with the prompt alone as context (c = prompt +
``separator``): VR-CLI's completion likelihood improvement, what the reasoning adds over no reasoning.

``target`` names the metadata key holding the reference text (``answer``), or is a template of metadata keys
(``"The answer is {answer}."``). The context and the target are tokenized separately (no special tokens added)
and concatenated, so the target's tokens are the same whatever the completion ends with; log-probs are taken over
the target's tokens only, at temperature 1. A row longer than the model's context keeps its last tokens (the
target whole, the context cut from the left).

A sample that cannot be scored (its target empty or missing from the metadata, a target that fills the model's
context, an empty context) gets ``Unscored`` with the reason: that sample alone is a recorded failure.

``weights`` says whose log-probs: ``policy``, the current policy's, computed by the run's likelihood scorer actor
(``rlfabric.actors.likelihood_scorer``), which receives every published version like a generator; the score then
carries ``<component>_version``, the policy version that computed it (weight 0 in the scalar reward unless
``rewards.weights`` names it). Or a model folder: frozen weights, loaded once per reward actor. ``teacher_logprob``
is the mean log-prob per token a second, frozen model gives the sampled completion after the prompt.

Both functions are **pointwise**: the reward service hands them every sample of a call at once, batched across
groups (batches of ``batch_size`` rows of similar length, each padded to its longest).
"""

from __future__ import annotations

import math
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlfabric.rewards.registry import RewardInput, Unscored, arguments_with_defaults, pointwise
from rlfabric.rewards.reward_model import check_device, resolve_device

POLICY = "policy"
REDUCTIONS = ("mean", "sum", "mean_prob")
_LOADED: dict[tuple[str, str], tuple[Any, Any]] = {}  # (path, device) -> (model, tokenizer), once per process


# -- the math ---------------------------------------------------------------------------------------------------


def reduce_logprobs(token_logprobs: np.ndarray, reduce: str) -> float:
    """One score from a target's per-token log-probs l_1 .. l_T (T >= 1): ``sum`` sum_t l_t, ``mean``
    (1/T) sum_t l_t, ``mean_prob`` (1/T) sum_t exp(l_t)."""
    values = np.asarray(token_logprobs, np.float64)
    if reduce == "sum":
        return float(values.sum())
    if reduce == "mean":
        return float(values.mean())
    if reduce == "mean_prob":
        return float(np.exp(values).mean())
    raise ValueError(f"reduce = {reduce!r}: expected one of {', '.join(REDUCTIONS)}")


def scoring_row(context: Sequence[int], target: Sequence[int], limit: int | None) -> tuple[list[int], int]:
    """(token ids, index of the first target token): ``context + target``, the context cut from the left so the
    row has at most ``limit`` tokens. The target stays whole, and at least one context token precedes it (the
    position that predicts its first token); ValueError when that cannot be."""
    if not target:
        raise ValueError("the target is empty: nothing to score")
    keep = len(context) if limit is None else min(len(context), limit - len(target))
    if keep < 1:
        why = "the context is empty" if not context else f"the target's {len(target)} tokens fill the {limit}"
        raise ValueError(f"cannot score the target: {why} (the model needs a token before the target's first)")
    row = [*context[len(context) - keep :], *target]
    return row, keep


def target_logprobs(
    model: Any,
    tokenizer: Any,
    contexts: Sequence[str],
    targets: Sequence[str],
    batch_size: int,
    max_length: int | None = None,
) -> list[np.ndarray | Unscored]:
    """Per pair, the target's per-token log-probs [T] given its context, teacher-forced:
    l_t = log softmax(logits at the position before y_t)[y_t]; ``Unscored`` (why, one line) for a pair that
    ``scoring_row`` cannot make a row of, so one bad pair costs only itself.

    Rows are sorted by length and cut into batches of ``batch_size``, each right-padded to its longest (a causal
    model's real positions never see the padding after them); ``max_length`` (default: the model's context,
    ``max_position_embeddings``) bounds a row as ``scoring_row`` says."""
    import torch

    from rlfabric.models.sequences import right_padded

    limit = max_length or getattr(model.config, "max_position_embeddings", None)
    out: list[np.ndarray | Unscored] = []
    encoded: dict[int, tuple[list[int], int]] = {}
    for i, (context, target) in enumerate(zip(contexts, targets, strict=True)):
        try:
            encoded[i] = scoring_row(_ids(tokenizer, context), _ids(tokenizer, target), limit)
            out.append(np.zeros(0, np.float32))
        except ValueError as exc:
            out.append(Unscored(str(exc)))
    order = sorted(encoded, key=lambda i: len(encoded[i][0]))  # stable: equal lengths keep their order
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    with torch.inference_mode():
        for begin in range(0, len(order), batch_size):
            rows = order[begin : begin + batch_size]
            ids, mask = right_padded([encoded[i][0] for i in rows], pad)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            for k, i in enumerate(rows):
                row, start = encoded[i]
                # Only the target's positions go through log_softmax: [T, vocab], not [width, vocab].
                scores = torch.log_softmax(logits[k, start - 1 : len(row) - 1].float(), dim=-1)
                wanted = torch.tensor(row[start:], device=scores.device)
                out[i] = scores.gather(1, wanted[:, None])[:, 0].cpu().numpy()
    return out


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


# -- what is scored ---------------------------------------------------------------------------------------------


def target_text(target: str, metadata: Mapping[str, Any]) -> str:
    """The text to score for one sample: ``metadata[target]``, or ``target`` with its ``{key}`` fields filled
    from the metadata when it has any. ValueError (one line) when this sample's metadata cannot fill it."""
    keys = _template_keys(target)
    missing = [k for k in (keys or [target]) if k not in metadata]
    if missing:
        raise ValueError(
            f"target {target!r} needs metadata[{missing[0]!r}]; this sample's metadata has {sorted(metadata)}"
        )
    if not keys:
        return str(metadata[target])
    try:
        return target.format_map(metadata)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:  # a format spec the value refuses
        raise ValueError(f"target {target!r} cannot be filled from this sample's metadata: {exc}") from None


def _template_keys(target: str) -> list[str]:
    """The field names of a template (``"= {answer}"`` -> ["answer"]); [] for a plain metadata key."""
    return [field for _, field, _, _ in string.Formatter().parse(target) if field is not None]


def likelihood_pairs(
    inputs: Sequence[RewardInput], targets: Sequence[str], separator: str, improvement: bool
) -> tuple[list[str], list[str]]:
    """(contexts, targets) to score, given each sample's target text: prompt + completion + separator per sample,
    then, with ``improvement``, the prompt + separator baselines after them."""
    targets = list(targets)
    contexts = [s.prompt + s.completion + separator for s in inputs]
    if improvement:
        return contexts + [s.prompt + separator for s in inputs], targets + targets
    return contexts, targets


# -- where the weights live -------------------------------------------------------------------------------------


def load_frozen(path: str, device: str) -> tuple[Any, Any]:
    """(model, tokenizer) of the causal LM at ``path``, loaded once per process and kept."""
    key = (str(path), device)
    if key not in _LOADED:
        from rlfabric.models.hf import load_causal_lm, load_tokenizer

        model = load_causal_lm(path, device=device)
        model.requires_grad_(False)
        _LOADED[key] = (model, load_tokenizer(path))
    return _LOADED[key]


def score_with_scorer(
    scorer: str, contexts: list[str], targets: list[str], batch_size: int, max_length: int | None, timeout_s: float
) -> tuple[list[np.ndarray | Unscored], int]:
    """(per-pair token log-probs or ``Unscored``, policy version) from the run's likelihood scorer, the Ray actor
    named ``scorer``, waiting at most ``timeout_s`` per batch of ``batch_size`` pairs. A scorer that is gone or
    missed the deadline raises: the call's groups fail, and the driver replaces the scorer."""
    import ray

    if not scorer:
        raise ValueError(
            "weights = 'policy' needs the run's likelihood scorer, which `rlfabric train` starts for a GRPO run; "
            "outside one, give weights a model folder"
        )
    handle = ray.get_actor(scorer)  # by name on every call: a replaced scorer keeps its name
    deadline = timeout_s * math.ceil(len(contexts) / batch_size)
    logprobs, version = get_or_cancel(handle.score.remote(contexts, targets, batch_size, max_length), deadline)
    return logprobs, int(version)


def get_or_cancel(ref: Any, timeout_s: float) -> Any:
    """``ray.get(ref)`` within ``timeout_s``; past it the call is cancelled, then GetTimeoutError. The scorer
    runs one call at a time: a timed-out call left in its queue would still run and delay every call behind it
    (other reward workers'), which would time out in turn."""
    import ray

    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref)  # a queued call is dropped; a running one is not interrupted
        raise


def _is_model_dir(path: str) -> bool:
    return (Path(path) / "config.json").is_file()


def _check_common(batch_size: Any, max_length: Any, device: Any, component: Any) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size = {batch_size!r}: must be an integer >= 1")
    if max_length is not None and (not isinstance(max_length, int) or max_length < 2):
        raise ValueError(f"max_length = {max_length!r}: must be null or an integer >= 2")
    check_device(device)
    if not isinstance(component, str) or not component:
        raise ValueError(f"component = {component!r}: must be a non-empty component name")


# -- the reward functions ---------------------------------------------------------------------------------------


def check_likelihood_kwargs(**kwargs: Any) -> None:
    """Checked on the driver before any actor starts (``scorer`` is filled in by the driver later); arguments left
    out take ``likelihood_reward``'s defaults."""
    a = arguments_with_defaults(likelihood_reward, kwargs)
    target, weights, separator, reduce = a["target"], a["weights"], a["separator"], a["reduce"]
    improvement, component, batch_size, max_length = a["improvement"], a["component"], a["batch_size"], a["max_length"]
    device, timeout_s, scorer_cpus, scorer_gpus = a["device"], a["timeout_s"], a["scorer_cpus"], a["scorer_gpus"]
    if not isinstance(target, str) or not target:
        raise ValueError(f"target = {target!r}: name a metadata key (answer) or give a template ('= {{answer}}')")
    try:
        keys = _template_keys(target)
    except ValueError as exc:
        raise ValueError(f"target = {target!r}: not a valid template ({exc})") from None
    if not all(key.isidentifier() for key in keys):
        raise ValueError(f"target = {target!r}: a template's fields name metadata keys, as in '= {{answer}}'")
    if not isinstance(weights, str) or not weights or (weights != POLICY and not _is_model_dir(weights)):
        raise ValueError(
            f"weights = {weights!r}: expected 'policy' (the current policy, synced each version) or the folder "
            "of a causal LM (with config.json)"
        )
    if not isinstance(separator, str):
        raise ValueError(f"separator = {separator!r}: must be a string")
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce = {reduce!r}: expected one of {', '.join(REDUCTIONS)}")
    if not isinstance(improvement, bool):
        raise ValueError(f"improvement = {improvement!r}: must be true or false")
    _check_common(batch_size, max_length, device, component)
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s = {timeout_s!r}: must be > 0")
    for name, value in (("scorer_cpus", scorer_cpus), ("scorer_gpus", scorer_gpus)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} = {value!r}: must be a number >= 0")


@pointwise
def likelihood_reward(
    inputs: list[RewardInput],
    *,
    target: str = "answer",
    weights: str = POLICY,
    separator: str = "",
    reduce: str = "mean",
    improvement: bool = False,
    component: str = "likelihood",
    batch_size: int = 16,
    max_length: int | None = None,
    device: str = "cpu",
    timeout_s: float = 60.0,
    scorer: str = "",
    scorer_cpus: float = 0.5,
    scorer_gpus: float = 0.0,
) -> list[dict[str, float] | Unscored]:
    """``component``: each sample's score as the module docstring says; with ``weights: policy`` also
    ``<component>_version``. ``scorer_cpus``/``scorer_gpus`` size the scorer actor (the driver reads them),
    ``device`` places a frozen model in the reward actor, ``timeout_s`` bounds the wait for the scorer per batch."""
    out: list[dict[str, float] | Unscored] = [{} for _ in inputs]  # each sample's entry is set below
    texts: dict[int, str] = {}  # the samples whose target could be filled in
    for i, s in enumerate(inputs):
        try:
            texts[i] = target_text(target, s.metadata)
        except ValueError as exc:
            out[i] = Unscored(str(exc))
    kept = list(texts)
    if not kept:
        return out
    contexts, targets = likelihood_pairs([inputs[i] for i in kept], list(texts.values()), separator, improvement)
    version = None
    if weights == POLICY:
        logprobs, version = score_with_scorer(scorer, contexts, targets, batch_size, max_length, timeout_s)
    else:
        model, tokenizer = load_frozen(weights, resolve_device(device))
        logprobs = target_logprobs(model, tokenizer, contexts, targets, batch_size, max_length)
    n = len(kept)
    for k, i in enumerate(kept):
        with_it = logprobs[k]
        without = logprobs[n + k] if improvement else None  # the same target with no completion before it
        if isinstance(with_it, Unscored):
            out[i] = with_it
        elif isinstance(without, Unscored):
            out[i] = Unscored(f"with the prompt alone as context (improvement): {without.error}")
        else:
            score = reduce_logprobs(with_it, reduce)
            if without is not None:  # what the reasoning adds
                score -= reduce_logprobs(without, reduce)
            out[i] = {component: score}
            if version is not None:
                out[i][f"{component}_version"] = float(version)
    return out


likelihood_reward.check_kwargs = check_likelihood_kwargs


def check_teacher_kwargs(
    path: str = "",
    component: str = "teacher_logprob",
    batch_size: int = 16,
    max_length: int | None = None,
    device: str = "cpu",
) -> None:
    """Checked on the driver before any actor starts: ``path`` a causal LM's folder."""
    if not isinstance(path, str) or not path or not _is_model_dir(path):
        raise ValueError(f"path = {path!r}: give the folder of the teacher, a causal LM (with config.json)")
    _check_common(batch_size, max_length, device, component)


@pointwise
def teacher_logprob_reward(
    inputs: list[RewardInput],
    *,
    path: str = "",
    component: str = "teacher_logprob",
    batch_size: int = 16,
    max_length: int | None = None,
    device: str = "cpu",
) -> list[dict[str, float] | Unscored]:
    """``component``: the mean log-prob per token that the teacher at ``path`` gives each sample's completion
    after its prompt, (1/T) sum_t log pi_teacher(y_t | prompt, y_<t), y the completion re-tokenized by the
    teacher's tokenizer. An empty completion scores 0 (nothing to distill); a completion that does not fit the
    teacher's context after a prompt token (or follows an empty prompt) is ``Unscored``."""
    model, tokenizer = load_frozen(path, resolve_device(device))
    scored = [i for i, s in enumerate(inputs) if s.completion]
    logprobs = target_logprobs(
        model,
        tokenizer,
        [inputs[i].prompt for i in scored],
        [inputs[i].completion for i in scored],
        batch_size,
        max_length,
    )
    out: list[dict[str, float] | Unscored] = [{component: 0.0} for _ in inputs]
    for i, lp in zip(scored, logprobs, strict=True):
        if isinstance(lp, Unscored):
            out[i] = Unscored(f"the completion as the teacher's target: {lp.error}")
        else:
            out[i] = {component: reduce_logprobs(lp, "mean")}
    return out


teacher_logprob_reward.check_kwargs = check_teacher_kwargs
