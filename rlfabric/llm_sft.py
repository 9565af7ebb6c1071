"""The supervised warm-up's batches (``sft``): each row's demonstration after its prompt, or with a text env or an
outside agent a scripted player's episodes on the rows' tasks (``rlfabric.llm_text_env.Demonstrations``,
``rlfabric.agent_rollout.AgentDemonstrations``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlfabric.agent_rollout import AgentDemonstrations
from rlfabric.config import ConfigError
from rlfabric.grpo_config import LLMConfig
from rlfabric.llm_text_env import Demonstrations
from rlfabric.models.sequences import pack_sequences


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
        if key not in rows[i]:
            raise ConfigError(f"sft.answer_key = {key!r}: train row {i} has no such column")
        text = pick_demonstration(rows[i][key], rng)
        answers.append(list(tokenizer(text, add_special_tokens=False).input_ids) + [tokenizer.eos_token_id])
    return pack_sequences([prompt_ids[i] for i in indices], answers, pad_id)


def pick_demonstration(value: Any, rng: np.random.Generator) -> str:
    """A row's target completion; a list holds several demonstrations, one picked at random per use."""
    if isinstance(value, (list, tuple, np.ndarray)) and len(value) > 0:
        return str(value[int(rng.integers(len(value)))])
    return str(value)
