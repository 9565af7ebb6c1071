"""LLM judges as a reward service: a causal LM on its own generator actors scores completions against a rubric
(registered as the built-in reward ``judge``).

    rewards:
      functions:
        - name: judge
          kwargs: {model: DIR, mode: listwise, criteria: {answer: the sum is right}, num_generators: 2}

The judge's generators are ``rlfabric.actors.generator.Generator`` actors (the torch engine; the policy's own
kind), started by the reward actor that first calls the judge and kept for its life: a pool of
``num_generators`` per reward worker, sized apart from the policy's generators. Prompts and verdicts are
``rlfabric.rewards.judge_format``'s: pointwise (one call per completion), pairwise (win rates over comparisons)
and listwise (the whole group in one call); a group of one sample (held-out evaluation) is judged pointwise in
every mode. Components are ``<prefix>_<criterion>`` (``judge_answer``) in
[0, 1].

Failures cost only their samples. A verdict that does not parse is asked again, up to ``retries`` more times, at
``retry_temperature`` (the first try is at ``temperature``, 0 = greedy); a sample still without a verdict is
``Unscored`` (recorded as failed, its error quoting what the judge wrote). A judge generator that dies or misses
``timeout_s`` (one deadline per call) is killed and started again; the prompts it held count as unparsed for that
try. Keep ``timeout_s`` x (``retries`` + 1) under ``rewards.timeout_s``, the reward worker's deadline per group. A
prompt too long for the judge's context fails its samples at once (``NoRoom``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfabric.actor_slots import error_summary
from rlfabric.rewards.judge_format import (
    MODES,
    Rubric,
    comparison_pairs,
    listwise_prompt,
    make_rubric,
    pairwise_prompt,
    parse_listwise,
    parse_pairwise,
    parse_scores,
    pointwise_prompt,
    win_rates,
)
from rlfabric.rewards.registry import RewardInput, Unscored, arguments_with_defaults

JUDGE_CPUS = 0.5  # what one judge generator asks Ray for, unless num_cpus says otherwise
# A judge call's deadline: with its retries, under the reward worker's deadline per group (rewards.timeout_s, 30 s),
# so a stuck judge generator is replaced by the judge, not by killing the reward worker and its judge pool.
JUDGE_TIMEOUT_S = 20.0
_POOLS: dict[tuple[Any, ...], JudgeGenerators] = {}
_POOLS_LOCK = threading.Lock()


@dataclass(frozen=True)
class NoRoom:
    """A judge prompt too long for the judge's context: its samples fail with ``error``, without a try."""

    error: str


@dataclass
class JudgeStats:
    """What this process's judges asked of their generators (the benchmark reads it)."""

    calls: int = 0  # judge prompts sent (retries included)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    restarts: int = 0  # judge generators started again after dying or missing their deadline
    unparsed: int = 0  # answers that did not parse (each retry counts)


class JudgeGenerators:
    """``num_generators`` generator actors serving the judge model, started in this process."""

    def __init__(self, model: str, num_generators: int, num_cpus: float, timeout_s: float, seed: int) -> None:
        from rlfabric.models.hf import load_tokenizer, model_max_positions

        self.model, self.num_cpus, self.timeout_s, self.seed = model, num_cpus, timeout_s, seed
        self.tokenizer = load_tokenizer(model)
        self.max_positions = model_max_positions(model)
        self.stats = JudgeStats()
        self.lock = threading.Lock()  # groups of one reward worker are judged one at a time; keep it so
        self.actors = [self._start(k) for k in range(num_generators)]

    def _start(self, k: int) -> Any:
        from rlfabric.actors.generator import Generator

        options = {"max_batch_size": 256, "device": "cpu", "seed": self.seed + k}
        return Generator.options(num_cpus=self.num_cpus).remote("torch", self.model, options, num_threads=1)

    def generate(self, prompts: Sequence[str], params: dict[str, Any]) -> list[str | NoRoom | None]:
        """The judge's answer to each prompt; ``NoRoom`` for a prompt that leaves no room for a verdict in the
        judge's context (not sent); None where its generator died or missed the call's deadline (that generator is
        started again). New tokens are capped to what the context leaves after the longest prompt sent; a request
        the engine refuses is a ValueError (its group fails)."""
        import ray

        ids = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        out: list[str | NoRoom | None] = [None] * len(prompts)
        sent = list(range(len(ids)))
        if self.max_positions is not None:
            for i in [i for i in sent if len(ids[i]) >= self.max_positions]:
                out[i] = NoRoom(
                    f"a judge prompt of {len(ids[i])} tokens leaves no room for a verdict in the judge's "
                    f"{self.max_positions} positions"
                )
            sent = [i for i in sent if out[i] is None]
            if not sent:
                return out
            room = self.max_positions - max(len(ids[i]) for i in sent)
            params = {**params, "max_new_tokens": min(params["max_new_tokens"], room)}
        shares = [sent[k :: len(self.actors)] for k in range(len(self.actors))]
        with self.lock:
            deadline = time.monotonic() + self.timeout_s  # one deadline for the call, however many generators
            calls = [
                (k, share, self.actors[k].generate.remote([ids[i] for i in share], params))
                for k, share in enumerate(shares)
                if share
            ]
            for k, share, ref in calls:
                try:
                    completions = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                except ray.exceptions.RayTaskError as exc:  # the engine refused the request: the process is fine
                    raise ValueError(f"the judge's generator refused the request: {error_summary(exc)}") from None
                except (ray.exceptions.RayError, TimeoutError):
                    ray.kill(self.actors[k], no_restart=True)
                    self.actors[k] = self._start(k)
                    self.stats.restarts += 1
                    continue
                for i, completion in zip(share, completions, strict=True):
                    out[i] = completion["text"]
                    self.stats.generated_tokens += len(completion["token_ids"])
            self.stats.calls += len(sent)
            self.stats.prompt_tokens += sum(len(ids[i]) for i in sent)
        return out


