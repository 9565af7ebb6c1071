"""Where a GRPO run's episodes come from when they are more than single-turn completions: a text env (``env.id``),
an outside agent (``env.agent``), a ``verifiers`` environment (``env.verifiers``) or an OpenEnv server
(``env.openenv``), with the warm-up's demonstrations on it (``sft.player``).

Text envs and agents are checked before Ray starts (built, reset on the first task, resolved). A verifiers
environment and an OpenEnv server run in actors with packages of their own (Ray runtime envs), so they are set up
once Ray runs and before any other actor starts; a verifiers environment brings its own task rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlfabric.actors.llm_rollout import TextEnvSource
from rlfabric.agent_rollout import AgentDemonstrations, AgentSource, agent_run_source
from rlfabric.grpo_config import LLMConfig
from rlfabric.llm_openenv import openenv_server_restarts, start_openenv, stop_openenv
from rlfabric.llm_text_env import Demonstrations, text_env_source
from rlfabric.llm_verifiers import VerifiersRun, start_verifiers_env, stop_verifiers_env


def needs_ray(cfg: LLMConfig) -> bool:
    """Whether the episode source is set up only once Ray runs (its actor has packages of its own)."""
    return bool(cfg.env.verifiers.id or cfg.env.openenv.command or cfg.env.openenv.url)


@dataclass
class EpisodeSources:
    """What the rollout workers play (``text_env`` or ``agent``), the warm-up's ``demonstrations``, and the
    actors behind a verifiers environment or an OpenEnv server."""

    text_env: TextEnvSource | None = None
    agent: AgentSource | None = None
    demonstrations: Demonstrations | AgentDemonstrations | None = None
    verifiers: VerifiersRun | None = None
    openenv_host: Any = None

    def metrics(self) -> dict[str, int]:
        """For each step row and the summary: ``openenv_server_restarts`` when the run has an OpenEnv server."""
        return openenv_server_restarts(self.openenv_host) if self.openenv_host is not None else {}

    def close(self) -> None:
        """Stop the actors behind the episodes: a verifiers environment after its teardown handlers, an OpenEnv
        server with its sessions."""
        if self.verifiers is not None:
            stop_verifiers_env(self.verifiers.host)
        if self.openenv_host is not None:
            stop_openenv(self.openenv_host)


def sources_before_ray(
    cfg: LLMConfig, tokenizer: Any, model_dir: str, first_task: dict[str, Any], context: int | None
) -> EpisodeSources:
    """A text env's or an agent's source, checked before Ray starts (``context``: the model's positions)."""
    sources = EpisodeSources()
    if cfg.env.id:  # its reset writes the first prompt
        sources.text_env = text_env_source(cfg, tokenizer, model_dir, first_task, context)
    elif cfg.env.agent:  # it writes its own messages
        sources.agent = agent_run_source(cfg, tokenizer, model_dir, context)
    _add_demonstrations(sources, cfg, tokenizer)
    return sources


def sources_after_ray(
    cfg: LLMConfig, tokenizer: Any, model_dir: str, train_rows: list[dict[str, Any]], context: int | None
) -> EpisodeSources:
    """A verifiers environment's or an OpenEnv server's source, its actor started (the verifiers environment's
    rows are in ``sources.verifiers``)."""
    sources = EpisodeSources()
    try:
        if cfg.env.verifiers.id:
            sources.verifiers = start_verifiers_env(cfg)
            sources.agent = agent_run_source(cfg, tokenizer, model_dir, context, sources.verifiers.agent)
        else:
            sources.openenv_host, spec, kwargs = start_openenv(cfg)
            first = train_rows[0]
            sources.text_env = text_env_source(cfg, tokenizer, model_dir, first, context, spec, kwargs)
        _add_demonstrations(sources, cfg, tokenizer)
    except Exception:
        sources.close()  # the actors started so far go with the error
        raise
    return sources


def _add_demonstrations(sources: EpisodeSources, cfg: LLMConfig, tokenizer: Any) -> None:
    """The scripted player's episodes for the warm-up (``sft.player``; one that names nothing fails here)."""
    if not cfg.sft.steps:
        return
    if sources.text_env is not None:
        sources.demonstrations = Demonstrations(sources.text_env, cfg.sft.player, tokenizer)
    elif sources.agent is not None:
        sources.demonstrations = AgentDemonstrations(sources.agent, cfg.sft.player, tokenizer)
