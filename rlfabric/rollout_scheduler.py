"""Which prompts go out to the rollout worker, and which scored groups come back to train on.

The driver's side of the rollout layer: it draws prompt indices from a shuffled order, sends them as
``RolloutRequest``s with a deadline, receives the small metadata (the record stays in the object store), asks a
failed request again exactly once (with the same prompts and group ids) after replacing what failed, and chooses
groups from the per-group statistics alone: staleness against ``training.max_policy_lag``, dynamic sampling and
its refill rounds. A record lost with its node before the learners read it is collected again the same way.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from rlfabric.actor_slots import ActorSlots, error_kind, error_summary
from rlfabric.actors.llm_rollout import RolloutRequest
from rlfabric.actors.rollout_meta import decode_meta
from rlfabric.grpo_config import LLMConfig, plays_episodes
from rlfabric.llm_resources import SETUP_TIMEOUT_S
from rlfabric.llm_run_state import Counters
from rlfabric.policies.served import PendingWeights

REWARD_GRACE_S = 30.0  # the reward pool's slack per call, for starting a replacement service and transfers
# Tries of one rollout before its samples count as failed: a replaced actor's retry may meet another fault,
# while an actor slot that keeps failing stops the run (ActorSlots' limit) long before a rollout loops.
ROLLOUT_ATTEMPTS = 3
# Steps in a row whose every trained group had equal rewards before the run says its policy gradient is zero.
FLAT_STEPS_NOTED = 3


@dataclass
class Pending:
    """A rollout request in flight on a rollout worker."""

    request: RolloutRequest  # its indices are put back in the prompt order when a checkpoint is taken
    meta_ref: ray.ObjectRef
    data_ref: ray.ObjectRef
    attempt: int  # 0, then 1, 2 for the retries after a generator or rollout worker failed
    worker_slot: int
    worker_generation: int
    deadline: float  # time.monotonic() by which the worker must have answered


@dataclass
class StepBatch:
    """What one step trains on: record refs and the chosen groups, plus every scored rollout's metadata."""

    refs: list[ray.ObjectRef] = field(default_factory=list)
    groups: list[tuple[int, int, int]] = field(default_factory=list)  # (group id, rows, oldest policy version)
    scored: list[dict[str, Any]] = field(default_factory=list)
    # the request and metadata of each record in refs: a record lost with its node is asked for again
    sources: list[tuple[RolloutRequest, dict[str, Any]]] = field(default_factory=list)
    recollected: int = 0  # records of this step collected again
    flat_groups: int = 0  # chosen groups whose samples all got the same reward: zero advantage, no policy gradient


