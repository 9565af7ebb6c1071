"""The supervised warm-up's batches (``sft``): each row's demonstration after its prompt, or with a text env or an
outside agent a scripted player's episodes on the rows' tasks (``rlfabric.llm_text_env.Demonstrations``,
``rlfabric.agent_rollout.AgentDemonstrations``), played for every batch or once into a ``DemonstrationPool``."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from rlfabric.agent_rollout import AgentDemonstrations
from rlfabric.config import ConfigError
from rlfabric.data import TASK_PREFIX
from rlfabric.grpo_config import LLMConfig
from rlfabric.llm_text_env import Demonstrations, rows_spelling_error
from rlfabric.models.chat_tokens import UnspellableText, spelled
from rlfabric.models.packed_batch import pack_sequences, pack_trajectories
from rlfabric.trajectory import Trajectories, concat


def sft_batch(
    cfg: LLMConfig,
    tokenizer: Any,
    rows: list[dict[str, Any]],
    prompt_ids: list[list[int]],
    indices: list[int],
    rng: np.random.Generator,
    demonstrations: Demonstrations | AgentDemonstrations | None,
) -> dict[str, np.ndarray]:
    """The SFT batch of the rows ``indices``: their ``sft.answer_key`` demonstration (one at random from a list)
    after their prompt, closed with EOS; or, on a text env or an agent, the scripted player's episodes on them."""
    pad_id = tokenizer.pad_token_id
    if demonstrations is not None:
        return demonstrations.batch([rows[i] for i in indices])
    key = cfg.sft.answer_key
    answers = []
    for i in indices:
        if key not in rows[i]:  # rows read before Ray were checked there (check_answer_column); this is for others
            raise missing_answer_column(key, "data.train", f"train row {i}", list(rows[i]))
        text = pick_demonstration(rows[i][key], rng)
        answers.append(list(tokenizer(text, add_special_tokens=False).input_ids) + [tokenizer.eos_token_id])
    return pack_sequences([prompt_ids[i] for i in indices], answers, pad_id)


def missing_answer_column(key: str, source: str, where: str, columns: list[str]) -> ConfigError:
    """The warm-up's demonstrations are ``sft.answer_key``'s column, which ``where`` (of ``source``) lacks."""
    return ConfigError(
        f"sft.answer_key = {key!r} is not valid for {source}: {where} has no such column (its columns are "
        f"{', '.join(map(repr, columns))}): set sft.answer_key to the one holding the target completion, or "
        "sft.steps: 0 for no supervised warm-up"
    )


def check_answer_column(cfg: LLMConfig, spec: str, rows: list[dict[str, Any]]) -> None:
    """Before Ray: the rows of ``data.train`` (``spec``) hold a demonstration under ``sft.answer_key``, every one
    of them (a file row with null there would teach the text "None")."""
    key = cfg.sft.answer_key
    if rows and key not in rows[0]:  # a file's rows share their columns, as a task's do
        where = "row 0" if spec.startswith(TASK_PREFIX) else "the file"
        raise missing_answer_column(key, f"data.train = {spec!r}", where, list(rows[0]))
    for i, row in enumerate(rows):
        value = row.get(key)
        if value is None or (_is_list(value) and len(value) == 0):
            raise ConfigError(
                f"sft.answer_key = {key!r} is not valid for data.train = {spec!r}: row {i}'s {key!r} is "
                f"{'empty' if value is not None else 'null or missing'}, and every training row needs a demonstration "
                "there: fill it in, drop the row, or sft.steps: 0 for no supervised warm-up"
            )


def demonstration_texts(value: Any) -> list[str]:
    """Every demonstration a row's ``sft.answer_key`` value holds (``pick_demonstration`` picks one of them)."""
    if _is_list(value) and len(value) > 0:
        return [str(v) for v in value]
    return [str(value)]


