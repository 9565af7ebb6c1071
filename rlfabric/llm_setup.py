"""Starting a GRPO run: the model it begins from, a reward model it trains first, its prompts, Ray, and its actors.

``GRPOSetup`` holds the setup half of ``rlfabric.llm_driver.GRPOTrainer`` (which subclasses it): everything that
runs once before the first step, in order: the run log, the model (built or a checkpoint's), the reward model stage,
the data (checked against the model's context before Ray starts), Ray and the cluster's room, the placement
groups, episode sources that need Ray, tool servers, generators, learners, reference, likelihood scorers and the
rollout worker, then the weights' transport and, on resume, the checkpoint's optimizer and policy version. It reads
and sets the trainer's attributes (``cfg``, ``run_dir``, ``rollouts``, ``weights``, ``scorers``, ``episodes``,
``counters``) made in ``GRPOTrainer.__init__``.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import ray

from rlfabric import objectives, rewards
from rlfabric.actor_slots import ActorSlots, RunAbortedError
from rlfabric.actors.llm_rollout import PromptSet
from rlfabric.config import ConfigError
from rlfabric.data import (
    PROMPT_FIELDS,
    TASK_FIELDS,
    check_prompt_lengths,
    is_conversation,
    load_heldout,
    load_prompts,
)
from rlfabric.grpo_config import LLMConfig, plays_episodes
from rlfabric.llm_actors import (
    actor_requests,
    generator_resources,
    start_generator,
    start_learners,
    start_reference,
    start_rollout_worker,
    wanted_cpus,
)
from rlfabric.llm_episode_sources import needs_ray, sources_after_ray, sources_before_ray
from rlfabric.llm_resources import SETUP_TIMEOUT_S, openmp_env
from rlfabric.llm_run_state import INITIAL_MODEL_DIR, not_final, read_trainer_state
from rlfabric.llm_sft import check_answer_column, check_answer_spelling
from rlfabric.llm_text_env import rows_spelling_error, start_tool_servers
from rlfabric.models.chat_tokens import UnspellableText, spelled
from rlfabric.models.hf import (
    TOKENIZER_FILES,
    encode_prompt,
    has_chat_template,
    lacks_tokenizer_files,
    model_max_positions,
    model_vocab_size,
    render_prompt,
)
from rlfabric.placement import RoleGroups, check_fits, check_fits_locally, record_plan
from rlfabric.ray_connect import ensure_ray, fixed_local_cpus
from rlfabric.reward_model_stage import REWARD_MODEL_DIR, ensure_reward_model
from rlfabric.rewards.builtin import column_fix, columns_read
from rlfabric.run.log import RunLog
from rlfabric.run.paths import local_path
from rlfabric.run.progress import tensorboard_view

# What a model folder without tokenizer files is told (``{probably}``: how sure the error can be that this is why).
NO_TOKENIZER_FILES = (
    f"the folder has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...):{{probably}} save the model's "
    "tokenizer there (tokenizer.save_pretrained(folder))"
)


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """The user's text of a prompt, checked for characters the tokenizer cannot spell: a string, or the contents of
    a conversational prompt's messages, one a line."""
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def encode_prompts(
    cfg: LLMConfig, tokenizer: Any, rows: list[dict[str, Any]], source: str, row_name: str, model_dir: str
) -> list[list[int]]:
    """The prompts of ``rows`` (read from ``source``, a data setting and its value) as token ids; prompts the
    tokenizer cannot spell are one ConfigError naming every character they lack and the first such row, and a
    prompt that encodes to no tokens is one naming ``model.path`` (``model_dir``: the folder its tokenizer is in)."""
    d, ids, failed = cfg.data, [], []
    for i, row in enumerate(rows):
        prompt = row[d.prompt_key]
        try:
            ids.append(
                spelled(tokenizer, prompt_text(prompt), partial(encode_prompt, tokenizer, prompt, d.chat_template))
            )
        except UnspellableText as exc:
            failed.append((f"{row_name} {i}", exc))
    if failed:
        raise rows_spelling_error(cfg, source, d.prompt_key, failed)
    empty = next((i for i, prompt_ids in enumerate(ids) if not prompt_ids), None)
    if empty is None:
        return ids
    if not prompt_text(rows[empty][d.prompt_key]).strip():
        raise ConfigError(f"{source}: {row_name} {empty}'s prompt is empty: fill it in or drop the row")
    if lacks_tokenizer_files(model_dir):
        why = NO_TOKENIZER_FILES.format(probably=" the tokenizer is probably missing from it;")
    else:
        why = "its tokenizer turns the text into nothing: is it the model's own tokenizer?"
    raise ConfigError(
        f"model.path = {cfg.model.path!r}: the prompt of {source} ({row_name} {empty}) encodes to no tokens; {why}"
    )