class RolloutScheduler:
    """Sends rollouts and chooses what to train on; see the module docstring.

    ``fetch`` is the driver's ``ray.get`` (it counts the bytes received), ``add_to_step`` adds to the current
    step's measures, ``note`` prints one line, ``replace_generator(slot, generation, reason)`` replaces a failed
    generator (and gives the new one the weights), and ``version()`` is the current policy version.
    """

    def __init__(
        self,
        cfg: LLMConfig,
        counters: Counters,
        rng: np.random.Generator,
        *,
        fetch: Callable[..., Any],
        add_to_step: Callable[[str, float], None],
        note: Callable[[str], None],
        replace_generator: Callable[[int, int, str], None],
        version: Callable[[], int],
    ) -> None:
        self.cfg, self.counters, self.rng = cfg, counters, rng
        self._fetch, self._add_to_step, self._note = fetch, add_to_step, note
        self._replace_generator, self._version = replace_generator, version
        self.generators: ActorSlots | None = None
        self.workers: ActorSlots | None = None
        self.prompt_refs: dict[str, ray.ObjectRef] = {}  # prompt set name -> PromptSet in the object store
        self.num_train_prompts = 0
        self.order: list[int] = []  # train prompt indices still to draw this pass (drawn from the end)
        self.group_counter = 0  # the next group id
        self.in_flight: deque[Pending] = deque()  # rollouts generating ahead (max_policy_lag > 0)
        self.errors_seen: set[str] = set()  # reward errors and worker replacements already printed
        self.flat_steps = 0  # steps in a row whose every chosen group had equal rewards
        self.flat_noted = False  # said once a run: a later streak is the same advice again

    def attach(self, generators: ActorSlots, workers: ActorSlots) -> None:
        self.generators, self.workers = generators, workers

    def load_prompts_into(self, worker: Any) -> None:
        """Give a (new) rollout worker the prompt sets, and wait until it holds them: the worker runs calls on
        several threads, so a rollout sent right behind ``set_prompts`` could start before its prompts arrive."""
        loaded = [worker.set_prompts.remote(name, ref) for name, ref in self.prompt_refs.items()]
        ray.get(loaded, timeout=SETUP_TIMEOUT_S)

    # -- prompts and requests ---------------------------------------------------------------------------------

    def sample_rows(self, k: int) -> list[int]:
        """k train prompt indices: passes over a shuffled order, reshuffled each pass."""
        out = []
        while len(out) < k:
            if not self.order:
                self.order = list(self.rng.permutation(self.num_train_prompts))
            out.append(int(self.order.pop()))
        return out

    def sampling_params(self, greedy: bool) -> dict[str, Any]:
        s = self.cfg.sampling
        common = {"max_new_tokens": s.max_new_tokens, **({"stop": list(s.stop)} if s.stop else {})}
        if greedy:
            return {**common, "temperature": 0.0}
        return {**common, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}

    def _deadline(self, request: RolloutRequest) -> float:
        """The backstop for a rollout worker's answer: generation, then scoring every group twice (a reward worker
        that dies has its groups scored again on its replacement), plus slack."""
        groups = len(request.indices)
        return request.timeout_s + 2 * (self.cfg.rewards.timeout_s * groups + 2 * REWARD_GRACE_S)

    def send(self, request: RolloutRequest, attempt: int = 0) -> Pending:
        assert self.workers is not None and self.generators is not None
        slot, generation, worker = self.workers.entries()[0]
        request.generators = self.generators.entries()
        meta_ref, data_ref = worker.rollout.remote(request)
        deadline = time.monotonic() + self._deadline(request)
        return Pending(request, meta_ref, data_ref, attempt, slot, generation, deadline)

    def submit(self, num_prompts: int, after: PendingWeights | None = None) -> Pending:
        """A train rollout of ``num_prompts`` prompts, each ``grpo.group_size`` times, with fresh group ids;
        ``after``: the weights it must be generated with, when they are still to be loaded."""
        indices = self.sample_rows(num_prompts)
        request = RolloutRequest(
            "train",
            indices,
            self.cfg.grpo.group_size,
            self.sampling_params(False),
            first_group=self.group_counter,
            generators=[],
            timeout_s=self.cfg.generator.timeout_s,
            after=after,
        )
        self.group_counter += len(indices)
        return self.send(request)

    def fill(self, after: PendingWeights | None = None) -> None:
        """Keep the pipeline as deep as the lag allows: 1 + ``training.max_policy_lag`` rollouts in flight.

        ``after``: in sync mode, the next step's rollout is sent while the learner trains the weights it needs; its
        generators start on it the moment they have loaded them (``weights_landed`` then restarts its deadline)."""
        while len(self.in_flight) < 1 + self.cfg.training.max_policy_lag:
            self.in_flight.append(self.submit(self.cfg.grpo.prompts_per_step, after))

    def weights_landed(self) -> None:
        """The weights the rollouts in flight were waiting for are loaded: their deadlines count from now, and a
        retry sends them without the wait."""
        for pending in self.in_flight:
            if pending.request.after is not None:
                pending.request.after = None
                pending.deadline = time.monotonic() + self._deadline(pending.request)

    def cancel_in_flight(self) -> None:
        """Drop the rollouts generated ahead for steps that will not run."""
        for pending in self.in_flight:
            ray.cancel(pending.meta_ref, force=False)
        self.in_flight.clear()

    def prompts_ahead(self) -> list[int]:
        """The prompts taken from the order for rollouts in flight, in the order a resumed run takes them again."""
        return [i for pending in reversed(self.in_flight) for i in reversed(pending.request.indices)]

    # -- answers ----------------------------------------------------------------------------------------------

    def _replace_worker(self, slot: int, generation: int, reason: str) -> None:
        assert self.workers is not None
        if self.workers.replace(slot, generation, reason):  # the new worker got the prompts as it started
            self.counters.rollout_worker_restarts += 1
            self._note(f"rollout worker {slot} replaced ({reason})")

    def receive(self, pending: Pending) -> tuple[dict[str, Any], ray.ObjectRef | None]:
        """A rollout's metadata and record ref. A failed generator or rollout worker is replaced and the rollout
        asked again, up to ``ROLLOUT_ATTEMPTS`` times in all (a second fault, of another actor, may hit the retry
        of the first); when the last attempt fails too, its samples are recorded as failed (empty metadata)."""
        assert self.workers is not None and self.generators is not None
        request = pending.request
        try:
            meta = decode_meta(self._fetch(pending.meta_ref, timeout=max(0.0, pending.deadline - time.monotonic())))
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as exc:
            reason = "missed its deadline" if isinstance(exc, ray.exceptions.GetTimeoutError) else error_summary(exc)
            self._replace_worker(pending.worker_slot, pending.worker_generation, reason)
            meta = {"samples": len(request.indices) * request.group_size, "worker_failure": reason}
        else:
            self.workers.succeeded(pending.worker_slot, pending.worker_generation)
        for replaced in meta.get("reward_replaced", []):  # every rollout's, evaluations' and retried ones' too
            if replaced not in self.errors_seen:  # a worker poisoned by each call's hung group: said once
                self.errors_seen.add(replaced)
                self._note(replaced)
        for slot, generation, reason in meta.get("generator_failures", []):
            self._replace_generator(slot, generation, reason)
        if "generator_failures" not in meta and "worker_failure" not in meta:
            for slot, generation, _ in request.generators:
                self.generators.succeeded(slot, generation)
            return meta, pending.data_ref
        if pending.attempt + 1 < ROLLOUT_ATTEMPTS:  # requeued with the same prompts and group ids
            self.counters.resampled_samples += len(request.indices) * request.group_size
            return self.receive(self.send(request, attempt=pending.attempt + 1))
        lost = len(request.indices) * request.group_size
        self.counters.failed_samples += lost
        why = meta.get("worker_failure") or "; ".join(reason for *_, reason in meta.get("generator_failures", []))
        self._note(f"{lost} samples lost: their rollout failed {ROLLOUT_ATTEMPTS} times (last: {why})")
        return {"samples": lost, "rows": 0, "failed": lost, "tokens": 0}, None

    def note_reward_error(self, error: str) -> None:
        """The first error of each kind (``error_kind``), as it happens (later ones of that kind are counted, not
        printed)."""
        kind = error_kind(error)
        if kind not in self.errors_seen:
            self.errors_seen.add(kind)
            what = "episode" if plays_episodes(self.cfg) else "reward"  # what failed the sample
            self._note(f"{what} failed: {error} (the first of its kind: later ones are counted, not printed)")

    def accept(self, meta: dict[str, Any], ref: ray.ObjectRef | None, step: StepBatch, request: RolloutRequest) -> None:
        """Count one rollout's samples (of ``request``) and choose its groups to train on from its per-group
        statistics."""
        c, lag, version = self.counters, self.cfg.training.max_policy_lag, self._version()
        c.samples += meta["samples"]
        c.tokens_generated += meta.get("tokens", 0)
        self._add_to_step("trajectory_bytes", meta.get("record_bytes", 0))
        c.failed_samples += meta.get("failed", 0) if "group_stats" in meta else 0
        for key in ("generate_time_s", "reward_time_s"):
            self._add_to_step(key, meta.get(key, 0.0))
        c.reward_worker_restarts += meta.get("reward_restarts", 0)
        for error in meta.get("errors", []):
            self.note_reward_error(error)
        stats = meta.get("group_stats")
        if stats is None or not len(stats):
            return
        step.scored.append(meta)
        chosen, flat = [], 0
        for gid, _mean, signal, rows, oldest in stats:
            if rows == 0:
                continue
            if version - oldest > lag:
                c.stale_samples += int(rows)
                continue
            if self.cfg.grpo.dynamic_sampling and not signal:
                c.filtered_groups += 1
                continue
            chosen.append((int(gid), int(rows), int(oldest)))
            flat += not signal
        if chosen and ref is not None:
            step.refs.append(ref)
            step.groups += chosen
            step.flat_groups += flat
            step.sources.append((request, meta))

    def gather_batch(self) -> StepBatch:
        """The groups to train on for one step (the oldest rollout in flight), refilling groups dropped by
        dynamic sampling."""
        g = self.cfg.grpo
        step = StepBatch()
        self._take(self.in_flight.popleft(), step)
        for _round in range(g.max_sampling_rounds - 1 if g.dynamic_sampling else 0):
            missing = g.prompts_per_step - len(step.groups)
            if missing <= 0:
                break
            self._take(self.submit(missing), step)
        self._note_flat(step)
        return step

    def _note_flat(self, step: StepBatch) -> None:
        """Say once a run, at the first ``FLAT_STEPS_NOTED`` steps in a row that trained only groups whose rewards
        were all equal: GRPO's advantages (r - mean) are then 0, so the policy does not move (a reward that gives
        every completion the same value, or a task every completion fails alike)."""
        all_flat = bool(step.groups) and step.flat_groups == len(step.groups)
        self.flat_steps = self.flat_steps + 1 if all_flat else 0
        if self.flat_steps == FLAT_STEPS_NOTED and not self.flat_noted:
            self.flat_noted = True
            self._note(
                f"no reward spread in {FLAT_STEPS_NOTED} steps in a row: every group's completions got equal rewards, "
                "so their advantages are 0 and the policy gradient is zero (check that the reward tells completions "
                "apart; grpo.dynamic_sampling: true samples other prompts instead)"
            )

    def _take(self, pending: Pending, step: StepBatch) -> None:
        """Receive a rollout into ``step``, which trains on ``grpo.prompts_per_step`` groups at most."""
        self.accept(*self.receive(pending), step, pending.request)
        if len(step.groups) > self.cfg.grpo.prompts_per_step:
            step.groups = sorted(step.groups)[: self.cfg.grpo.prompts_per_step]

    def recollect(self, step: StepBatch, lost: str) -> None:
        """Take the record whose object (hex id ``lost``) was lost with its node before the learners read it out of
        ``step``, with its groups and metadata, and ask its rollout again with the same prompts and group ids
        (``resampled_samples``; its samples are not counted twice in ``samples``). After ``ROLLOUT_ATTEMPTS``
        such losses in one step, a lost record's samples are recorded as failed instead."""
        k = next(i for i, ref in enumerate(step.refs) if ref.hex() == lost)
        del step.refs[k]
        request, meta = step.sources.pop(k)
        ids = range(request.first_group, request.first_group + len(request.indices))
        step.groups = [group for group in step.groups if group[0] not in ids]
        step.scored = [m for m in step.scored if m is not meta]
        samples = meta["samples"]
        if step.recollected >= ROLLOUT_ATTEMPTS:
            self.counters.failed_samples += samples
            self._note(
                f"{samples} samples failed: their record was lost with its node, after {ROLLOUT_ATTEMPTS} records of "
                "this step were collected again"
            )
            return
        step.recollected += 1
        self.counters.samples -= samples
        self.counters.resampled_samples += samples
        self._note(f"a record of {samples} samples was lost with its node before the learners read it; asked again")
        self._take(self.send(request), step)