def judge_generators(model: str, num_generators: int, num_cpus: float, timeout_s: float, seed: int) -> JudgeGenerators:
    """This process's pool for these settings, started on first use."""
    key = (str(Path(model).resolve()), num_generators, num_cpus, timeout_s, seed)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = JudgeGenerators(model, num_generators, num_cpus, timeout_s, seed)
        return _POOLS[key]


def judge_stats() -> JudgeStats:
    """The sum of this process's judge pools' counters."""
    total = JudgeStats()
    for pool in _POOLS.values():
        for name in vars(total):
            setattr(total, name, getattr(total, name) + getattr(pool.stats, name))
    return total


@dataclass
class _Asks:
    """Judge prompts still waiting for an answer that parses: prompt -> what to do with the parse."""

    prompts: list[str]
    parse: Any  # answer text -> parsed value or None
    results: list[Any] = field(default_factory=list)
    last_answers: list[str | NoRoom | None] = field(default_factory=list)


def ask_with_retries(
    pool: JudgeGenerators, asks: _Asks, params: dict[str, Any], retries: int, retry_temperature: float
) -> None:
    """Ask every prompt; ask again (at ``retry_temperature``) those whose answer did not parse, ``retries``
    times at most. ``asks.results`` holds each parse (None: none after every try)."""
    n = len(asks.prompts)
    asks.results, asks.last_answers = [None] * n, [None] * n
    pending = list(range(n))
    for attempt in range(retries + 1):
        if not pending:
            break
        try_params = params if attempt == 0 else {**params, "temperature": retry_temperature}
        answers = pool.generate([asks.prompts[i] for i in pending], try_params)
        still = []
        for i, answer in zip(pending, answers, strict=True):
            if isinstance(answer, NoRoom):  # asking again cannot help
                asks.last_answers[i] = answer
                continue
            parsed = asks.parse(answer) if answer is not None else None
            asks.last_answers[i] = answer if answer is not None else asks.last_answers[i]
            if parsed is None:
                still.append(i)
                pool.stats.unparsed += 1
            else:
                asks.results[i] = parsed
        pending = still


def _failure(answer: str | NoRoom | None, tries: int) -> Unscored:
    if isinstance(answer, NoRoom):
        return Unscored(answer.error)
    said = "no answer (its generator failed)" if answer is None else f"it wrote {answer[:60]!r}"
    return Unscored(f"no verdict that parses after {tries} tries; {said}")


def judge_group(
    inputs: Sequence[RewardInput],
    pool: JudgeGenerators,
    rubric: Rubric,
    mode: str,
    params: dict[str, Any],
    retries: int,
    retry_temperature: float,
    opponents: int | None,
) -> list[dict[str, float] | Unscored]:
    """Per sample, {criterion: score in [0, 1]} or ``Unscored``."""
    tries = retries + 1
    if mode == "pointwise" or len(inputs) == 1:  # a lone sample (held-out evaluation) has nothing to compare
        asks = _Asks(
            [pointwise_prompt(s.prompt, s.completion, rubric) for s in inputs], lambda a: parse_scores(a, rubric)
        )
        ask_with_retries(pool, asks, params, retries, retry_temperature)
        return [
            r if r is not None else _failure(a, tries) for r, a in zip(asks.results, asks.last_answers, strict=True)
        ]
    if mode == "pairwise":
        pairs = comparison_pairs(len(inputs), opponents)
        prompt = inputs[0].prompt
        asks = _Asks(
            [pairwise_prompt(prompt, inputs[a].completion, inputs[b].completion, rubric) for a, b in pairs],
            lambda a: parse_pairwise(a, rubric),
        )
        ask_with_retries(pool, asks, params, retries, retry_temperature)
        rates = win_rates(len(inputs), pairs, asks.results, rubric)
        failed = next((a for r, a in zip(asks.results, asks.last_answers, strict=True) if r is None), None)
        return [r if r is not None else _failure(failed, tries) for r in rates]
    # listwise: one prompt for the group; what a try leaves unread is asked again in the next whole-group call
    scores: list[dict[str, float] | None] = [None] * len(inputs)
    answer: str | NoRoom | None = None
    text = listwise_prompt(inputs[0].prompt, [s.completion for s in inputs], rubric)
    for attempt in range(tries):
        try_params = params if attempt == 0 else {**params, "temperature": retry_temperature}
        answer = pool.generate([text], try_params)[0]
        if isinstance(answer, NoRoom):
            break
        parsed = parse_listwise(answer, len(inputs), rubric) if answer is not None else [None] * len(inputs)
        scores = [s if s is not None else p for s, p in zip(scores, parsed, strict=True)]
        if all(s is not None for s in scores):
            break
        pool.stats.unparsed += 1
    return [s if s is not None else _failure(answer, tries) for s in scores]


