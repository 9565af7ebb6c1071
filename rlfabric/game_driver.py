"""PPO on multi-agent games (PettingZoo): the PPO driver with one learner per trainable policy, and self-play.

The loop is the PPO driver's (``rlfabric.driver.Trainer``): runners sample fragments, the driver checks versions
and hands refs to the learners. Here a runner's sample is one fragment per trainable policy, and each policy's
learner gets only its own fragments' refs; every policy has its own optimizer, statistics and versions (they
advance together, one update each per iteration). A language-model policy with ``train`` has a GameLLMLearner
(actors/game_llm_learner.py), which trains on its moves and loads its weights into the policy's generator; the
driver calls it as it calls a PPO learner. With ``multi_agent.self_play``, the driver keeps the opponent
pool (rlfabric.multiagent.selfplay): snapshots are the learner's published weights refs, the game results the
runners report update win rates and Elo, and each change of the pool goes to every runner.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from rlfabric import registry, shipping
from rlfabric.actor_slots import evaluation_failure
from rlfabric.actors.game_llm_learner import GameLLMLearner
from rlfabric.actors.game_runner import GameRunner
from rlfabric.actors.learner import Learner
from rlfabric.config import Config, ConfigError, config_from_dict
from rlfabric.config_base import changed_keys, raised_by_user_code
from rlfabric.driver import Trainer, latest_checkpoint, next_episode_id_range
from rlfabric.game_llm_servers import LLMServers
from rlfabric.models import ActionSpec, ActorCritic
from rlfabric.models.hf import check_model_source
from rlfabric.models.numpy_policy import check_ppo_spaces
from rlfabric.multiagent.baselines import rule_misfit, scripted_rule, text_renderer
from rlfabric.multiagent.config import (
    MultiAgentConfig,
    policy_specs,
    trainable_policies,
    trained_llm_policies,
    trained_neural_policies,
)
from rlfabric.multiagent.games import is_parallel
from rlfabric.multiagent.mapping import plan_game
from rlfabric.multiagent.selfplay import OpponentPool
from rlfabric.ppo_placement import SETUP_TIMEOUT_S
from rlfabric.ray_connect import cluster_address, ensure_ray
from rlfabric.reward_shaping import components_read
from rlfabric.run.plots import plot_self_play
from rlfabric.runner_pool import Completed


def frozen_weights(checkpoint: str, from_policy: str | None, field: str) -> dict[str, Any]:
    """The actor of a policy saved by an earlier PPO run (a run directory's latest checkpoint, or a checkpoint file),
    as a runner installs it: ``{"actor": arrays, "version": saved version, "obs_stats": ... or None}``. A one-line
    ConfigError naming ``field`` when it cannot be read."""
    path = Path(checkpoint)
    file = latest_checkpoint(path) if path.is_dir() else path
    if file is None or not file.is_file():
        raise ConfigError(f"{field} = {checkpoint!r} is not valid: no run directory with a checkpoint, or file, there")
    state = torch.load(file, weights_only=False)
    learners = state.get("learners") or {"default": state["learner"]}
    name = from_policy or (next(iter(learners)) if len(learners) == 1 else None)
    if name not in learners:
        raise ConfigError(
            f"{field.rpartition('.')[0]}.from_policy = {from_policy!r} is not valid: {str(file)!r} holds the "
            f"policies {', '.join(learners)}"
        )
    saved_cfg = config_from_dict(state["config"])
    model_state = learners[name]["model"]
    if "actor.0.weight" not in model_state:
        raise ConfigError(
            f"{field} = {checkpoint!r} is not valid: its policy {name!r} is a language model; a frozen policy is a "
            f"neural one (play the language model with kind: llm, model: its saved folder under llm_models/)"
        )
    obs_dim = model_state["actor.0.weight"].shape[1]
    critic_dim = model_state["critic.0.weight"].shape[1]
    last = max(int(k.split(".")[1]) for k in model_state if k.startswith("actor.") and k.endswith(".weight"))
    n = model_state[f"actor.{last}.weight"].shape[0]
    action = ActionSpec("continuous", n) if "log_std" in model_state else ActionSpec("discrete", n)
    m = saved_cfg.model
    model = ActorCritic(obs_dim, action, m.hidden_sizes, m.activation, m.init_log_std, critic_dim)
    model.load_state_dict(model_state)
    stats = learners[name]["obs_stats"] if saved_cfg.ppo.normalize_obs else None
    return {"actor": model.actor_arrays(), "version": int(learners[name]["version"]), "obs_stats": stats}


def check_game_config(cfg: Config) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """A game config checked against one copy of its env before any actor starts: the mapping of agents to
    policies, their spaces, frozen policies' checkpoints, llm models, and what PPO on a game does not do yet. One
    ConfigError line. Returns agent -> policy, which the runners get as it is (a mapping function runs here only),
    and each frozen policy's weights, read once here for every runner."""
    with env_build_errors(cfg, "building it and resetting it"):
        env = registry.make_multi_agent_env(cfg.env.id, cfg.env.kwargs)
        reset = reset_within(env, cfg)
        try:
            try:
                plan = plan_game(env, cfg.multi_agent)
            except ValueError as exc:
                raise ConfigError(f"env.id = {cfg.env.id!r}: {exc}") from None
            to_move = None if reset is not None else env.agent_selection  # a turn-based game's mover
            _check_scripted_rules(
                cfg, plan, lambda agent: env.observe(agent) if reset is None else reset[agent], to_move
            )
        finally:
            env.close()
    frozen = {}
    for name, spec in policy_specs(cfg.multi_agent).items():
        if spec.kind == "llm":
            check_model_source(spec.model, f"multi_agent.policies.{name}.model")
        if spec.kind != "frozen" or name not in plan.policy_spaces:
            continue
        field = f"multi_agent.policies.{name}.checkpoint"
        frozen[name] = frozen_weights(spec.checkpoint or "", spec.from_policy, field)
        actor, spaces = frozen[name]["actor"], plan.policy_spaces[name]
        saved = (actor["weights"][0].shape[0], actor["action"].n)
        if saved != (spaces.obs_dim, spaces.action.n):
            raise ConfigError(
                f"{field} = {spec.checkpoint!r} is not valid: its policy sees {saved[0]} values and has {saved[1]} "
                f"actions; the agents mapped to {name!r} see {spaces.obs_dim} and have {spaces.action.n}"
            )
    _refuse_unsupported(cfg)
    return plan.mapping, frozen


def _check_scripted_rules(cfg: Config, plan: Any, first_obs: Any, to_move: str | None) -> None:
    """Each scripted rule a game config names (a scripted policy's, and a self-play evaluation opponent's) tried
    on the first observation of an agent it would play, ``first_obs(agent)`` (in a turn-based game, the agent
    ``to_move`` when it plays it: another's mask allows no move yet): a rule written for another game is one
    ConfigError here, not runners that fail every sample or an evaluation skipped after the whole run. A rule that
    cannot be resolved is left to ``user_callables``, which names it."""
    ma = cfg.multi_agent
    plays: list[tuple[str, str, str]] = [  # (field, its value, the policy whose seats the rule plays)
        (f"multi_agent.policies.{name}.rule", spec.rule, name)
        for name, spec in policy_specs(ma).items()
        if spec.kind == "scripted" and spec.rule
    ]
    if ma.self_play.enabled:
        plays += [
            ("multi_agent.eval_opponents", o, ma.self_play.policy)
            for o in ma.eval_opponents
            if o.startswith("scripted:")
        ]
    for field, value, policy in plays:
        seats = [agent for agent, p in plan.mapping.items() if p == policy]
        if to_move is not None:
            seats = [agent for agent in seats if agent == to_move]
        try:
            resolved = scripted_rule(value.removeprefix("scripted:"))
            seat = seats[0]
            raw = first_obs(seat)
        except (ValueError, KeyError, IndexError):  # unresolvable: user_callables names it; no seat to try, or no
            continue  # observation at reset (an agent that joins later): its runner meets the rule as it plays
        if (why := rule_misfit(resolved, plan.spaces[seat], raw)) is not None:
            raise ConfigError(
                f"{field} = {value!r} is not valid for env.id = {cfg.env.id!r}: on the first observation of "
                f"{seat!r} {why}"
            )


def user_callables(cfg: Config) -> bytes:
    """The scripted rules and text renderers a game config names, resolved here (one ConfigError naming the field
    when one cannot be) and serialized by value when their module is not installed (a script, a test file), so
    runners on any node have them without importing it."""
    named: list[tuple[str, str, Any]] = []
    for name, spec in policy_specs(cfg.multi_agent).items():
        if spec.kind == "scripted" and spec.rule:
            named.append((f"multi_agent.policies.{name}.rule", spec.rule, scripted_rule))
        if spec.kind == "llm":
            named.append((f"multi_agent.policies.{name}.render", spec.render or "", text_renderer))
    for opponent in cfg.multi_agent.eval_opponents:
        if opponent.startswith("scripted:"):
            named.append(("multi_agent.eval_opponents", opponent.partition(":")[2], scripted_rule))
    found: dict[str, Any] = {}
    for field, spec_name, resolve in named:
        try:
            found[spec_name] = resolve(spec_name)
        except ValueError as exc:
            raise ConfigError(f"{field} = {spec_name!r} is not valid: {exc}") from None
    return shipping.dumps_with_user_code(found)


def _refuse_unsupported(cfg: Config) -> None:
    p = cfg.ppo
    for name, value in (("ppo.normalize_obs", p.normalize_obs), ("ppo.normalize_reward", p.normalize_reward)):
        if value and not trained_neural_policies(cfg.multi_agent):
            raise ConfigError(
                f"{name} = true is not valid here: it applies to neural policies' learners, and no trainable neural "
                "policy plays this game; set it false"
            )


def refuse_reward_components(cfg: Config) -> None:
    """A game's runners read no step info: ``env.reward_components`` / ``env.reward_weights`` there would be ignored,
    so they are one ConfigError; so is ``model.init_from``, a single-agent run's checkpoint."""
    env = cfg.env
    if cfg.model.init_from:
        raise ConfigError(
            f"model.init_from = {cfg.model.init_from!r} is set, but env.id = {env.id!r} is a game: a game's policies "
            "start from a checkpoint as multi_agent.policies.<name>.checkpoint (frozen); remove it"
        )
    if env.reward_components or env.reward_weights:
        key = "env.reward_components" if env.reward_components else "env.reward_weights"
        raise ConfigError(
            f"{key} is set, but env.id = {env.id!r} is a game: reward components and weights apply to single-agent "
            "Gymnasium envs; remove it"
        )


class GameTrainer(Trainer):
    """Runs one PPO training job on a multi-agent env (see the module docstring)."""

    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool = False, quiet: bool = False) -> None:
        refuse_reward_components(cfg)
        self.agent_policies, self.frozen = check_game_config(cfg)
        self.callables_blob = user_callables(cfg)
        super().__init__(cfg, run_dir, resume=resume, quiet=quiet)
        self.trainable = trainable_policies(cfg.multi_agent)
        self.learners: dict[str, Any] = {}
        sp = cfg.multi_agent.self_play
        self.opponents: OpponentPool | None = None
        if sp.enabled:
            self.opponents = OpponentPool(
                snapshot_every=sp.snapshot_every,
                win_rate_threshold=sp.win_rate_threshold,
                win_rate_window=sp.win_rate_window,
                min_games=sp.min_games,
                max_size=sp.max_size,
                sampling=sp.sampling,
                pfsp_power=sp.pfsp_power,
                elo_k=sp.elo_k,
            )
        self.policy_returns: dict[str, list[float]] = {}
        self.weights_refs: dict[str, ray.ObjectRef] = {}
        self.llm_servers: LLMServers | None = None
        self.llm_moves: dict[str, list[int]] = {}

    # -- actors -------------------------------------------------------------------------------------------------

    def _make_runner(self, index: int, generation: int) -> Any:
        r, t = self.cfg.runners, self.cfg.training
        seed = t.seed + 10_007 * index + 1_000_003 * generation + 7_919 * self.progress.iteration
        return GameRunner.options(**self._actor_options(r.num_cpus, 0, r.resources, "runners", index)).remote(
            self.cfg.env.id,
            self.cfg.env.kwargs,
            r.envs_per_runner,
            self.cfg.fragment_length,
            seed,
            self.cfg.multi_agent,
            self.cfg.ppo.obs_clip,
            self.registry_blob,
            self.llm_servers.serving() if self.llm_servers is not None else {},
            self.agent_policies,
            self.callables_blob,
            next_episode_id_range(self.progress),
            r.sample_timeout_s / 2,  # an llm move's deadline: a hung generator is named before the sample's
            gamma=self.cfg.ppo.gamma,
        )

    def setup(self) -> None:
        llm = [n for n, s in policy_specs(self.cfg.multi_agent).items() if s.kind == "llm"]
        llm_learners = len(trained_llm_policies(self.cfg.multi_agent))  # 1 CPU each, like their generators
        ensure_ray(self.cfg.ray, self._cpus_wanted() + len(llm) + llm_learners)
        if llm:
            self.llm_servers = LLMServers(policy_specs(self.cfg.multi_agent), llm, self.run_dir, self.cfg.training.seed)
        super().setup()

    def _fragments_per_sample(self) -> int:
        return len(self.trainable)

    def _num_learners(self) -> int:
        """One learner per trainable neural policy (a trained llm policy's learner is its own, 1 CPU)."""
        return len(trained_neural_policies(self.cfg.multi_agent))

    def _make_learners(self, spaces: dict[str, Any]) -> None:
        lc = self.cfg.learner
        specs, neural = policy_specs(self.cfg.multi_agent), trained_neural_policies(self.cfg.multi_agent)
        for i, policy in enumerate(self.trainable):
            spec = specs[policy]
            if spec.kind == "llm":
                assert self.llm_servers is not None
                serving = self.llm_servers.serving()[policy]
                self.learners[policy] = GameLLMLearner.options(num_cpus=1).remote(
                    serving.model_dir,
                    serving.handle,
                    lr=spec.lr,
                    invalid_move_penalty=spec.invalid_move_penalty,
                    temperature=spec.temperature,
                    max_new_tokens=spec.max_new_tokens,
                    seed=self.cfg.training.seed + 1_000 * i,
                )
                continue
            s = spaces[policy]
            # each neural policy's learner in its own bundle
            options = self._actor_options(lc.num_cpus, lc.num_gpus, lc.resources, "learner", neural.index(policy))
            self.learners[policy] = Learner.options(**options).remote(
                self.cfg.to_dict(), s["obs_dim"], s["action"], s["critic_dim"], 1_000 * i
            )

    def _learners(self) -> list[Any]:
        return list(self.learners.values())

    def _runner_failed(self, error: Exception) -> None:
        """A runner whose llm player found its generator dead or hung: replace that generator (once), load the
        policy's current weights into it when it trains, and point every runner at it."""
        if self.llm_servers is None:
            return
        replaced = self.llm_servers.replace_failed(error)
        if not replaced:
            return
        servers = self.llm_servers.serving()
        for policy in replaced:
            self.log.note(f"the generator of llm policy '{policy}' failed; started a new one")
            if policy in self.learners:
                try:
                    ray.get(self.learners[policy].serve_with.remote(servers[policy].handle), timeout=SETUP_TIMEOUT_S)
                except ray.exceptions.RayError as exc:  # the new one failed too: the runners' calls will say so
                    self.log.note(f"the new generator of llm policy '{policy}' did not load its weights: {exc}")
        self.pool.broadcast_call("set_llm_servers", servers)

    def close(self) -> None:
        super().close()
        if self.llm_servers is not None:
            self.llm_servers.shutdown()

    # -- checkpoints --------------------------------------------------------------------------------------------

    def _checkpoint_state(self) -> dict[str, Any]:
        states = ray.get([self.learners[p].state.remote() for p in self.trainable])
        state: dict[str, Any] = {"learners": dict(zip(self.trainable, states, strict=True))}
        if self.opponents is not None:
            pool = self.opponents.state_dict()
            # snapshots are refs to published weights: saved as the weights themselves
            for snap in pool["snapshots"]:
                snap["weights"] = ray.get(snap["weights"])
            state["opponent_pool"] = pool
        return state

    def _load_learner_state(self, checkpoint: dict[str, Any]) -> None:
        ray.get([self.learners[p].load_state.remote(checkpoint["learners"][p]) for p in self.trainable])
        if self.opponents is not None and "opponent_pool" in checkpoint:
            pool = checkpoint["opponent_pool"]
            for snap in pool["snapshots"]:
                snap["weights"] = ray.put(snap["weights"])
            self.opponents = OpponentPool.from_state_dict(pool, **self.opponents.settings())

    # -- updates and weights ------------------------------------------------------------------------------------

    def _start_update(self, batch: list[Completed]) -> list[ray.ObjectRef]:
        return [
            self.learners[p].update_from_refs.remote([c.data_refs[i] for c in batch])
            for i, p in enumerate(self.trainable)
        ]

    def _update_stats(self, results: list[dict[str, float]]) -> dict[str, float]:
        if len(results) == 1:
            return results[0]
        return {
            f"{key}/{policy}": value
            for policy, stats in zip(self.trainable, results, strict=True)
            for key, value in stats.items()
        }

    def _publish(self) -> None:
        published = ray.get([self.learners[p].publish.remote() for p in self.trainable])
        self.weights_refs = {p: ref for p, (ref, _) in zip(self.trainable, published, strict=True)}
        self.version = published[0][1]
        self.pool.broadcast(*self.weights_refs.values())
        if "set_frozen" not in self.pool.state_calls:
            self.pool.broadcast_call("set_frozen", self.frozen)
        if self.opponents is not None:
            changed = False
            if self.opponents.should_add(self.version):
                self.opponents.add(self.weights_refs[self.cfg.multi_agent.self_play.policy], self.version)
                changed = True
            if changed or "set_opponents" not in self.pool.state_calls:
                self._send_opponents()

    def _send_opponents(self) -> None:
        assert self.opponents is not None
        weights = {sid: self.opponents.weights(sid) for sid in self.opponents.ids}
        self.pool.broadcast_call("set_opponents", self.opponents.probabilities(), weights)

    def _accept(self, done: Completed, buffer: list[Completed]) -> None:
        meta = done.meta
        if self.llm_servers is not None:
            self.llm_servers.succeeded(meta["llm_generators"])
        for policy, (moves, invalid) in meta["llm_moves"].items():
            counts = self.llm_moves.setdefault(policy, [0, 0])
            counts[0] += moves
            counts[1] += invalid
        for policy, returns in meta["policy_returns"].items():
            self.policy_returns[policy] = (self.policy_returns.get(policy, []) + returns)[-100:]
        if self.opponents is not None:
            for sid, score in meta["games"]:
                self.opponents.record(sid, score)
            if self.cfg.multi_agent.self_play.sampling == "pfsp" and meta["games"]:
                self._send_opponents()  # pfsp's probabilities follow the win rates
        super()._accept(done, buffer)

    # -- metrics and evaluation ---------------------------------------------------------------------------------

    def _iteration_metrics(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        row: dict[str, Any] = {
            f"return_mean/{p}": float(np.mean(r)) for p, r in sorted(self.policy_returns.items()) if r
        }
        row["agent_steps"] = sum(sum(m["agent_steps"].values()) for m in batch)
        for policy, (moves, invalid) in self.llm_moves.items():
            row[f"llm_moves/{policy}"] = moves
            row[f"llm_invalid_moves/{policy}"] = invalid
        if self.opponents is not None:
            row.update(
                {
                    k: (None if isinstance(v, float) and math.isnan(v) else v)
                    for k, v in self.opponents.metrics().items()
                }
            )
            every = self.cfg.multi_agent.eval_every
            if every and (self.progress.iteration + 1) % every == 0:
                row.update(self._baseline_eval(self.cfg.multi_agent.eval_games, seed_offset=self.progress.iteration))
        return row

    def _baseline_eval(self, games: int, seed_offset: int = 0) -> dict[str, Any]:
        """Greedy games of the self-play policy against each ``eval_opponents`` baseline on runner 0:
        ``win_rate_vs_<name>`` (draws are not wins) and the counts."""
        out: dict[str, Any] = {}
        for opponent in self.cfg.multi_agent.eval_opponents:
            name = opponent.replace(":", "_")
            try:
                result = self.pool.call(
                    0,
                    "evaluate_against",
                    games,
                    self.cfg.training.seed + 54_321 + seed_offset,
                    opponent,
                    timeout=self.cfg.runners.sample_timeout_s,
                )
            except ray.exceptions.RayError as exc:
                why = evaluation_failure(exc, self.cfg.runners.sample_timeout_s)
                self.log.note(f"evaluation against {opponent} skipped: {why}")
                continue
            out[f"win_rate_vs_{name}"] = result["wins"] / max(result["games"], 1)
            out[f"draw_rate_vs_{name}"] = result["draws"] / max(result["games"], 1)
            out[f"loss_rate_vs_{name}"] = result["losses"] / max(result["games"], 1)
        return out

    def _summary_extras(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policies": self.trainable,
            "return_mean_by_policy": {p: float(np.mean(r)) for p, r in self.policy_returns.items() if r},
        }
        if self.llm_moves:
            out["llm_moves"] = {p: {"moves": m, "invalid": i} for p, (m, i) in self.llm_moves.items()}
        trained_llms = trained_llm_policies(self.cfg.multi_agent)
        if trained_llms:  # each trained language model as a Hugging Face folder, to play or train on later
            saved = [self.learners[p].save_model.remote(str(self.run_dir / "llm_models" / p)) for p in trained_llms]
            out["llm_models"] = dict(zip(trained_llms, ray.get(saved), strict=True))
        if self.opponents is not None:
            final = self._baseline_eval(self.cfg.multi_agent.eval_games, seed_offset=10**6)
            out["eval_games"] = self.cfg.multi_agent.eval_games
            out.update({f"eval_{k}": v for k, v in final.items()})
            out["learner_elo"] = self.opponents.learner_elo
            out["opponent_pool_size"] = len(self.opponents)
            out["self_play_plot"] = str(plot_self_play(self.run_dir, f"Self-play on {self.cfg.env.id}"))
        return out


@contextmanager
def env_build_errors(cfg: Config, what: str = "building it") -> Iterator[None]:
    """Any error building (or resetting) ``cfg``'s env in the driver, as one ConfigError naming env.id (and
    env.kwargs) with the exception and where it was raised, before any actor starts."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a user factory may raise anything
        e = cfg.env
        with_kwargs = f" with env.kwargs = {e.kwargs!r}" if e.kwargs else ""
        raise ConfigError(f"env.id = {e.id!r}: {what}{with_kwargs} failed: {raised_by_user_code(exc)}") from None


def reset_within(env: Any, cfg: Config) -> Any:
    """``env.reset(seed=training.seed)`` under the runners' deadline (``runners.sample_timeout_s``), in a thread of
    its own: a reset that never returns is one ConfigError naming env.id, not a run that never starts (the thread is
    left to the process's exit, and the env is not closed: closing a hung env may hang too). Returns a parallel
    game's observations by agent; None for a turn-based (AEC) game, whose ``observe`` gives them."""
    out = _within(cfg, env, "reset()", lambda: env.reset(seed=cfg.training.seed))
    return (out[0] if isinstance(out, tuple) else out) if is_parallel(env) else None


def _within(cfg: Config, env: Any, what: str, call: Any) -> Any:
    """``call()`` under the runners' deadline, in a thread of its own (see ``reset_within``); its error raised
    here, the env closed first."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="rlfabric-env-check", daemon=True)
    thread.start()
    thread.join(cfg.runners.sample_timeout_s)
    if thread.is_alive():
        raise ConfigError(
            f"env.id = {cfg.env.id!r}: {what} did not return within {cfg.runners.sample_timeout_s:g}s "
            "(runners.sample_timeout_s)"
        )
    if "error" in outcome:
        env.close()
        raise outcome["error"]
    return outcome.get("value")


def is_game_config(cfg: Config) -> bool:
    """Whether a PPO config trains a multi-agent env (its env spec builds a PettingZoo env; a factory that is not
    a class is built once to tell)."""
    with env_build_errors(cfg):
        return registry.is_multi_agent(cfg.env.id, cfg.env.kwargs)


def runs_on_local_ray(cfg: Config) -> bool:
    """Whether the run starts (or joins) a Ray instance on this machine, rather than a cluster whose workers may
    have what this process lacks (a GPU simulator, a licence, files, the env's packages)."""
    return cluster_address(cfg.ray) is None


def check_env_builds(cfg: Config) -> None:
    """A single-agent env built, reset and stepped once (a sampled action) in the driver when the run is local, so
    a factory that fails, a reset or step off the Gymnasium API (``registry.reset_problem``, ``step_problem``), or
    a step info without a reward component the run reads, is one line before any actor starts. On a cluster the
    first runner's failure is that line instead."""
    if not runs_on_local_ray(cfg):
        return
    seed = cfg.training.seed
    with env_build_errors(cfg, "building it and resetting it"):
        env = registry.make_env(cfg.env.id, cfg.env.kwargs)
        problem = _within(cfg, env, "reset()", lambda: registry.reset_problem(env, seed))
    if problem is None:
        with env_build_errors(cfg, "stepping it"):
            read = components_read(cfg.env.reward_components, cfg.env.reward_weights)
            problem = _within(cfg, env, "step()", lambda: registry.step_problem(env, seed, read))
    env.close()
    if problem is not None:
        raise ConfigError(f"env.id = {cfg.env.id!r}: {problem}")
    try:  # spaces the policy cannot use: one line here, not each runner's traceback once Ray runs
        check_ppo_spaces(env.observation_space, env.action_space)
    except ValueError as exc:
        raise ConfigError(f"env.id = {cfg.env.id!r}: {exc}") from None


def refuse_multi_agent_settings(cfg: Config) -> None:
    """A ``multi_agent`` setting on a single-agent env is one ConfigError: it would be ignored (no policies to map,
    no self-play), and a user who wrote it expected a game."""
    changed = changed_keys(cfg.multi_agent, MultiAgentConfig(), "multi_agent")
    if changed:
        raise ConfigError(
            f"{changed[0]} is set, but env.id = {cfg.env.id!r} is a single-agent env: the multi_agent section applies "
            "to PettingZoo games (e.g. pettingzoo:classic.tictactoe_v3); remove it"
        )


def ppo_trainer(cfg: Config, run_dir: str | Path, quiet: bool = False) -> Trainer:
    """The trainer for a PPO config: ``GameTrainer`` on a multi-agent env, else the single-agent ``Trainer`` (its
    env checked once the run directory is known to be free)."""
    if is_game_config(cfg):
        return GameTrainer(cfg, run_dir, quiet=quiet)
    refuse_multi_agent_settings(cfg)
    trainer = Trainer(cfg, run_dir, quiet=quiet)
    check_env_builds(cfg)
    return trainer


def ppo_trainer_from_run_dir(run_dir: str | Path, overrides: list[str] | None = None, quiet: bool = False) -> Trainer:
    """The trainer that continues the PPO run saved in ``run_dir`` (see ``Trainer.from_run_dir``)."""
    trainer = Trainer.from_run_dir(run_dir, overrides, quiet=quiet)
    return GameTrainer.from_run_dir(run_dir, overrides, quiet=quiet) if is_game_config(trainer.cfg) else trainer


def train(cfg: Config, run_dir: str | Path, quiet: bool = False) -> dict[str, Any]:
    """Train a PPO config into ``run_dir`` from Python (the CLI's ``rlfabric train``), on a Gymnasium env or a
    game; returns the run summary."""
    trainer = ppo_trainer(cfg, run_dir, quiet=quiet)
    try:
        return trainer.train()
    finally:
        trainer.close()