def check_answer_spelling(cfg: LLMConfig, tokenizer: Any, spec: str, rows: list[dict[str, Any]]) -> None:
    """Before Ray: the tokenizer spells every demonstration of ``data.train`` (``spec``); else one ConfigError
    naming the characters, the rows and ``model.builtin.alphabet``."""
    key, failed = cfg.sft.answer_key, []
    try:  # all at once (the common case, fast); on a failure, row by row to name the rows
        tokenizer([t for row in rows for t in demonstration_texts(row[key])], add_special_tokens=False)
        return
    except Exception:  # noqa: BLE001 - the loop below names what failed, or raises the tokenizer's own error
        pass
    for i, row in enumerate(rows):
        for text in demonstration_texts(row[key]):
            try:
                spelled(tokenizer, text, partial(tokenizer, text, add_special_tokens=False))
            except UnspellableText as exc:
                failed.append((f"row {i}", exc))
                break
    if failed:
        raise rows_spelling_error(cfg, f"data.train = {spec!r}", key, failed)


def _is_list(value: Any) -> bool:
    """Whether a row's ``sft.answer_key`` value holds several demonstrations."""
    return isinstance(value, (list, tuple, np.ndarray))


def pick_demonstration(value: Any, rng: np.random.Generator) -> str:
    """A row's target completion; a list holds several demonstrations, one picked at random per use."""
    if _is_list(value) and len(value) > 0:
        return str(value[int(rng.integers(len(value)))])
    return str(value)


class DemonstrationPool:
    """The scripted player's episodes played once (``sft.demonstrations`` of them, on train rows drawn at random);
    each warm-up batch is ``batch_size`` of them, in passes over a shuffled order. A deterministic player on a
    deterministic env gives the same episode every time it plays a task, so the warm-up trains on the same
    distribution as fresh play at a fraction of the env's and tools' work; a player with random slips keeps the
    slips it made here."""

    def __init__(self, trajectories: Trajectories, pad_id: int, rng: np.random.Generator) -> None:
        self.trajectories, self.pad_id, self.rng = trajectories, pad_id, rng
        self.order: list[int] = []

    @classmethod
    def play(
        cls,
        demonstrations: Demonstrations | AgentDemonstrations,
        tasks: list[dict[str, Any]],
        chunk: int,
        pad_id: int,
        rng: np.random.Generator,
        note: Callable[[str], None],
    ) -> DemonstrationPool:
        """Play ``tasks`` ``chunk`` at a time (a warm-up batch's concurrency), noting progress every tenth."""
        started, parts, shown = time.monotonic(), [], 0
        for first in range(0, len(tasks), chunk):
            parts.append(demonstrations.trajectories(tasks[first : first + chunk]))
            done = min(first + chunk, len(tasks))
            if done * 10 // len(tasks) > shown or done == len(tasks):
                shown = done * 10 // len(tasks)
                note(f"sft.demonstrations: {done}/{len(tasks)} episodes played ({time.monotonic() - started:.1f} s)")
        pool = concat(parts)
        if pool.num_rows < len(tasks):
            note(f"sft.demonstrations: {len(tasks) - pool.num_rows} of {len(tasks)} episodes failed, left out")
        if pool.num_rows < chunk:  # found once, before the warm-up's first step, not at each batch
            raise ConfigError(
                f"sft.demonstrations: {pool.num_rows} episodes played without failing, fewer than "
                f"sft.batch_size ({chunk})"
            )
        return cls(pool, pad_id, rng)

    def batch(self, size: int) -> dict[str, np.ndarray]:
        """``size`` distinct episodes of the pool (``play`` made sure it holds that many), packed. Passes over a
        shuffled order, reshuffled at each pass's end; an episode the new pass draws again within the same batch
        waits for the next one."""
        rows: list[int] = []
        waiting: list[int] = []
        while len(rows) < size:
            if not self.order:
                self.order = [int(r) for r in self.rng.permutation(self.trajectories.num_rows)]
            row = self.order.pop()
            (waiting if row in rows else rows).append(row)
        self.order.extend(reversed(waiting))  # drawn first in the next batch
        return pack_trajectories(self.trajectories.select(np.asarray(rows)), self.pad_id)