def verdict_tokens(rubric: Rubric, mode: str, group_size: int) -> int:
    """Enough new tokens for a verdict (characters of a character model; more tokens than a BPE model needs):
    ``name=v`` per criterion, and a ``k) `` line per candidate in listwise mode, plus slack."""
    one = sum(len(c) + 4 for c in rubric.criteria)
    return one * group_size + 5 * group_size + 8 if mode == "listwise" else one + 8


def judge_reward(
    inputs: list[RewardInput],
    model: str = "",
    mode: str = "pointwise",
    criteria: Sequence[str] | Mapping[str, str] = ("quality",),
    scale: int = 1,
    prefix: str = "judge",
    opponents: int | None = None,
    retries: int = 2,
    temperature: float = 0.0,
    retry_temperature: float = 1.0,
    max_new_tokens: int | None = None,
    num_generators: int = 1,
    num_cpus: float = JUDGE_CPUS,
    timeout_s: float = JUDGE_TIMEOUT_S,
    seed: int = 0,
) -> list[dict[str, float] | Unscored]:
    """Score one group with an LLM judge (module docstring); components ``<prefix>_<criterion>``."""
    if not inputs:
        return []
    rubric = make_rubric(criteria, scale)
    pool = judge_generators(model, num_generators, num_cpus, timeout_s, seed)
    budget = max_new_tokens or verdict_tokens(rubric, mode, len(inputs))
    params = {"max_new_tokens": budget, "temperature": temperature}
    verdicts = judge_group(inputs, pool, rubric, mode, params, retries, retry_temperature, opponents)
    return [
        v if isinstance(v, Unscored) else {component_name(prefix, c): score for c, score in v.items()} for v in verdicts
    ]


def component_name(prefix: str, criterion: str) -> str:
    """``judge`` + ``answer`` -> ``judge_answer``; no prefix: the criterion itself."""
    return f"{prefix}_{criterion}" if prefix else criterion


def model_architectures(folder: str) -> list[str]:
    """The ``architectures`` a Hugging Face folder's config.json names ([] when it names none or is unreadable)."""
    try:
        found = json.loads(Path(folder, "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return []
    return [str(a) for a in found] if isinstance(found, list) else []


def check_judge_kwargs(**kwargs: Any) -> None:
    """ValueError naming the first bad argument of ``judge_reward`` (the registry turns it into a ConfigError
    naming the spec); arguments left out take the function's defaults."""
    a = arguments_with_defaults(judge_reward, kwargs)
    model = a["model"]
    if not model or not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model = {model!r}: must be a Hugging Face causal-LM folder (with config.json)")
    if any(arch.endswith("ForSequenceClassification") for arch in model_architectures(model)):
        raise ValueError(
            f"model = {model!r}: a sequence-classification model (a classifier reward model), which cannot write "
            "verdicts: serve it with {name: reward_model, kwargs: {path: ...}}, or give the judge a causal LM"
        )
    if a["mode"] not in MODES:
        raise ValueError(f"mode = {a['mode']!r}: must be one of {', '.join(MODES)}")
    make_rubric(a["criteria"], a["scale"])
    for name, ok, allowed in _NUMBER_CHECKS:
        if not ok(a[name]):
            raise ValueError(f"{name} = {a[name]!r}: must be {allowed}")
    if not isinstance(a["prefix"], str):
        raise ValueError(f"prefix = {a['prefix']!r}: must be a string ('' for the criteria's own names)")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float))


def _integer(value: Any) -> bool:
    return isinstance(value, int)


# (argument, test, what is allowed) of judge_reward's numeric arguments
_NUMBER_CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("opponents", lambda v: v is None or (_integer(v) and v >= 1), ">= 1 or null"),
    ("retries", lambda v: _integer(v) and v >= 0, "an integer >= 0"),
    ("temperature", lambda v: _number(v) and v >= 0, ">= 0"),
    ("retry_temperature", lambda v: _number(v) and v > 0, "> 0"),
    ("max_new_tokens", lambda v: v is None or (_integer(v) and v >= 1), ">= 1 or null"),
    ("num_generators", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("num_cpus", lambda v: _number(v) and v > 0, "> 0"),
    ("timeout_s", lambda v: _number(v) and v > 0, "> 0"),
)


judge_reward.check_kwargs = check_judge_kwargs  # type: ignore[attr-defined]
