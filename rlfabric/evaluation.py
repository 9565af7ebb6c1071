"""``rlfabric eval``: best-of-N accuracy with any reward service as the selector, and reward by response length.

For a policy (a run's newest model, a model folder, or a config's initial model) and the config's held-out
prompts, the evaluation

1. samples M = max(N) completions per prompt (``sampling`` settings) on generator actors, through the same
   ``ServedLLMPolicy`` the rollout worker uses, a chunk of prompts per call;
2. scores every completion with the verifier (``rewards.functions``: a completion is correct when its ``correct``
   component, or the one named, is > 0) and with each selector, on ``RewardPool`` reward services (one pool per
   selector; the training-reward selector reads the verifier's components), scoring one chunk while the next
   one generates;
3. reports, per selector and N, the exact expected accuracy of keeping the selector's top-scored completion of
   N drawn from the M (``rlfabric.algorithms.best_of_n``), beside pass@N (the oracle) and a random pick, and
   reward and accuracy by response length; it writes ``eval.json``, ``samples.jsonl`` and two plots.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray

from rlfabric import rewards
from rlfabric.actor_slots import RunAbortedError
from rlfabric.algorithms.best_of_n import accuracy_by_source, best_of_n, length_bins, pass_at_n, step_aggregate
from rlfabric.algorithms.reward_combination import combine_rewards
from rlfabric.algorithms.step_credit import efficiency_penalty
from rlfabric.config import ConfigError, load_config
from rlfabric.data import check_prompt_lengths, data_sources, load_heldout, load_prompts, row_metadata
from rlfabric.eval_selectors import VERIFIER, Selector, check_selectors
from rlfabric.grpo_config import LLMConfig, episode_source, episode_source_fields
from rlfabric.llm_actors import judge_request, reward_resources, reward_weights, start_generator
from rlfabric.llm_resources import SETUP_TIMEOUT_S, openmp_env
from rlfabric.llm_run_state import FINAL_MODEL_DIR, INITIAL_MODEL_DIR, latest_checkpoint, read_trainer_state
from rlfabric.llm_setup import check_reward_columns, encode_checked, rendered_prompts
from rlfabric.models.hf import check_model_source, model_max_positions
from rlfabric.placement import ActorRequest, check_fits, check_fits_locally
from rlfabric.policies.served import GeneratorsFailed, ServedLLMPolicy
from rlfabric.ray_connect import ensure_ray, fixed_local_cpus
from rlfabric.reward_config import RewardFunctionConfig, parse_split
from rlfabric.reward_model_stage import (
    point_at_run_reward_model,
)
from rlfabric.reward_pool import RewardPool
from rlfabric.rewards import RewardInput, RewardResult
from rlfabric.rewards.likelihood import POLICY
from rlfabric.rewards.process import split_completion
from rlfabric.run.log import CONFIG_FILE, SUMMARY_FILE
from rlfabric.run.progress import format_eta

TRAINING_REWARD = "the training reward: rewards.functions combined by rewards.weights and rewards.combine"
EVAL_FILE, SAMPLES_FILE = "eval.json", "samples.jsonl"
N_PLOT, LENGTH_PLOT = "best_of_n.png", "reward_vs_length.png"
REPORT_FILES = (EVAL_FILE, SAMPLES_FILE, N_PLOT, LENGTH_PLOT)  # what an evaluation writes into its folder


@dataclass(frozen=True)
class PolicySource:
    """The policy to evaluate: ``model_dir`` (None: the config's initial model), what to call it, and the run
    directory it belongs to (its config, its reward model, the default output folder) when there is one."""

    model_dir: str | None
    description: str
    run_dir: Path | None = None


def parse_n_list(text: str) -> list[int]:
    """``"1,2,4,8"`` -> [1, 2, 4, 8] (sorted, without repeats); a ConfigError naming ``--n`` otherwise."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(f"--n {text!r} is not valid: expected comma-separated positive integers, e.g. 1,2,4,8,16")
    return sorted(set(values))


def with_evaluated_policy(spec: dict[str, Any], model_dir: str) -> dict[str, Any]:
    """``spec`` (``{name, kwargs}``), a ``likelihood`` reward with ``weights: policy`` (the default) scoring with
    ``model_dir`` instead: the policy is frozen during an evaluation, so the current policy is the evaluated
    model, loaded by the reward workers like any frozen model (no likelihood scorer actor)."""
    kwargs = spec.get("kwargs") or {}
    if spec["name"] != "likelihood" or kwargs.get("weights", POLICY) != POLICY:
        return spec
    return {**spec, "kwargs": {**kwargs, "weights": model_dir}}


def eval_actor_requests(cfg: LLMConfig, pools: dict[str, list[dict[str, Any]]]) -> list[ActorRequest]:
    """What an evaluation's actors ask Ray for: the generators, ``rewards.num_workers`` reward workers per pool
    (``pools``: label -> reward specs), and the judge generators each of those workers starts for a ``judge``
    spec (``llm_actors.judge_request``, as training counts them)."""
    g, r = cfg.generator, cfg.rewards
    requests = [
        ActorRequest("generator", g.num_generators, {"CPU": g.num_cpus, "GPU": g.num_gpus, **g.resources}),
        ActorRequest("rewards", r.num_workers * len(pools), reward_resources(cfg)),
    ]
    for label, specs in pools.items():
        for i, spec in enumerate(specs):
            if spec["name"] == "judge":
                field = f"rewards.functions[{i}].kwargs" if label == VERIFIER else f"--selector {label!r} kwargs"
                judge = RewardFunctionConfig(spec["name"], dict(spec.get("kwargs") or {}))
                requests.append(judge_request(field, judge, r.num_workers))
    return requests


def find_policy(run_dir: str | None, checkpoint: str | None) -> PolicySource:
    """The newer of a run's ``final_model/`` and latest checkpoint (by step), an explicit model folder, or, with
    neither, the config's initial model."""
    if run_dir and checkpoint:
        raise ConfigError("--run-dir and --checkpoint both given: evaluate one (a run's newest model, or a folder)")
    if checkpoint:
        check_model_source(checkpoint, "--checkpoint")
        folder = Path(checkpoint)
        run = next((p for p in (folder.parent, folder.parent.parent) if (p / CONFIG_FILE).is_file()), None)
        return PolicySource(str(folder), f"model {checkpoint}", run)
    if not run_dir:
        return PolicySource(None, "the config's initial model (untrained: no --run-dir or --checkpoint given)")
    run = Path(run_dir)
    if not run.is_dir():
        raise ConfigError(f"--run-dir {run_dir!r}: no such directory")
    found: list[tuple[int, Path]] = []
    if (run / FINAL_MODEL_DIR / "config.json").is_file():
        try:
            steps = int(json.loads((run / SUMMARY_FILE).read_text())["steps"])
        except (OSError, ValueError, KeyError, TypeError):
            steps = -1  # an older summary: a checkpoint that states its step wins
        found.append((steps, run / FINAL_MODEL_DIR))
    newest = latest_checkpoint(run)
    if newest is not None:
        found.append((int(read_trainer_state(newest)["counters"]["step"]), newest))
    if not found:
        raise ConfigError(
            f"--run-dir {run_dir!r} holds no trained model: no {FINAL_MODEL_DIR}/ and no complete checkpoint under "
            "checkpoints/ (leave --run-dir out to evaluate the config's initial model)"
        )
    step, folder = max(found, key=lambda f: (f[0], f[1].name == FINAL_MODEL_DIR))
    return PolicySource(str(folder), f"{folder.relative_to(run)} of run {run_dir} (step {step})", run)


def verifier_functions(cfg: LLMConfig) -> dict[str, rewards.RewardFn]:
    """{``rewards.functions[i]``: its function}: the verifier every completion is scored with."""
    return rewards.resolve_rewards([dataclasses.asdict(spec) for spec in cfg.rewards.functions], "rewards.functions")


def eval_config(config: str | None, overrides: list[str], policy: PolicySource) -> tuple[LLMConfig, str]:
    """(``config``, else the policy's run's saved config, else the defaults, with ``overrides``; where it came
    from): a GRPO config of single-turn completions."""
    path = config
    if path is None and policy.run_dir is not None:
        path = str(policy.run_dir / CONFIG_FILE)
        if not Path(path).is_file():
            raise ConfigError(f"--run-dir {str(policy.run_dir)!r}: no {CONFIG_FILE} (not a run directory)")
    cfg = load_config(path, overrides)
    if cfg.algo != "grpo":
        raise ConfigError(f"algo = {cfg.algo!r}: rlfabric eval evaluates language-model policies (algo: grpo)")
    source = episode_source(cfg)
    if source:
        value = dict(episode_source_fields(cfg))[source]
        raise ConfigError(
            f"{source} = {value!r}: rlfabric eval samples single-turn completions scored by rewards.functions; not "
            "episodes of a text env, an agent, a verifiers environment or an OpenEnv server"
        )
    if policy.model_dir is None:
        check_model_source(cfg.model.path)  # a missing folder or unknown hub id: one line, before anything starts
    if policy.run_dir is not None:
        point_at_run_reward_model(cfg, policy.run_dir)
    functions = verifier_functions(cfg)
    rewards.components_of(functions)  # two functions declaring one component: one line now
    cfg.rewards.weights = rewards.weights_with_defaults(cfg.rewards.weights, functions)
    return cfg, path or "the defaults"


class BestOfNEval:
    """One evaluation (see the module docstring): ``run()`` starts the actors, samples, scores and writes the
    report; ``close()`` stops the actors. Everything that can be checked is checked in the constructor."""

    def __init__(
        self,
        cfg: LLMConfig,
        policy: PolicySource,
        out_dir: str | Path,
        *,
        n: list[int],
        selectors: list[Selector],
        num_prompts: int | None = None,
        samples: int | None = None,
        correct: str = "correct",
        seed: int | None = None,
        config_source: str = "",
        progress: Callable[[str], None] | None = None,
    ) -> None:
        if not n or min(n) < 1:
            raise ConfigError(f"--n {n!r} is not valid: expected positive integers")
        self.n = sorted(set(n))
        self.m = samples if samples is not None else self.n[-1]
        if self.m < self.n[-1]:
            raise ConfigError(f"--samples {self.m} is not valid: must be >= the largest N ({self.n[-1]})")
        if num_prompts is not None and num_prompts < 1:
            raise ConfigError(f"--num-prompts {num_prompts} is not valid: must be an integer >= 1")
        if not selectors:
            raise ConfigError("--selector: at least one selector is needed")
        self.cfg, self.policy, self.out_dir = cfg, policy, Path(out_dir)
        self.selectors = check_selectors(selectors, policy.run_dir, cfg.reward_model.kind)
        self.num_prompts = num_prompts or cfg.data.num_eval
        self.correct, self.seed = correct, cfg.training.seed if seed is None else seed
        # the outcome components (a process reward's are per step, never a completion's correct)
        outcome = {k: fn for k, fn in verifier_functions(cfg).items() if not rewards.is_process_reward(fn)}
        given = rewards.components_of(outcome)
        if given is not None:  # every verifier function declares its components (@gives): know it before sampling
            rewards.check_names_given([correct], given, "--correct", "the verifier (rewards.functions)")
        self.config_source = config_source
        self.progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
        self.generators: list[Any] = []
        self.pools: dict[str, RewardPool] = {}
        self.splits: dict[str, str] = {}  # each pool's rewards.process.split
        self.decode: Callable[[Any], str] | None = None  # the evaluated model's, for cutting completions into steps
        self.earlier_report: Path | None = None  # where run() moved the report it found in the output folder

    # -- setup --------------------------------------------------------------------------------------------------

    def _model_dir(self) -> str:
        if self.policy.model_dir is not None:
            return self.policy.model_dir
        m = self.cfg.model
        if m.path != "builtin":
            return m.path
        from rlfabric.models.hf import build_small_model_dir

        b, path = m.builtin, self.out_dir / INITIAL_MODEL_DIR
        build_small_model_dir(
            path,
            seed=self.cfg.training.seed,
            **dataclasses.asdict(b),  # the builtin section's fields are the builder's arguments
        )
        return str(path)

    def _prompts(self, model_dir: str) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """The held-out rows the run evaluates on (never its training prompts) and their token ids."""
        from rlfabric.models.hf import load_tokenizer

        d, seed = self.cfg.data, self.cfg.training.seed
        train = load_prompts(d.train, num_rows=d.num_train, seed=seed, prompt_key=d.prompt_key)
        # the setting the rows came from: data.eval, or the rows of data.train that training leaves
        source = ("data.eval", d.eval) if d.eval else ("data.train", d.train)
        rows = load_heldout(
            d.eval or d.train,
            train_rows=train,
            num_rows=self.num_prompts,
            seed=seed,
            prompt_key=d.prompt_key,
            field=source[0],
            count_field="--num-prompts (default data.num_eval)",
            note=lambda line: self.progress(f"rlfabric eval: {line}"),
        )
        check_reward_columns(self.cfg, {source[0]: (source[1], rows)}, skip=[])  # as train checks them
        tokenizer = load_tokenizer(model_dir)
        self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # as the generator decodes
        named = f"{source[0]} = {source[1]!r}"
        (ids,) = encode_checked(self.cfg, tokenizer, model_dir, [(named, "held-out row", rows)])
        rows = rendered_prompts(tokenizer, rows, d.prompt_key)  # a conversational prompt as the text the model sees
        check_prompt_lengths(
            {"data.eval": ids},
            max_new_tokens=self.cfg.sampling.max_new_tokens,
            max_positions=model_max_positions(model_dir),
            model=self.cfg.model.path,
        )
        return rows, ids

    def _start(self, model_dir: str) -> None:
        g, r = self.cfg.generator, self.cfg.rewards
        pools = {VERIFIER: [dataclasses.asdict(f) for f in r.functions]}
        pools.update({s.label: [s.spec.to_dict()] for s in self.selectors if s.spec is not None})
        # where each pool's inputs are cut into steps: a selector's own split, else the training config's
        self.splits = {label: r.process.split for label in pools}
        self.splits.update({s.label: s.split for s in self.selectors if s.split is not None})
        pools = {label: [with_evaluated_policy(spec, model_dir) for spec in specs] for label, specs in pools.items()}
        requests = eval_actor_requests(self.cfg, pools)
        wanted = sum(q.count * q.resources.get("CPU", 0.0) for q in requests) + 1  # and one for this driver
        check_fits_locally(requests, fixed_local_cpus(self.cfg.ray))
        ensure_ray(self.cfg.ray, wanted, openmp_env())
        check_fits(requests, [node["Resources"] for node in ray.nodes() if node.get("Alive")])
        self.generators = [start_generator(self.cfg, model_dir, self.seed + i) for i in range(g.num_generators)]
        snapshot = rewards.snapshot()
        for label, specs in pools.items():
            self.pools[label] = RewardPool(
                specs,
                r.num_workers,
                r.timeout_s,
                r.num_cpus,
                snapshot,
                num_gpus_per_worker=r.num_gpus,
                resources=r.resources,
            )
        try:
            ray.get([gen.version.remote() for gen in self.generators], timeout=SETUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RunAbortedError(
                f"generators did not start within {SETUP_TIMEOUT_S:.0f}s: the cluster may lack the CPUs/GPUs asked "
                "for (generator.num_cpus/num_gpus)"
            ) from None

    # -- sampling and scoring -----------------------------------------------------------------------------------

    def _sample_and_score(self, rows: list[dict[str, Any]], ids: list[list[int]]) -> list[dict[str, Any]]:
        """Per prompt: its completions, their token counts and finish reasons, and each pool's results. One chunk
        is scored while the next generates."""
        s, g, m = self.cfg.sampling, self.cfg.generator, self.m
        params = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}
        if s.stop:
            params["stop"] = list(s.stop)
        policy = ServedLLMPolicy([(i, 0, h) for i, h in enumerate(self.generators)], params, g.timeout_s, m)
        chunk = max(1, g.max_batch_size * len(self.generators) // m)
        key = self.cfg.data.prompt_key
        prompts: list[dict[str, Any]] = []
        pending: tuple[list[dict[str, Any]], dict[str, Any]] | None = None
        started = time.monotonic()
        for start in range(0, len(rows), chunk):
            batch = range(start, min(start + chunk, len(rows)))
            try:
                out = policy.act([ids[i] for i in batch for _ in range(m)])
            except GeneratorsFailed as exc:
                raise RunAbortedError(f"generation failed: {exc}") from None
            entries = []
            for k, i in enumerate(batch):
                part = slice(k * m, (k + 1) * m)
                texts, finish = out.info["text"][part], out.info["finish_reason"][part]
                tokens = [len(t) for t in out.actions[part]]
                inputs = [
                    RewardInput(rows[i][key], text, row_metadata(rows[i], key), reason, count)
                    for text, reason, count in zip(texts, finish, tokens, strict=True)
                ]
                entries.append(
                    {"index": i, "prompt": rows[i][key], "inputs": inputs, "tokens": tokens, "ids": out.actions[part]}
                )
            by_split = {split: [self._with_steps(e, split) for e in entries] for split in set(self.splits.values())}
            tickets = {label: pool.submit(by_split[self.splits[label]]) for label, pool in self.pools.items()}
            if pending is not None:
                prompts += self._collect(*pending)
            pending = (entries, tickets)
            done, elapsed = batch.stop, time.monotonic() - started
            self.progress(
                f"rlfabric eval: sampled {done}/{len(rows)} prompts x {m}, scored {len(prompts)} | {elapsed:.0f}s | "
                f"ETA {format_eta(elapsed / done * (len(rows) - done))}"
            )
        if pending is not None:
            prompts += self._collect(*pending)
            self.progress(f"rlfabric eval: scored {len(prompts)}/{len(rows)} | {time.monotonic() - started:.0f}s")
        return prompts

    def _with_steps(self, entry: dict[str, Any], split: str) -> list[RewardInput]:
        """An entry's reward inputs with their steps under ``split``, cut as the rollout worker cuts them (a
        process reward scores each); ``none``: as they are."""
        if parse_split(split)[0] == "none":
            return entry["inputs"]
        assert self.decode is not None  # set with the prompts, before any sampling
        return [
            dataclasses.replace(x, steps=split_completion(ids, x.completion, self.decode, split)[0])
            for x, ids in zip(entry["inputs"], entry["ids"], strict=True)
        ]

    def _collect(self, entries: list[dict[str, Any]], tickets: dict[str, Any]) -> list[dict[str, Any]]:
        results = {label: self.pools[label].collect(ticket) for label, ticket in tickets.items()}
        for k, entry in enumerate(entries):
            entry["results"] = {label: per_group[k] for label, per_group in results.items()}
        return entries

    # -- the report ---------------------------------------------------------------------------------------------

    def _training_scores(self, verifier: list[RewardResult]) -> np.ndarray:
        """[M] the scalar reward the run trains on, from one prompt's verifier components (the weights training
        uses, ``llm_actors.reward_weights``, and ``rewards.combine``, plus the efficiency penalty when on); NaN
        where scoring failed."""
        r = self.cfg.rewards
        scored = [i for i, res in enumerate(verifier) if res.error is None]
        out = np.full(len(verifier), np.nan)
        if not scored:
            return out
        names = sorted({c for i in scored for c in verifier[i].components})
        comps = {c: np.array([verifier[i].components.get(c, 0.0) for i in scored]) for c in names}
        groups = np.zeros(len(scored), np.int64)
        c = r.combine
        bounds = {k: (float(v[0]), float(v[1])) for k, v in c.clip.items()}
        total = combine_rewards(
            comps, groups, reward_weights(self.cfg), clip=bounds, gates=c.gates, normalize=c.normalize
        ).astype(np.float64)
        e = r.efficiency
        if e.weight > 0:
            counts = sum((comps.get(name, np.zeros(len(scored))) for name in e.counts), np.zeros(len(scored)))
            success = comps.get(e.success, np.zeros(len(scored)))
            total += efficiency_penalty(counts, success, groups, weight=e.weight, apply=e.apply)
        out[scored] = total
        return out

    def _scores(self, selector: Selector, entry: dict[str, Any]) -> np.ndarray:
        if selector.spec is None:
            return self._training_scores(entry["results"][VERIFIER])
        scores = []
        for res in entry["results"][selector.label]:
            score = np.nan if res.error is not None else selector.score_of(res.components)
            if selector.aggregate is not None and res.error is None:
                score += step_aggregate(np.array(selector.step_scores(res)), selector.aggregate)
            scores.append(score)
        return np.array(scores)

    def _report(self, prompts: list[dict[str, Any]], model_dir: str, elapsed: float) -> dict[str, Any]:
        """The numbers of ``eval.json`` from the scored prompts (and ``samples.jsonl``'s rows under "samples")."""
        verdicts = [res for e in prompts for res in e["results"][VERIFIER]]
        scored = [res for res in verdicts if res.error is None]
        if not scored:
            first = next((res.error for res in verdicts), "no prompts")
            raise RunAbortedError(f"every completion failed its verifier ({first}): nothing was evaluated")
        if not any(self.correct in res.components for res in scored):
            names = sorted({c for res in scored for c in res.components})
            raise ConfigError(f"--correct {self.correct!r}: the verifier's components are {', '.join(names)}")
        correct = np.array(
            [[res.components.get(self.correct, 0.0) > 0 for res in e["results"][VERIFIER]] for e in prompts]
        )
        tokens = np.array([e["tokens"] for e in prompts])
        scores = {s.label: np.array([self._scores(s, e) for e in prompts]) for s in self.selectors}
        selectors = {}
        for sel in self.selectors:
            sc = scores[sel.label]
            selectors[sel.label] = {
                "spec": TRAINING_REWARD if sel.spec is None else sel.spec.to_dict(),
                "weights": reward_weights(self.cfg) if sel.spec is None else sel.weights,
                "failed_samples": int(np.isnan(sc).sum()),
                "best_of_n": [
                    {
                        "n": n,
                        "accuracy": _mean_best_of_n(sc, correct, n),
                        "response_tokens": _mean_best_of_n(sc, tokens, n),
                        "score": _mean_best_of_n(sc, np.nan_to_num(sc, nan=0.0), n),
                    }
                    for n in self.n
                ],
                "length_bins": length_bins(tokens.ravel(), sc.ravel(), correct.ravel()),
                "length_score_correlation": _correlation(tokens.ravel(), sc.ravel()),
            }
        s = self.cfg.sampling
        sources = data_sources([e["inputs"][0].metadata for e in prompts])
        samples = [
            {
                "prompt_index": e["index"],
                "prompt": e["prompt"],
                "completion": inp.completion,
                "response_tokens": inp.num_tokens,
                "finish_reason": inp.finish_reason,
                "correct": bool(correct[k, j]),
                "scores": {label: _finite(scores[label][k, j]) for label in scores},
                "step_scores": {
                    s.label: s.step_scores(e["results"][s.label][j]) for s in self.selectors if s.aggregate is not None
                },
                "components": e["results"][VERIFIER][j].components,
                "error": e["results"][VERIFIER][j].error,
            }
            for k, e in enumerate(prompts)
            for j, inp in enumerate(e["inputs"])
        ]
        return {
            "model": model_dir,
            "policy": self.policy.description,
            "config": self.config_source,
            "data": self.cfg.data.eval or f"held-out prompts of {self.cfg.data.train}",
            "prompts": len(prompts),
            "samples_per_prompt": self.m,
            "n": self.n,
            "sampling": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "seed": self.seed},
            "correct_component": self.correct,
            "accuracy": float(correct.mean()),
            "pass_at_n": [{"n": n, "accuracy": float(np.mean([pass_at_n(c, n) for c in correct]))} for n in self.n],
            # prompts of several data sources (a data_source column): accuracy and pass@N per source too
            "by_source": {} if sources is None else accuracy_by_source(sources, correct, self.n),
            "verifier_failed_samples": len(verdicts) - len(scored),
            "selectors": selectors,
            "time_s": round(elapsed, 2),
            "samples": samples,
        }

    def run(self) -> dict[str, Any]:
        """Sample, score, write ``eval.json``, ``samples.jsonl`` and the plots into the output folder; the report."""
        started = time.monotonic()
        # the outermost folder this evaluation creates: it holds a builtin model and nothing else until the report
        created = next((p for p in reversed([self.out_dir, *self.out_dir.parents]) if not p.exists()), None)
        try:
            return self._run(started)
        except BaseException:
            if created is not None:  # a failed evaluation leaves no folder behind
                shutil.rmtree(created, ignore_errors=True)
            raise

    def _run(self, started: float) -> dict[str, Any]:
        from rlfabric.eval_report import plot_best_of_n, plot_reward_vs_length

        model_dir = self._model_dir()
        rows, ids = self._prompts(model_dir)
        self.progress(f"rlfabric eval: {self.policy.description}: {len(rows)} prompts x {self.m} completions")
        if self.cfg.sampling.temperature == 0 and self.m > 1:
            self.progress("rlfabric eval: sampling.temperature = 0 (greedy): every completion of a prompt is the same")
        self._start(model_dir)
        report = self._report(self._sample_and_score(rows, ids), model_dir, time.monotonic() - started)
        samples = report.pop("samples")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.earlier_report = keep_earlier_report(self.out_dir)  # moved, not written over
        with open(self.out_dir / SAMPLES_FILE, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in samples)
        report["files"] = {
            "samples": str(self.out_dir / SAMPLES_FILE),
            "best_of_n_plot": str(plot_best_of_n(report, self.out_dir / N_PLOT)),
            "length_plot": str(plot_reward_vs_length(report, samples, self.out_dir / LENGTH_PLOT)),
        }
        (self.out_dir / EVAL_FILE).write_text(json.dumps(report, indent=2) + "\n")
        return report

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown()
        if self.generators:  # ray.get([]) would start Ray for an evaluation that stopped before it
            try:  # engines stop their schedulers before the processes go
                ray.get([gen.shutdown.remote() for gen in self.generators], timeout=10)
            except Exception:  # a dead or stuck generator is killed below either way
                pass
        for gen in self.generators:
            ray.kill(gen, no_restart=True)
        self.pools, self.generators = {}, []


def keep_earlier_report(out_dir: Path) -> Path | None:
    """Move the report an earlier evaluation left in ``out_dir`` (``REPORT_FILES``) into the first free
    ``<out_dir>-<k>`` beside it (k = 1, 2, ...: the lower, the older), its ``eval.json``'s ``files`` pointing there;
    the folder it went to, None when there was none. Folders in ``out_dir`` (a checkpoint's reports in
    ``RUN_DIR/eval/<checkpoint>/``, a builtin initial model) stay."""
    found = [out_dir / name for name in REPORT_FILES if (out_dir / name).is_file()]
    if not found:
        return None
    base = out_dir if out_dir.name else out_dir.resolve()  # "--out ." has no name to number
    k = 1
    while (kept := base.with_name(f"{base.name}-{k}")).exists():
        k += 1
    kept.mkdir(parents=True)
    for path in found:
        os.replace(path, kept / path.name)
    try:
        report = json.loads((kept / EVAL_FILE).read_text())
        files = report["files"]
        files.update(
            {key: str(kept / Path(value).name) for key, value in files.items() if Path(value).parent == out_dir}
        )
        (kept / EVAL_FILE).write_text(json.dumps(report, indent=2) + "\n")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # not a report of this command's (or no eval.json): moved as it was
    return kept


def _mean_best_of_n(scores: np.ndarray, values: np.ndarray, n: int) -> float:
    """[K, M] scores and values of K prompts' completions: the mean over prompts of ``best_of_n``."""
    return float(np.mean([best_of_n(s, v, n) for s, v in zip(scores, values, strict=True)]))


def _finite(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


def _correlation(x: np.ndarray, y: np.ndarray) -> float | None:
    """Pearson's r over the scored samples; None when either side is constant."""
    keep = ~np.isnan(y)
    x, y = np.asarray(x, np.float64)[keep], y[keep]
    if x.size < 2 or x.std() == 0 or y.std() == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])