def check_chat_template(
    cfg: LLMConfig, tokenizer: Any, model_dir: str, sources: Sequence[tuple[str, str, list[dict[str, Any]]]]
) -> None:
    """Before Ray: prompts shown through the tokenizer's chat template (every prompt with ``data.chat_template``, a
    conversational one always) need the tokenizer to have one; ``sources``: (a data setting and its value, what its
    rows are called, the rows) for each set of rows read."""
    if has_chat_template(tokenizer):
        return
    d = cfg.data
    if d.chat_template:
        why = "data.chat_template is true"
        instead = "set data.chat_template: false to prompt with the text alone"
    else:
        found = (
            (source, f"{name} {i}")
            for source, name, rows in sources
            for i, row in enumerate(rows)
            if is_conversation(row[d.prompt_key])
        )
        first = next(found, None)
        if first is None:
            return
        source, row = first
        why = f"the prompts of {source} are chat messages ({row}'s {d.prompt_key!r} is a list), shown through one"
        instead = "give string prompts"
    if lacks_tokenizer_files(model_dir):
        fix = NO_TOKENIZER_FILES.format(probably="")
    else:
        fix = (
            "use a model whose tokenizer has one (an instruct or chat model), add one to the tokenizer "
            f"(tokenizer.chat_template, saved with the model), or {instead}"
        )
    raise ConfigError(f"model.path = {cfg.model.path!r}: its tokenizer has no chat template, and {why}: {fix}")


def check_prompt_ids(
    cfg: LLMConfig, tokenizer: Any, model_dir: str, encoded: Sequence[tuple[str, str, list[list[int]]]]
) -> None:
    """Before Ray: every prompt token id is one the model embeds (below its config's ``vocab_size``); ``encoded``:
    (a data setting and its value, what its rows are called, their prompts' ids) for each set of rows read."""
    vocab = model_vocab_size(model_dir)
    if vocab is None:
        return
    for source, row_name, ids in encoded:
        row = next((i for i, prompt_ids in enumerate(ids) if prompt_ids and max(prompt_ids) >= vocab), None)
        if row is not None:
            raise ConfigError(
                f"model.path = {cfg.model.path!r}: its tokenizer ({len(tokenizer)} tokens) does not fit the model, "
                f"whose vocab_size is {vocab} (config.json): the prompt of {source} ({row_name} {row}) has token id "
                f"{max(ids[row])}; use the tokenizer the model was trained with"
            )


def encode_checked(
    cfg: LLMConfig, tokenizer: Any, model_dir: str, sources: Sequence[tuple[str, str, list[dict[str, Any]]]]
) -> list[list[list[int]]]:
    """The prompts' token ids of each of ``sources`` ((a data setting and its value, what its rows are called, the
    rows)), after the chat template's check and before the ids' (``check_chat_template``, ``encode_prompts``,
    ``check_prompt_ids``): what a run and ``rlfabric eval`` check of their prompts before Ray."""
    check_chat_template(cfg, tokenizer, model_dir, sources)
    ids = [encode_prompts(cfg, tokenizer, rows, source, row_name, model_dir) for source, row_name, rows in sources]
    encoded = [(source, name, prompt_ids) for (source, name, _), prompt_ids in zip(sources, ids, strict=True)]
    check_prompt_ids(cfg, tokenizer, model_dir, encoded)
    return ids


