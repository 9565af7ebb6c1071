"""Starting a GRPO run's actors from its config: generators, learners (and their process group), the reference
actor, the rollout worker, and what they all ask Ray for (the likelihood scorer too, which
``rlfabric.likelihood_scorers`` starts)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import ray

from rlfabric import rewards
from rlfabric.actor_slots import RunAbortedError
from rlfabric.grpo_config import LLMConfig
from rlfabric.judge import JUDGE_CPUS
from rlfabric.llm_resources import SETUP_TIMEOUT_S, torch_threads
from rlfabric.models.shared_weights import remove_stale
from rlfabric.objectives import NO_STEP_CREDIT
from rlfabric.placement import ActorRequest
from rlfabric.reward_config import RewardFunctionConfig
from rlfabric.rewards.likelihood import POLICY


def actor_requests(cfg: LLMConfig) -> list[ActorRequest]:
    """What every actor of the run asks Ray for, by the config section that sets it."""
    g, lc, r = cfg.generator, cfg.learner, cfg.rewards
    reference = int(cfg.grpo.kl_coef > 0 and cfg.grpo.reference == "actor")
    requests = [
        ActorRequest("generator", g.num_generators, generator_resources(cfg)),
        ActorRequest("learner", lc.num_learners + reference, {"CPU": lc.num_cpus, "GPU": lc.num_gpus, **lc.resources}),
        ActorRequest("rewards", r.num_actors, reward_resources(cfg)),
    ]
    specs = policy_likelihood_specs(cfg)
    if specs:  # one scorer, shared by every policy likelihood reward
        role = f"likelihood scorer ({specs[0][0]}.scorer_cpus/scorer_gpus)"
        requests.append(ActorRequest(role, 1, scorer_resources(cfg)))
    for field, spec in judge_specs(cfg):
        requests.append(judge_request(field, spec, 1 if field.startswith("rewards.shadow") else r.num_workers))
    return requests


def reward_resources(cfg: LLMConfig) -> dict[str, float]:
    """What one reward worker asks Ray for (``rewards.num_cpus``, ``num_gpus``, ``resources``)."""
    r = cfg.rewards
    return {"CPU": r.num_cpus, "GPU": r.num_gpus, **r.resources}


def generator_resources(cfg: LLMConfig) -> dict[str, float]:
    """What one generator asks Ray for (``generator.num_cpus``, ``num_gpus``, ``resources``)."""
    g = cfg.generator
    return {"CPU": g.num_cpus, "GPU": g.num_gpus, **g.resources}


def wanted_cpus(cfg: LLMConfig) -> float:
    """CPUs every actor of this config asks for (``actor_requests``), plus one for the driver."""
    return sum(r.count * r.resources.get("CPU", 0.0) for r in actor_requests(cfg)) + 1


def judge_specs(cfg: LLMConfig) -> list[tuple[str, RewardFunctionConfig]]:
    """(config field, spec) of each ``judge`` reward, training or shadow."""
    return [
        (f"{section}[{i}].kwargs", spec)
        for section, specs in (
            ("rewards.functions", cfg.rewards.functions),
            ("rewards.shadow.functions", cfg.rewards.shadow.functions),
        )
        for i, spec in enumerate(specs)
        if spec.name == "judge"
    ]


def judge_resources(spec: RewardFunctionConfig) -> dict[str, float]:
    """What one judge generator asks Ray for (``judge_reward``'s ``num_cpus``, 0.5 by default)."""
    return {"CPU": float(spec.kwargs.get("num_cpus", JUDGE_CPUS))}


def judge_request(field: str, spec: RewardFunctionConfig, workers: int) -> ActorRequest:
    """The judge generators of one ``judge`` spec (``field`` names its kwargs) served by ``workers`` reward
    workers: each worker starts its own ``num_generators``, each asking for ``judge_resources``."""
    count = workers * spec.kwargs.get("num_generators", 1)
    return ActorRequest(f"judge generators ({field}.num_generators/num_cpus)", count, judge_resources(spec))


def policy_likelihood_specs(cfg: LLMConfig) -> list[tuple[str, RewardFunctionConfig]]:
    """(config field, spec) of each ``likelihood`` reward (training or shadow) scored with ``weights: policy``:
    the run then starts one likelihood scorer, which they share."""
    found = []
    for section, specs in (
        ("rewards.functions", cfg.rewards.functions),
        ("rewards.shadow.functions", cfg.rewards.shadow.functions),
    ):
        for i, spec in enumerate(specs):
            if spec.name == "likelihood" and spec.kwargs.get("weights", POLICY) == POLICY:
                found.append((f"{section}[{i}].kwargs", spec))
    return found


def scorer_resources(cfg: LLMConfig) -> dict[str, float]:
    """What the likelihood scorer asks Ray for: the largest ``scorer_cpus``/``scorer_gpus`` of the specs that
    share it (0.5 CPU, no GPU by default)."""
    specs = [spec for _, spec in policy_likelihood_specs(cfg)]
    return {
        "CPU": max((float(s.kwargs.get("scorer_cpus", 0.5)) for s in specs), default=0.0),
        "GPU": max((float(s.kwargs.get("scorer_gpus", 0.0)) for s in specs), default=0.0),
    }


def reward_weights(cfg: LLMConfig) -> dict[str, float]:
    """The scalar reward's weights (``rewards.scalar_weights``), and 0 for the ``<component>_version`` of each
    policy likelihood reward that ``rewards.weights`` does not name: a version is a record, not a reward."""
    versions = {
        f"{spec.kwargs.get('component', 'likelihood')}_version": 0.0 for _, spec in policy_likelihood_specs(cfg)
    }
    return {**versions, **cfg.rewards.scalar_weights()}


def with_scorer(specs: list[RewardFunctionConfig], scorer: str | None) -> list[dict[str, Any]]:
    """The reward specs as the reward services get them: each policy ``likelihood`` one names the run's scorer
    actor (``scorer``) in its kwargs."""
    out = []
    for spec in specs:
        entry = dataclasses.asdict(spec)
        if scorer and entry["name"] == "likelihood" and entry["kwargs"].get("weights", POLICY) == POLICY:
            entry["kwargs"] = {**entry["kwargs"], "scorer": scorer}
        out.append(entry)
    return out


def batch_spec(cfg: LLMConfig) -> dict[str, Any]:
    """How learners and the reference actor turn records into the packed batch (``grpo_batch``'s options)."""
    g = cfg.grpo
    return {
        "reward_weights": reward_weights(cfg),
        "advantage": g.advantage,
        "scale_by_std": g.scale_by_std,
        "overlong_filter": g.overlong_filter,
        "world_size": cfg.learner.num_learners,
        "step_credit": g.step_credit,
        "step_credit_weight": g.step_credit_weight,
        "step_gamma": g.step_gamma,
        "efficiency": dataclasses.asdict(cfg.rewards.efficiency),
        "combine": dataclasses.asdict(cfg.rewards.combine),
        "process": dataclasses.asdict(cfg.rewards.process),
    }


def start_generator(cfg: LLMConfig, model_dir: str, seed: int, placement: dict[str, Any] | None = None) -> Any:
    """One generator actor serving ``model_dir``, sampling from ``seed``; ``placement``: its placement group's
    scheduling options (``ray.placement``)."""
    from rlfabric.actors.generator import Generator

    g = cfg.generator
    options: dict[str, Any]
    if g.backend == "torch":
        device = "cuda" if g.num_gpus > 0 else "cpu"
        options = {
            "max_batch_size": g.max_batch_size,
            "device": device,
            "seed": seed,
            "matmul_dtype": g.matmul_dtype,
            "session_cache_mb": g.session_cache_mb,
        }
    else:
        options = {**dataclasses.asdict(g.vllm), "seed": seed}
    return Generator.options(
        num_cpus=g.num_cpus, num_gpus=g.num_gpus, resources=g.resources, **(placement or {})
    ).remote(g.backend, model_dir, options, num_threads=torch_threads(cfg, "generator"))


def start_learners(
    cfg: LLMConfig,
    model_dir: str,
    reference_dir: str | None,
    placement: Callable[[int], dict[str, Any]] | None = None,
    parts: bytes | None = None,
) -> list[Any]:
    """``learner.num_learners`` learner actors from ``model_dir``, their data-parallel process group formed (or a
    ``RunAbortedError`` naming what was asked for, after ``SETUP_TIMEOUT_S``); ``placement(rank)``: a learner's
    placement group scheduling options (``ray.placement``); ``parts``: the user's additions to
    ``rlfabric.objectives`` (its ``snapshot``)."""
    from rlfabric.actors.llm_learner import LLMLearner

    lc = cfg.learner
    device = lc.device if lc.device != "auto" else ("cuda" if lc.num_gpus > 0 else "cpu")
    grpo = {**dataclasses.asdict(cfg.grpo), "norm_length": cfg.sampling.max_new_tokens}
    learners = [
        LLMLearner.options(
            num_cpus=lc.num_cpus, num_gpus=lc.num_gpus, resources=lc.resources, **(placement(rank) if placement else {})
        ).remote(
            model_dir=model_dir,
            grpo=grpo,
            sft=dataclasses.asdict(cfg.sft),
            temperature=cfg.sampling.temperature,
            dtype=cfg.model.dtype,
            device=device,
            rank=rank,
            world_size=lc.num_learners,
            seed=cfg.training.seed,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
            reference_in_learner=cfg.grpo.kl_coef > 0 and cfg.grpo.reference == "learner",
            reference_dir=reference_dir,
            num_threads=torch_threads(cfg, "learner"),
            matmul_dtype=lc.matmul_dtype,
            batch_spec=batch_spec(cfg),
            sequence_packing=lc.sequence_packing,
            parts=parts,
        )
        for rank in range(lc.num_learners)
    ]
    if lc.num_learners > 1:
        asked = f"{lc.num_learners} learners x (num_cpus={lc.num_cpus:g}, num_gpus={lc.num_gpus:g})"
        try:
            address = ray.get(learners[0].node_address.remote(), timeout=SETUP_TIMEOUT_S)
            port = ray.get(learners[0].free_port.remote(), timeout=SETUP_TIMEOUT_S)
            backend = "nccl" if device == "cuda" else "gloo"
            ray.get([ln.init_process_group.remote(address, port, backend) for ln in learners], timeout=SETUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RunAbortedError(
                f"the data-parallel learners' process group did not form within {SETUP_TIMEOUT_S:g}s ({asked}); "
                "the cluster may not be able to place them all at once"
            ) from None
    return learners


def start_reference(
    cfg: LLMConfig,
    reference_dir: str | None,
    pad_id: int,
    placement: dict[str, Any] | None = None,
    parts: bytes | None = None,
) -> Any:
    """The reference actor (``grpo.reference: actor`` with a KL term), or None; ``placement`` and ``parts``: as the
    learners'."""
    if not (cfg.grpo.kl_coef > 0 and cfg.grpo.reference == "actor"):
        return None
    from rlfabric.actors.reference import Reference

    lc = cfg.learner
    return Reference.options(num_cpus=lc.num_cpus, num_gpus=lc.num_gpus, **(placement or {})).remote(
        reference_dir,
        cfg.sampling.temperature,
        cfg.grpo.micro_batch_size,
        dtype=cfg.model.dtype,
        device="cuda" if lc.num_gpus > 0 else "cpu",
        num_threads=torch_threads(cfg, "reference"),
        matmul_dtype=lc.matmul_dtype,
        batch_spec=batch_spec(cfg),
        pad_id=pad_id,
        sequence_packing=lc.sequence_packing,
        parts=parts,
    )


def start_rollout_worker(
    cfg: LLMConfig,
    text_env: Any = None,
    scorer: str | None = None,
    model_dir: str | None = None,
    agent: Any = None,
    reward_placement: Callable[[int], dict[str, Any]] | None = None,
    parts: bytes | None = None,
) -> Any:
    """The rollout worker, with its reward services (the driver's reward registrations travel with it), playing
    ``text_env`` (a ``TextEnvSource``) or ``agent`` (an ``AgentSource``) when the run trains on one; ``scorer``
    names the likelihood scorer the policy ``likelihood`` rewards call; ``model_dir`` is the policy's folder, whose
    tokenizer maps process-reward steps to tokens; ``reward_placement(i)``: the i-th reward worker's placement
    group scheduling options (``ray.placement.rewards``)."""
    from rlfabric.actors.llm_rollout import LLMRolloutWorker

    r = cfg.rewards
    shadow = dataclasses.asdict(r.shadow)
    shadow["functions"] = with_scorer(r.shadow.functions, scorer)
    return LLMRolloutWorker.options(num_cpus=0).remote(
        reward_functions=with_scorer(r.functions, scorer),
        reward_weights=reward_weights(cfg),
        num_reward_workers=r.num_workers,
        reward_timeout_s=r.timeout_s,
        reward_cpus=r.num_cpus,
        reward_gpus=r.num_gpus,
        reward_resources=r.resources,
        reward_placement=[reward_placement(i) for i in range(r.num_actors)] if reward_placement else None,
        reward_registry=rewards.snapshot(),
        parts=parts,
        prompt_key=cfg.data.prompt_key,
        text_env=text_env,
        agent=agent,
        efficiency=dataclasses.asdict(r.efficiency),
        combine=dataclasses.asdict(r.combine),
        shadow=shadow,
        process=dataclasses.asdict(r.process),
        model_dir=model_dir,
        step_credit=batch_spec(cfg) if cfg.grpo.step_credit != NO_STEP_CREDIT else None,
    )


def stop_actors(
    generators: list[Any], workers: list[Any], learners: list[Any], reference: Any, shared_files: Iterable[str]
) -> None:
    """End a run's actors: generators stop their schedulers and rollout workers their reward services, learners
    remove their shared-memory weight files, each within 10 s; then the files a dead learner left (``shared_files``,
    those on this node) are removed and every process is killed, whether it answered or not."""
    try:
        ray.get([g.shutdown.remote() for g in [*generators, *workers]], timeout=10)
    except Exception:  # a dead or stuck actor is killed below either way
        pass
    try:
        ray.get([ln.close.remote() for ln in learners], timeout=10)
    except Exception:  # a dead learner cannot remove its shared-memory file: done below where it is ours
        pass
    remove_stale(sorted(shared_files))  # a no-op for files on other nodes (not here) or already gone
    for actor in [*generators, *workers, *learners, reference]:
        if actor is not None:
            ray.kill(actor, no_restart=True)