def rendered_prompts(tokenizer: Any, rows: list[dict[str, Any]], prompt_key: str) -> list[dict[str, Any]]:
    """``rows`` with each conversational prompt replaced by the text its chat template renders (the text the model
    is prompted with): what the reward functions receive as the prompt and samples.jsonl shows."""
    return [
        {**row, prompt_key: render_prompt(tokenizer, row[prompt_key], True)}
        if is_conversation(row[prompt_key])
        else row
        for row in rows
    ]


def check_reward_columns(cfg: LLMConfig, sources: dict[str, tuple[str, list[dict[str, Any]]]], skip: list[int]) -> None:
    """Before Ray: each column a reward reads (a builtin's ``answer_key``: ``rewards.builtin.columns_read``) is a column
    of the rows of each of ``sources`` ({setting: (its value, its rows)}), and a reward's ``check_row`` passes their
    first row; ``skip``: indices of rewards.functions not resolvable yet (the run's own reward model)."""
    prompt_key = cfg.data.prompt_key
    for field, specs in (
        ("rewards.functions", cfg.rewards.functions),
        ("rewards.shadow.functions", cfg.rewards.shadow.functions),
    ):
        for i, spec in enumerate(specs):
            if field == "rewards.functions" and i in skip:
                continue
            fn = rewards.resolve_reward(dataclasses.asdict(spec), f"{field}[{i}]")
            check_row = getattr(fn, "check_row", None)  # the reward's own look at a row (rlfabric.rewards)
            for setting, (value, rows) in sources.items():
                if check_row is None or not rows:
                    continue
                try:
                    check_row({k: v for k, v in rows[0].items() if k != prompt_key})
                except (KeyError, ValueError) as exc:
                    why = exc.args[0] if exc.args else repr(exc)
                    raise ConfigError(
                        f"{field}[{i}] = {spec.name!r} is not valid for {setting} = {value!r}: {why}"
                    ) from None
            for kwarg, column in columns_read(fn).items():
                for setting, (value, rows) in sources.items():
                    # a file's rows share their columns (a task's too); metadata is the row less its prompt
                    if rows and (column not in rows[0] or column == prompt_key):
                        others = [c for c in rows[0] if c != prompt_key]
                        raise ConfigError(
                            f"{field}[{i}] = {spec.name!r} is not valid for {setting} = {value!r}: it reads "
                            f"metadata[{column!r}] (the column its kwargs {kwarg} names), which the rows lack; "
                            f"{column_fix(kwarg, others)}"
                        )


class GRPOSetup:
    """The once-per-run setup of a GRPO trainer (see the module docstring); ``setup`` runs it."""

    def _model_dir(self, build: bool = True) -> str:
        """The model the run starts from: ``model.path``, or the builtin model (built here when ``build``)."""
        m = self.cfg.model
        if m.path != "builtin":
            local = local_path(m.path)  # absolute for the actors, whose working directory may not be this one
            return str(local) if local is not None else m.path
        from rlfabric.models.hf import build_small_model_dir

        b = m.builtin
        path = self.run_dir / INITIAL_MODEL_DIR
        if not build:
            return str(path)
        build_small_model_dir(
            path,
            seed=self.cfg.training.seed,
            **dataclasses.asdict(b),  # the builtin section's fields are the builder's arguments
        )
        return str(path)

    def _train_reward_model(self) -> None:
        """The reward model of ``reward_model.pairs``, trained before any actor starts (kept on resume); its rows
        go to metrics.jsonl as phases ``rm_lm``, ``rm`` and ``rm_eval``."""
        assert self.log is not None
        log = self.log
        folder = ensure_reward_model(
            self.cfg, self.run_dir, self.tokenizer, lambda row: log.log({"iteration": 0, "step": 0, **row})
        )
        if folder is not None:
            log.note(f"reward model ready: {folder}")
        for i in self.trained_reward_specs:
            rewards.resolve_reward(dataclasses.asdict(self.cfg.rewards.functions[i]), f"rewards.functions[{i}]")

    def _read_rows(self) -> None:
        """The train and held-out rows (no tokenizer needed): a data error is one line before the run writes
        anything."""
        d, seed, cfg = self.cfg.data, self.cfg.training.seed, self.cfg
        self.data_notes: list[str] = []  # said once the run log exists
        if cfg.env.verifiers.id:  # the environment's own rows, read from its actor once Ray runs
            self.train_rows, self.eval_rows = [], []
            return
        # data.eval '': the held-out rows are the file's rows training leaves, so a short file is split between them
        keep_out = 0 if d.eval else (d.num_eval or 0)
        fields = TASK_FIELDS if plays_episodes(cfg) else PROMPT_FIELDS  # a text env's reset writes the prompt
        self.train_rows = load_prompts(
            d.train,
            num_rows=d.num_train,
            seed=seed,
            prompt_key=d.prompt_key,
            keep_out=keep_out,
            fields=fields,
            note=self.data_notes.append,
        )
        if not self.train_rows:
            raise ConfigError(f"data.train = {d.train!r}: holds no prompts")
        self.eval_rows = load_heldout(
            d.eval or d.train,
            train_rows=self.train_rows,
            num_rows=d.num_eval,
            seed=seed,
            prompt_key=d.prompt_key,
            field="data.eval" if d.eval else "data.train",  # the setting whose value is the spec read
            fields=fields,
            note=self.data_notes.append,
        )
        self.rollouts.num_train_prompts = len(self.train_rows)

    def _encode_prompts(self) -> None:
        """The rows' prompts as token ids, checked against the model's context; a text env or agent checked on
        its first task."""
        d, cfg = self.cfg.data, self.cfg
        if cfg.env.verifiers.id:
            return
        context = model_max_positions(self.model_dir)
        if plays_episodes(cfg):  # task rows: the env's reset or the agent writes the prompts
            if not needs_ray(cfg):
                self.episodes = sources_before_ray(cfg, self.tokenizer, self.model_dir, self.train_rows[0], context)
            self.train_ids, self.eval_ids = [[] for _ in self.train_rows], [[] for _ in self.eval_rows]
            return
        train = f"data.train = {d.train!r}"
        # numbered as held-out rows: with data.eval '' they are the rows of data.train that training leaves
        heldout = f"data.eval = {d.eval!r}" if d.eval else train
        rows = [(train, "row", self.train_rows), (heldout, "held-out row", self.eval_rows)]
        self.train_ids, self.eval_ids = encode_checked(cfg, self.tokenizer, self.model_dir, rows)
        # from here on a conversational prompt is the text the model sees: the rewards' prompt, samples.jsonl's
        self.train_rows = rendered_prompts(self.tokenizer, self.train_rows, d.prompt_key)
        self.eval_rows = rendered_prompts(self.tokenizer, self.eval_rows, d.prompt_key)
        check_prompt_lengths(  # prompts that cannot fit the model's context fail here, not in a generator
            {"data.train": self.train_ids, "data.eval": self.eval_ids},
            max_new_tokens=cfg.sampling.max_new_tokens,
            max_positions=context,
            model=cfg.model.path,
        )

    def _check_columns(self) -> None:
        """The columns the rewards and the warm-up read from the rows read before Ray (after the prompts' own
        checks), and the warm-up's demonstrations spelled by the tokenizer."""
        d, cfg = self.cfg.data, self.cfg
        sources = {"data.train": (d.train, self.train_rows)}
        if d.eval:  # else the eval rows are data.train's, columns and all
            sources["data.eval"] = (d.eval, self.eval_rows)
        check_reward_columns(cfg, sources, skip=self.trained_reward_specs)
        # the warm-up reads sft.answer_key (a text env's or agent's from its player); a resumed run is past it
        if self.resume_from is None and cfg.sft.steps and not plays_episodes(cfg) and self.train_rows:
            check_answer_column(cfg, d.train, self.train_rows)
            check_answer_spelling(cfg, self.tokenizer, d.train, self.train_rows)

    def _sources_after_ray(self) -> None:
        """A verifiers environment or an OpenEnv server (``rlfabric.llm_episode_sources``): its actor runs in
        packages of its own, so it is set up once Ray runs, before any other actor starts."""
        context = model_max_positions(self.model_dir)
        self.episodes = sources_after_ray(self.cfg, self.tokenizer, self.model_dir, self.train_rows, context)
        if self.episodes.verifiers is not None:  # its rows are the run's
            self.train_rows, self.eval_rows = self.episodes.verifiers.train_rows, self.episodes.verifiers.eval_rows
            self.rollouts.num_train_prompts = len(self.train_rows)
            self.train_ids, self.eval_ids = [[] for _ in self.train_rows], [[] for _ in self.eval_rows]

    def _sampling_seed(self) -> int:
        """The generators' sampling seed: the run's, moved on by the policy version, so a resumed run does not
        replay the random draws its first session began with."""
        return self.cfg.training.seed + self.version

    def _setup_before_ray(self) -> dict[str, Any] | None:
        """The run's folder, metrics and model; the prompts encoded and checked; the reward model trained. Returns
        the checkpoint's trainer state on resume (None for a new run)."""
        from rlfabric.models.hf import load_tokenizer

        self.run_dir.mkdir(parents=True, exist_ok=True)
        state = read_trainer_state(self.resume_from) if self.resume_from else None
        self.log = RunLog(
            self.run_dir,
            self.cfg,
            resume_at=state["counters"]["step"] if state else None,
            quiet=self.quiet,
            step_key="step",
            progress_line=self._progress_line,
            relabel=not_final,
            tensorboard_view=tensorboard_view,
        )
        for line in getattr(self, "data_notes", []):  # e.g. held-out rows left out of data.eval's file
            self.log.note(line)
        # Generators start from the run's first model and then take published weights; a resumed run's learners
        # start from the checkpoint (a Hugging Face model folder), which may be pruned later.
        self.base_model_dir = self._model_dir(build=state is None)
        if state:
            self.model_dir = str(self.resume_from)
            self._restore(state)
        else:
            self.model_dir = self.base_model_dir
            self.reference_dir = self.model_dir
        self.tokenizer = load_tokenizer(self.model_dir)
        self._encode_prompts()
        self._check_columns()
        self._train_reward_model()
        return state

    def setup(self) -> None:
        self._read_rows()
        # the outermost folder this run creates, removed again if setup stops on bad input (nothing trained yet)
        created = next((p for p in reversed([self.run_dir, *self.run_dir.parents]) if not p.exists()), None)
        try:
            self._start_actors(self._setup_before_ray())
        except ConfigError:
            if self.log is not None:
                self.log.close()
                self.log = None
            if created is not None and not (self.run_dir / REWARD_MODEL_DIR / "config.json").is_file():
                shutil.rmtree(created, ignore_errors=True)  # kept where a reward model was trained: it is reused
            raise

    def _start_actors(self, state: dict[str, Any] | None) -> None:
        """Ray, then every actor of the run (an env, agent or server found bad on the way is a ConfigError);
        ``state``: the checkpoint's trainer state when resuming."""
        # the user's additions to the advantage estimators and losses, for every actor that resolves them (one
        # that does not load is said here, before Ray starts)
        self.parts = objectives.snapshot()
        check_fits_locally(actor_requests(self.cfg), fixed_local_cpus(self.cfg.ray))
        ensure_ray(self.cfg.ray, wanted_cpus(self.cfg), openmp_env())
        check_fits(actor_requests(self.cfg), [n["Resources"] for n in ray.nodes() if n.get("Alive")])
        groups = self.role_groups = RoleGroups(actor_requests(self.cfg), self.cfg.ray.placement, SETUP_TIMEOUT_S)
        if needs_ray(self.cfg):
            self._sources_after_ray()
        if self.episodes.text_env is not None and self.cfg.env.tool_servers:
            e = self.episodes
            self.tool_servers = start_tool_servers(self.cfg.env.tool_servers, e.text_env, e.demonstrations)
        self.generators = ActorSlots(
            "generator",
            lambda slot, generation: start_generator(
                self.cfg, self.base_model_dir, self._sampling_seed(), groups.options("generator", slot)
            ),
            self.cfg.generator.num_generators,
            resources=generator_resources(self.cfg),
            placement_wait_s=self.cfg.generator.timeout_s,
        )
        self.learners = start_learners(
            self.cfg, self.model_dir, self.reference_dir, partial(groups.options, "learner"), self.parts
        )
        reference_placement = groups.options("learner", self.cfg.learner.num_learners)
        self.reference = start_reference(
            self.cfg, self.reference_dir, self.tokenizer.pad_token_id, reference_placement, self.parts
        )
        self.scorers.start(self.base_model_dir)  # like the generators: the first model, then every published version
        self.rollouts.prompt_refs = {
            "train": ray.put(PromptSet(self.train_rows, self.train_ids)),
            "eval": ray.put(PromptSet(self.eval_rows, self.eval_ids)),
        }
        self.rollout_workers = ActorSlots("rollout worker", lambda slot, generation: self._start_rollout_worker(), 1)
        self.rollouts.attach(self.generators, self.rollout_workers)
        try:  # every actor answers before the clock starts, or setup names the one that did not
            ray.get([g.version.remote() for g in self.generators.handles], timeout=SETUP_TIMEOUT_S)
            ray.get([w.pid.remote() for w in self.rollout_workers.handles], timeout=SETUP_TIMEOUT_S)
            ray.get([ln.get_version.remote() for ln in self.learners], timeout=SETUP_TIMEOUT_S)
            ray.get([s.version.remote() for s in self.scorers.handles], timeout=SETUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RunAbortedError(
                f"actors did not start within {SETUP_TIMEOUT_S:.0f}s: the cluster may lack the CPUs/GPUs asked "
                "for (generator.num_cpus/num_gpus, learner.num_cpus/num_gpus)"
            ) from None
        actors = {"generator": self.generators.handles, "rollout worker": self.rollout_workers.handles}
        if "rewards" in self.cfg.ray.placement:  # else not waited for: a reward model may still be loading
            worker = self.rollout_workers.handles[0]
            actors["rewards"] = ray.get(worker.reward_workers.remote(), timeout=SETUP_TIMEOUT_S)
        placed, strategies = {**actors, "learner": self.learners}, dict(self.cfg.ray.placement)
        if self.reference is not None:  # in the learners' group, after them
            placed["reference"] = [self.reference]
            strategies["reference"] = strategies.get("learner")
        for line in record_plan(self.run_dir, placed, strategies):
            self.log.note(f"placement: {line}")
        self.weights.attach(self.learners[0], self.generators, self.reference, self.scorers.slots)
        self.weights.choose_transport()
        self._note_slow_attention()
        if state:
            assert self.resume_from is not None
            ray.get([ln.load_optimizer.remote(str(self.resume_from)) for ln in self.learners])
            self.version = self.weights.publish()  # the generators take the checkpoint's policy version
            self.log.note(f"resumed from {self.resume_from.name} (step {self.counters.step}, v{self.version})")
        self._start = time.monotonic() - self._elapsed_before  # times and rates count every session

    def _start_rollout_worker(self) -> Any:
        worker = start_rollout_worker(
            self.cfg,
            self.episodes.text_env,
            self.scorers.reward_name,
            model_dir=self.base_model_dir,
            agent=self.episodes.agent,
            reward_placement=partial(self.role_groups.options, "rewards") if self.role_groups else None,
            parts=self.parts,
        )
        self.rollouts.load_prompts_into(worker)
        return worker
