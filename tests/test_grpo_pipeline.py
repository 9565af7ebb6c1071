"""The GRPO pipeline end to end on a real local Ray cluster: weight sync, data-parallel learners, reward faults,
checkpoints, bounded async, KL, dynamic sampling, run outputs and the CLI's config errors.

Every model here is a tiny builtin character model (1 layer x 32 wide); nothing downloads. Each full training run
costs mostly actor start-up, so the runs are few and each one carries several checks:

* ``lagged_run``: SFT warm-up, then 3 GRPO steps of 2 epochs with ``max_policy_lag: 1``, overlong filtering and
  the KL reference in the learner; checkpoint reload, async lag, run outputs.
* ``sync_run``: a short SFT warm-up, then ``max_policy_lag: 0``, dynamic sampling and a reference actor.
* ``faulty_run``: no warm-up, two data-parallel learners (each with its reference), a reward that raises and one
  that hangs for one prompt.

The reward functions live in this file, which the reward actors cannot import: they arrive through the
registry snapshot the reward pool ships.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
import yaml
from grpo_runs import BASE, TINY, Run, merged, run_grpo, write_prompts

from rlfabric.actors.generator import Generator
from rlfabric.actors.llm_learner import LLMLearner, LLMLearnerCore
from rlfabric.algorithms.grpo import policy_objective
from rlfabric.config import ConfigError, config_from_dict, dump_config
from rlfabric.grpo_config import GRPOConfig, SFTConfig
from rlfabric.llm_driver import GRPOTrainer
from rlfabric.llm_resources import concurrent_actors
from rlfabric.llm_run_state import latest_checkpoint
from rlfabric.models.hf import build_small_model_dir, load_causal_lm, load_tokenizer
from rlfabric.models.packed_batch import pack_sequences
from rlfabric.models.sequences import response_logprobs
from rlfabric.models.shared_weights import SHM_DIR
from rlfabric.models.weights import as_state_dict
from rlfabric.rewards import RewardInput, default_weights, register_reward
from rlfabric.run.log import read_metrics
from rlfabric.run.progress import grpo_progress_line as progress_line

# -- reward functions shipped to the reward actors by value -----------------------------------------------------

HANG_PROMPT = "9+9="  # the one prompt whose group the hanging reward never finishes


def raises_on_7(inputs: list[RewardInput]) -> list[dict[str, float]]:
    """Fails every group whose reference answer ends in 7."""
    if str(inputs[0].metadata["answer"]).endswith("7"):
        raise ValueError(f"refusing to score {inputs[0].prompt!r}")
    return [{} for _ in inputs]


def hangs_on_one_prompt(inputs: list[RewardInput]) -> list[dict[str, float]]:
    if inputs[0].prompt == HANG_PROMPT:
        time.sleep(1000)
    return [{} for _ in inputs]


def spread(inputs: list[RewardInput], *, only_even_answers: bool = False) -> list[dict[str, float]]:
    """A reward that varies with the completion text, so an untrained model's groups have signal.

    With ``only_even_answers`` the prompts whose answer is odd get 0 for every completion: their groups have no
    signal (the untrained model never gets the arithmetic right), so dynamic sampling must drop them, while the
    even ones keep the learner updating.
    """
    if only_even_answers and int(inputs[0].metadata["answer"]) % 2:
        return [{"spread": 0.0} for _ in inputs]
    return [{"spread": (sum(map(ord, s.completion)) % 5) / 4} for s in inputs]


@default_weights(chars=0.0)
def completion_chars(inputs: list[RewardInput]) -> list[dict[str, float]]:
    """A measurement, not a reward: it declares weight 0 for its one component."""
    return [{"chars": float(len(s.completion))} for s in inputs]


register_reward("test_completion_chars", completion_chars)
register_reward("test_raises_on_7", raises_on_7)
register_reward("test_hangs_on_one_prompt", hangs_on_one_prompt)
register_reward("test_spread", spread)

# -- runs -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lag", "generators", "learners", "expected"),
    [
        (0, 1, 1, {"generator": 1, "learner": 1, "reference": 1}),  # take turns: each gets every core
        (0, 2, 4, {"generator": 2, "learner": 4, "reference": 1}),
        (1, 1, 1, {"generator": 2, "learner": 2, "reference": 2}),  # at once: they split the cores
        (2, 2, 4, {"generator": 6, "learner": 6, "reference": 6}),
    ],
)
def test_actors_that_compute_at_once_split_the_cores(lag, generators, learners, expected):
    cfg = config_from_dict(
        merged(
            BASE,
            {
                "generator": {"num_generators": generators},
                "learner": {"num_learners": learners},
                "training": {"max_policy_lag": lag},
            },
        )
    )
    assert {role: concurrent_actors(cfg, role) for role in expected} == expected


LAGGED_SFT_STEPS = 30


@pytest.fixture(scope="module")
def lagged_run(local_ray, tmp_path_factory) -> Run:
    """SFT warm-up (enough to make the model stop early sometimes, so overlong filtering has work), then 3 GRPO
    steps of 2 epochs each (still one policy version per step) with one batch generating ahead of the update."""
    return run_grpo(
        tmp_path_factory.mktemp("lagged") / "run",
        rewards={"functions": [{"name": "arithmetic"}, {"name": "test_spread"}]},
        sft={"steps": LAGGED_SFT_STEPS, "lr": 1e-2},
        grpo={"overlong_filter": True, "epochs": 2, "kl_coef": 0.1, "reference": "learner", "lr": 1e-2},
        training={"max_policy_lag": 1, "checkpoint_every": 2},
    )


@pytest.fixture(scope="module")
def sync_run(local_ray, tmp_path_factory) -> Run:
    """Its weights name components no reward gives (``corect``, ``bonus``: weight 1 as for any unnamed one, no
    effect) and leave out ``format`` and ``chars``, which their rewards weigh 0 by default."""
    return run_grpo(
        tmp_path_factory.mktemp("sync") / "run",
        quiet=False,
        rewards={
            "functions": [
                {"name": "arithmetic"},
                {"name": "test_spread", "kwargs": {"only_even_answers": True}},
                {"name": "test_completion_chars"},
            ],
            "weights": {"correct": 1.0, "corect": 1.0, "bonus": 1.0},
        },
        sft={"steps": 3, "lr": 1e-2},
        grpo={"kl_coef": 0.1, "reference": "actor", "lr": 1e-2, "dynamic_sampling": True},
        training={"max_policy_lag": 0},
    )


TRAIN_PROMPTS = ["1+1=", "2+5=", "3+3=", "4+1=", "2+2=", "6+3=", "5+3=", HANG_PROMPT]  # "2+5=" raises
EVAL_PROMPTS = ["1+2=", "5+1=", "2+6=", "4+5="]


REWARD_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def faulty_run(local_ray, tmp_path_factory) -> Run:
    """In-learner reference, two learners; one prompt in 8 fails its reward, another hangs it past the deadline."""
    root = tmp_path_factory.mktemp("faulty")
    return run_grpo(
        root / "run",
        data={
            "train": write_prompts(root / "train.jsonl", TRAIN_PROMPTS),
            "eval": write_prompts(root / "eval.jsonl", EVAL_PROMPTS),
            "num_train": None,
            "num_eval": len(EVAL_PROMPTS),
        },
        rewards={
            "functions": [
                {"name": "arithmetic"},
                {"name": "test_spread"},  # signal, so the policy moves away from the reference
                {"name": "test_raises_on_7"},
                {"name": "test_hangs_on_one_prompt"},
            ],
            "timeout_s": REWARD_TIMEOUT_S,
        },
        grpo={"prompts_per_step": 4, "kl_coef": 0.1, "reference": "learner", "lr": 1e-2},
        # Two data-parallel learners, each on half of what the failures leave (8, 12 or 16 rows); the weights go
        # through the object store (the other runs use the node's shared memory).
        learner={"num_learners": 2, "weight_transport": "object_store"},
    )


# -- 1. weight sync --------------------------------------------------------------------------------------------


def hf_greedy(model, prompt: list[int], max_new_tokens: int, pad_id: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return out[0, len(prompt) :].tolist()


def test_generator_takes_new_weights_and_tags_completions_with_their_version(local_ray, tmp_path):
    model_dir = build_small_model_dir(tmp_path / "model", **TINY)
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in ["1+2=", "40+9=", "hello", "7*7=", "(3)"]]
    greedy = {"max_new_tokens": 6, "temperature": 0.0}
    gen = Generator.options(num_cpus=0.5).remote("torch", str(model_dir), {"max_batch_size": 16}, num_threads=1)
    try:
        before = ray.get(gen.generate.remote(prompts, greedy), timeout=120)
        assert [c["version"] for c in before] == [0] * len(prompts)

        model = load_causal_lm(model_dir)
        noise = torch.Generator().manual_seed(1)
        with torch.no_grad():  # in place on the parameters, so tied weights stay tied in the state dict
            for p in model.parameters():
                p.add_(0.5 * torch.randn(p.shape, generator=noise))
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assert ray.get(gen.update_weights.remote([ray.put(state)], 7), timeout=60) == 7

        after = ray.get(gen.generate.remote(prompts, greedy), timeout=60)
        assert [c["version"] for c in after] == [7] * len(prompts)
        assert ray.get(gen.version.remote()) == 7
        assert [c["token_ids"] for c in after] != [c["token_ids"] for c in before]
        # The generator now decodes exactly as the perturbed model does: the weights arrived whole.
        for prompt, c in zip(prompts, after, strict=True):
            assert c["token_ids"] == hf_greedy(model, prompt, 6, tokenizer.pad_token_id)
            assert c["text"] == tokenizer.decode(c["token_ids"], skip_special_tokens=True)
    finally:
        ray.kill(gen, no_restart=True)


def maps_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's library loaded."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def pids_titled(title: str) -> list[int]:
    """Live processes whose title (Ray names an actor's process ``ray::Class``) starts with ``title``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(title.encode()):
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return pids


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads /proc (Linux)")
def test_rollout_workers_and_reward_services_run_without_torch(local_ray, tmp_path):
    """They hold no model: torch (about 180 MB a process, and 1.7 s of every start) stays with the generators and
    learners, though rollout workers take generator handles and compute advantages."""
    trainer = GRPOTrainer(config_from_dict(merged(BASE, {"training": {"total_steps": 2}})), tmp_path / "run")
    seen: dict[str, bool] = {}
    try:
        trainer.setup()
        trainer.train()
        seen["rollout worker"] = maps_torch(ray.get(trainer.rollout_workers.handles[0].pid.remote(), timeout=60))
        seen["generator"] = maps_torch(ray.get(trainer.generators.handles[0].pid.remote(), timeout=60))
        seen |= {f"reward service {pid}": maps_torch(pid) for pid in pids_titled("ray::RewardService")}
    finally:
        trainer.close()
    assert any(name.startswith("reward service") for name in seen), seen
    assert seen.pop("generator") and not any(seen.values()), seen  # the check sees torch where it is


# -- 2. data-parallel learners and gradient accumulation -------------------------------------------------------


def grpo_options(aggregation: str, micro_batch_size: int, max_new_tokens: int) -> dict:
    g = GRPOConfig(loss_aggregation=aggregation, micro_batch_size=micro_batch_size, lr=1e-3, epochs=1)
    return {**dataclasses.asdict(g), "norm_length": max_new_tokens}


def learner_kwargs(model_dir: Path, aggregation: str, micro_batch_size: int, **extra) -> dict:
    return {
        "model_dir": str(model_dir),
        "grpo": grpo_options(aggregation, micro_batch_size, 6),
        "sft": dataclasses.asdict(SFTConfig()),
        "temperature": 1.0,
        "num_threads": 1,
        **extra,
    }


def packed_batch(model_dir: Path) -> dict[str, np.ndarray]:
    """8 rows of random responses (1-6 tokens) with advantages and behaviour logprobs; one row fully masked."""
    tokenizer = load_tokenizer(model_dir)
    rng = np.random.default_rng(0)
    texts = ["1+2=", "40+9=", "hello there", "7*7=", "(3)", "12-5=", "a", "99+1="]
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    vocab = len(tokenizer)
    responses = [rng.integers(3, vocab, size=rng.integers(1, 7)).tolist() for _ in texts]
    batch = pack_sequences(prompts, responses, tokenizer.pad_token_id)
    batch["response_mask"][5] = 0.0  # as overlong filtering leaves a row: no loss, not counted by seq means
    batch["advantages"] = rng.normal(size=len(texts)).astype(np.float32)
    threads = torch.get_num_threads()
    try:  # the learner sets this process's torch threads
        core = LLMLearnerCore(**learner_kwargs(model_dir, "token_mean", 64))
    finally:
        torch.set_num_threads(threads)
    behaviour = core.logprobs(batch) + rng.normal(scale=0.05, size=batch["response_mask"].shape)
    batch["behaviour_logprobs"] = behaviour.astype(np.float32)
    return batch


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def dp_setup(tmp_path_factory):
    model_dir = build_small_model_dir(tmp_path_factory.mktemp("dp") / "model", **TINY)
    return model_dir, packed_batch(model_dir)


def set_aggregation(learner, aggregation: str) -> None:
    """Switch a learner (an actor, through Ray's ``__ray_call__``, or an in-process core) to another aggregation."""
    if isinstance(learner, LLMLearnerCore):
        learner.g["loss_aggregation"] = aggregation
    else:
        ray.get(learner.__ray_call__.remote(lambda actor, a: actor.core.g.update(loss_aggregation=a), aggregation))


def test_adaptive_kl_steers_the_coefficient_each_step_and_a_resumed_run_carries_it_on(local_ray, tmp_path):
    """grpo.kl_target: each update uses the coefficient the last one left, coef * (1 + clip(KL / target - 1, -0.2,
    0.2) * samples / horizon), logged as kl_coef; a resumed run goes on from the checkpoint's."""
    run_dir = tmp_path / "run"
    grpo = {"kl_coef": 0.1, "kl_target": 1e-4, "kl_horizon": 16, "reference": "learner", "lr": 1e-2}
    first = run_grpo(run_dir, grpo=grpo, training={"total_steps": 3, "checkpoint_every": 1})
    trainer = GRPOTrainer.from_run_dir(run_dir, ["training.total_steps=4"], quiet=True)
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("phase") == "grpo"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and steps[:3] == first.phase("grpo")
    assert steps[0]["kl_coef"] == 0.1
    for before, after in zip(steps, steps[1:], strict=False):
        error = min(max(before["kl"] / 1e-4 - 1.0, -0.2), 0.2)
        assert after["kl_coef"] == pytest.approx(before["kl_coef"] * (1 + error * before["trained_samples"] / 16))
    assert len({r["kl_coef"] for r in steps}) == 4  # it moved at every step, across the resume too


def test_mini_batches_step_in_turn_against_the_logprobs_the_batch_met(dp_setup):
    """grpo.mini_batches: 2 is one AdamW step on each half of the rows in turn, each half's loss over its own
    tokens, both against the logprobs of the weights the batch met (so the second half's ratio is not 1): what a
    plain loop over the halves gives, written out here on the padded rows."""
    model_dir, batch = dp_setup
    g = GRPOConfig()
    threads = torch.get_num_threads()
    try:
        learners = {}
        for parts in (1, 2):
            learners[parts] = LLMLearnerCore(**learner_kwargs(model_dir, "token_mean", 3, sequence_packing="padded"))
            learners[parts].g.update(mini_batches=parts, max_grad_norm=None)
        metrics = {parts: learner.train_step(batch, 1e-3) for parts, learner in learners.items()}

        model = load_causal_lm(str(model_dir), dtype="float32", device="cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=g.weight_decay)
        ids, attention = torch.tensor(batch["input_ids"]), torch.tensor(batch["attention_mask"])
        mask, advantages = torch.tensor(batch["response_mask"]), torch.tensor(batch["advantages"])
        prompt_len = int(batch["prompt_len"])
        with torch.no_grad():
            old, _ = response_logprobs(model, ids, attention, prompt_len)
        for half in (slice(0, 4), slice(4, 8)):
            new, _ = response_logprobs(model, ids[half], attention[half], prompt_len)
            loss, _ = policy_objective(
                new, old[half], advantages[half], mask[half], clip_low=g.clip_low, clip_high=g.clip_high
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    expected = {k: v.detach() for k, v in model.state_dict().items()}
    assert max_abs_diff(learners[2].state_dict_cpu(), expected) < 1e-5
    assert max_abs_diff(learners[1].state_dict_cpu(), expected) > 1e-4  # one step on the whole batch is not that
    assert metrics[1]["ratio_mean"] == 1.0 and abs(metrics[2]["ratio_mean"] - 1.0) > 1e-5  # the 2nd half moved
    assert learners[2].version == learners[1].version == 1  # one policy version per batch


@pytest.mark.parametrize("zero_groups", ["some", "all"])
def test_skipping_zero_advantage_rows_gives_the_same_update(dp_setup, zero_groups):
    """Rows whose advantage is 0 are not run (no KL, no entropy bonus): the weights after the step are those of a
    learner that ran every row, and the metrics say how many rows were skipped."""
    model_dir, batch = dp_setup
    batch = copy.deepcopy(batch)
    zero = [0, 1, 2, 5] if zero_groups == "some" else list(range(len(batch["advantages"])))
    batch["advantages"][zero] = 0.0
    threads = torch.get_num_threads()
    try:
        skipping = LLMLearnerCore(**learner_kwargs(model_dir, "token_mean", 3))
        every_row = LLMLearnerCore(**learner_kwargs(model_dir, "token_mean", 3))
        every_row.g["skip_zero_advantage_rows"] = False
        m_skip = skipping.train_step(batch, 1e-3)
        m_all = every_row.train_step(batch, 1e-3)
    finally:
        torch.set_num_threads(threads)
    assert max_abs_diff(skipping.state_dict_cpu(), every_row.state_dict_cpu()) < 1e-6
    assert m_skip["pg_loss"] == pytest.approx(m_all["pg_loss"], abs=1e-6)
    kept = len(batch["advantages"]) - len(zero) if zero_groups == "some" else 1  # one row runs even when none count
    assert (m_skip["trained_rows"], m_skip["skipped_rows"]) == (kept, len(batch["advantages"]) - kept)
    assert m_all["skipped_rows"] == 0


@pytest.mark.parametrize("policy_loss", ["clip", "cispo"])
def test_ratio_clip_and_kl_metrics_say_how_far_the_update_moved_the_policy(dp_setup, policy_loss):
    """The "old" logprobs are the learner's own at the batch's weights, so the first pass's ratio is 1: with one
    epoch the metrics are 1, 0 and 0 exactly; with three at a large learning rate they are the last pass's, after
    two optimizer steps: the ratio has moved, approx_kl is positive and the clip bites."""
    model_dir, batch = dp_setup
    threads = torch.get_num_threads()

    def metrics(epochs: int) -> dict[str, float]:
        learner = LLMLearnerCore(**learner_kwargs(model_dir, "token_mean", 64))
        learner.g.update(epochs=epochs, max_grad_norm=None, policy_loss=policy_loss)
        return learner.train_step(batch, 3e-2)

    try:
        one, three = metrics(1), metrics(3)
    finally:
        torch.set_num_threads(threads)
    assert (one["ratio_mean"], one["clip_fraction"], one["approx_kl"]) == (1.0, 0.0, 0.0)
    assert three["ratio_mean"] != 1.0 and three["approx_kl"] > 1e-4 and three["clip_fraction"] > 0.0


def test_gradients_are_clipped_to_max_grad_norm_and_untouched_within_it(dp_setup):
    """With ratio 1 and no KL or entropy term the loss is linear in the advantages, so clipping the gradient by
    c = max_norm / (||g|| + 1e-6) gives the update of advantages scaled by c, unclipped. The bound is tiny, so the
    clipped gradient is near AdamW's epsilon and the update differs from the unclipped one. A bound the gradient
    stays within changes nothing, bit for bit."""
    model_dir, batch = dp_setup
    threads = torch.get_num_threads()

    def step(max_grad_norm: float | None, advantage_scale: float = 1.0, steps: int = 1):
        learner = LLMLearnerCore(**learner_kwargs(model_dir, "token_mean", 64))
        learner.g["max_grad_norm"] = max_grad_norm
        scaled = {**batch, "advantages": batch["advantages"] * np.float32(advantage_scale)}
        norm = [learner.train_step(scaled, 1e-3)["grad_norm"] for _ in range(steps)][0]
        return learner.state_dict_cpu(), norm

    try:
        clipped, norm = step(1e-7)
        unclipped, unclipped_norm = step(None)
        scaled, _ = step(None, advantage_scale=1e-7 / (norm + 1e-6))
        roomy, _ = step(1e9, steps=2)
        unclipped_twice, _ = step(None, steps=2)
    finally:
        torch.set_num_threads(threads)
    assert norm == pytest.approx(unclipped_norm, rel=1e-6) and norm > 1e-3  # the norm before clipping
    assert max_abs_diff(clipped, scaled) < 1e-6
    assert max_abs_diff(clipped, unclipped) > 1e-4
    assert max_abs_diff(roomy, unclipped_twice) == 0.0


def test_data_parallel_learners_and_accumulation_match_one_big_batch(local_ray, dp_setup):
    """One GRPO update per loss aggregation, in a row, by three learners that must stay equal: one micro-batch of
    the whole batch, micro-batches of 4 (gradient accumulation), and two gloo ranks on micro-batches of 2."""
    model_dir, batch = dp_setup
    threads = torch.get_num_threads()
    try:
        whole = LLMLearnerCore(**learner_kwargs(model_dir, "token_mean", 64))
        accumulated = LLMLearnerCore(**learner_kwargs(model_dir, "token_mean", 4))
    finally:
        torch.set_num_threads(threads)
    learners = [
        LLMLearner.options(num_cpus=0.5).remote(**learner_kwargs(model_dir, "token_mean", 2, rank=r, world_size=2))
        for r in range(2)
    ]
    try:
        address = ray.get(learners[0].node_address.remote(), timeout=120)
        port = ray.get(learners[0].free_port.remote(), timeout=60)
        ray.get([ln.init_process_group.remote(address, port, "gloo") for ln in learners], timeout=120)
        ref = ray.put(batch)
        for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
            for learner in (whole, accumulated, *learners):
                set_aggregation(learner, aggregation)
            before = whole.state_dict_cpu()
            try:
                m_whole = whole.train_step(batch, 1e-3)
                m_acc = accumulated.train_step(batch, 1e-3)
            finally:
                torch.set_num_threads(threads)
            m_ranks = ray.get([ln.train_step.remote([ref], 1e-3) for ln in learners], timeout=120)
            state_ref, version, _ = ray.get(learners[0].publish.remote(), timeout=60)
            published = as_state_dict(ray.get(state_ref[0], timeout=60))

            expected = whole.state_dict_cpu()
            assert max_abs_diff(expected, before) > 1e-4, aggregation  # the step moved the weights
            assert max_abs_diff(accumulated.state_dict_cpu(), expected) < 1e-5, aggregation
            assert max_abs_diff(published, expected) < 1e-5, aggregation
            assert version == whole.version
            # Every learner clips and steps on the same gradient (all-reduced over the ranks).
            for m in (m_acc, *m_ranks):
                assert m["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-5), aggregation
            # The loss is normalised by the whole batch's denominator, so micro-batch and rank shares add up.
            assert m_acc["pg_loss"] == pytest.approx(m_whole["pg_loss"], rel=1e-5, abs=1e-7), aggregation
            rank_sum = sum(m["pg_loss"] for m in m_ranks)
            assert rank_sum == pytest.approx(m_whole["pg_loss"], rel=1e-5, abs=1e-7), aggregation
    finally:
        for ln in learners:
            ray.kill(ln, no_restart=True)


def test_data_parallel_mini_batches_are_each_ranks_share_of_each_step(local_ray, dp_setup):
    """Two ranks with grpo.mini_batches: 2 each split their own half of the rows (rank 0 rows 0-3, rank 1 rows
    4-7), so step one trains rows 0, 1, 4, 5 and step two rows 2, 3, 6, 7: what one learner does with the rows in
    that order, mini-batches and metrics alike."""
    model_dir, batch = dp_setup
    order = [0, 1, 4, 5, 2, 3, 6, 7]
    reordered = {k: v[order] if isinstance(v, np.ndarray) and v.ndim and len(v) == 8 else v for k, v in batch.items()}
    threads = torch.get_num_threads()
    try:
        single = LLMLearnerCore(**learner_kwargs(model_dir, "seq_mean_token_mean", 64))
        single.g["mini_batches"] = 2
        m_single = single.train_step(reordered, 1e-3)
    finally:
        torch.set_num_threads(threads)
    options = learner_kwargs(model_dir, "seq_mean_token_mean", 64, world_size=2)
    options["grpo"]["mini_batches"] = 2
    learners = [LLMLearner.options(num_cpus=0.5).remote(**{**options, "rank": r}) for r in range(2)]
    try:
        address = ray.get(learners[0].node_address.remote(), timeout=120)
        port = ray.get(learners[0].free_port.remote(), timeout=60)
        ray.get([ln.init_process_group.remote(address, port, "gloo") for ln in learners], timeout=120)
        m_ranks = ray.get([ln.train_step.remote([ray.put(batch)], 1e-3) for ln in learners], timeout=120)
        state_ref, _, _ = ray.get(learners[0].publish.remote(), timeout=60)
        published = as_state_dict(ray.get(state_ref[0], timeout=60))
    finally:
        for ln in learners:
            ray.kill(ln, no_restart=True)
    assert max_abs_diff(published, single.state_dict_cpu()) < 1e-5
    assert sum(m["pg_loss"] for m in m_ranks) == pytest.approx(m_single["pg_loss"], rel=1e-5, abs=1e-7)
    assert m_ranks[0]["grad_norm"] == pytest.approx(m_single["grad_norm"], rel=1e-5)


# -- 3. reward faults in a real run ----------------------------------------------------------------------------


def test_a_learner_publishing_through_shared_memory_updates_the_file_in_place_and_saves_whole(dp_setup, tmp_path):
    """Learner 0's parameters move into the shared-memory file at its first publication: its optimizer step then
    writes the next version there (a reader of the last one is told), and its checkpoint still holds every tensor."""
    model_dir, batch = dp_setup
    threads = torch.get_num_threads()
    try:  # the learner sets this process's torch threads
        core = LLMLearnerCore(**learner_kwargs(model_dir, "token_mean", 64))
        twin = LLMLearnerCore(**learner_kwargs(model_dir, "token_mean", 64))  # the same steps in its own memory
    finally:
        torch.set_num_threads(threads)
    try:
        first = core.shared_weights("this-node")
        assert first is not None, core.shared_unavailable
        core.train_step(batch, 1e-3)
        twin.train_step(batch, 1e-3)
        with pytest.raises(RuntimeError, match="a version being written, not version 0"):
            first.check_intact()  # the step changed the weights in the file before any publication
        second = core.shared_weights("this-node")
        want = twin.state_dict_cpu()
        assert second.version == 1 and max_abs_diff(as_state_dict(second), want) == 0
        core.save(str(tmp_path / "checkpoint"))
        assert max_abs_diff(load_causal_lm(tmp_path / "checkpoint").state_dict(), want) == 0
    finally:
        core.close()


def test_weights_reach_the_generators_through_shared_memory_on_one_node_unless_told_otherwise(sync_run, faulty_run):
    """auto takes the node's shared memory when every reader is on learner 0's node and /dev/shm has room beside
    Ray's object store; the tests run where it has (a 64 MiB container /dev/shm would fail this, as it should:
    auto would then fall back, and the run would say why)."""
    free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
    assert sync_run.summary["weight_transport"] == "shared_memory", f"{free / 2**30:.1f} GiB free in {SHM_DIR}"
    assert faulty_run.summary["weight_transport"] == "object_store"  # learner.weight_transport: object_store


def test_reward_that_raises_or_hangs_costs_only_its_groups(faulty_run):
    s, grpo_rows = faulty_run.summary, faulty_run.phase("grpo")
    assert s["steps"] == 3 and len(grpo_rows) == 3
    group_size = 4
    assert s["failed_samples"] > 0 and s["failed_samples"] % group_size == 0
    # Each pass over the 8 train prompts (2 steps of 4) meets the raising and the hanging prompt once.
    assert s["failed_samples"] >= 2 * group_size
    failed = [r["failed_samples"] for r in grpo_rows]
    assert failed == sorted(failed) and failed[-1] == s["failed_samples"]
    assert all(r["trained_samples"] > 0 for r in grpo_rows)  # the other groups still trained
    assert s["reward_worker_restarts"] >= 1  # the hung worker was poisoned and replaced
    # The hanging reward sleeps 1000 s; the run waits one 2 s deadline per hang, plus a worker restart.
    assert s["time_total_s"] < 90, s["time_total_s"]
    assert faulty_run.phase("eval")[-1]["eval_failed"] == 0


def test_two_learners_report_loss_terms_on_the_scale_of_one(faulty_run):
    """Each rank's entropy (like pg_loss and kl) is its share of the batch's value; the driver must add the shares.

    The first step's entropy is that of the freshly initialised model, which is close to uniform: near log(vocab),
    not half of it.
    """
    vocab = len(load_tokenizer(faulty_run.run_dir / "initial_model"))
    entropy = faulty_run.phase("grpo")[0]["entropy"]
    assert 0.9 * np.log(vocab) < entropy <= np.log(vocab)


# -- 4. the saved final model is the one that produced the final eval ------------------------------------------


def test_final_model_reloads_in_transformers_and_reproduces_the_eval_samples(lagged_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final_dir = lagged_run.run_dir / "final_model"
    saved_version = lagged_run.summary["policy_version"]  # of the weights saved as the final model
    final_eval = lagged_run.phase("eval")[-1]
    assert final_eval["label"] == "final"
    # The final eval ran after the last update, on the weights that were saved.
    assert final_eval["policy_version"] == saved_version == lagged_run.phase("grpo")[-1]["policy_version"]
    assert saved_version == LAGGED_SFT_STEPS + 3  # one version per SFT step and per GRPO step (of 2 epochs)

    model = AutoModelForCausalLM.from_pretrained(final_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(final_dir)
    samples = [json.loads(line) for line in (lagged_run.run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8
    for s in samples:
        prompt = tokenizer(s["prompt"], add_special_tokens=False).input_ids
        tokens = hf_greedy(model, prompt, 4, tokenizer.pad_token_id)
        assert tokenizer.decode(tokens, skip_special_tokens=True) == s["completion"], s["prompt"]


# -- 5. bounded async --------------------------------------------------------------------------------------------


def test_policy_lag_is_bounded_by_max_policy_lag(lagged_run, sync_run):
    lagged = lagged_run.phase("grpo")
    assert any(r["policy_lag_mean"] > 0 for r in lagged)
    # 2 epochs per step still make one policy version, so a batch made one update ago is not stale.
    assert all(0 <= r["policy_lag_mean"] <= r["policy_lag_max"] <= 1 for r in lagged)
    assert any(r["policy_lag_max"] == 1 for r in lagged)
    assert all(r["stale_samples"] == 0 for r in lagged) and lagged_run.summary["stale_samples"] == 0
    assert all(r["trained_samples"] > 0 for r in lagged)
    sync = sync_run.phase("grpo")
    assert [(r["policy_lag_mean"], r["policy_lag_max"]) for r in sync] == [(0.0, 0)] * len(sync)
    assert sync_run.summary["stale_samples"] == 0


# -- 6. KL to the reference ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "which",
    ["sync_run", "lagged_run", "faulty_run"],
    ids=["reference_actor_after_sft", "reference_in_learner_after_sft", "reference_in_two_learners"],
)
def test_kl_starts_at_zero_and_grows(request, which):
    run: Run = request.getfixturevalue(which)
    kl = [r.get("kl") for r in run.phase("grpo")]
    # At the first step the policy still equals the reference: the warmed-up weights where there was SFT.
    assert kl[0] is not None and kl[0] == pytest.approx(0.0, abs=1e-6)
    later = [k for k in kl[1:] if k is not None]
    assert later and all(k >= 0 for k in later) and max(later) > 1e-6, kl


# -- 7. dynamic sampling and overlong filtering ----------------------------------------------------------------


def test_reward_weights_naming_components_no_reward_gives_are_noted(sync_run):
    """A misspelling at the first scored step, with the name it resembles; every name never given, at the end."""
    notes = [line for line in sync_run.console.splitlines() if "no reward gave" in line]
    assert notes == [
        "rlfabric: rewards.weights names 'corect' (did you mean 'correct'?): no reward gave such a component at the "
        "first scored step",
        "rlfabric: rewards.weights names 'corect', 'bonus': no reward gave such a component in the steps this "
        "command ran (they gave chars, correct, format, spread): a penalty that never fired, or a wrong name",
    ], sync_run.console


def test_a_component_the_weights_leave_out_has_the_weight_its_reward_declares(sync_run):
    """The weights name correct and leave out the rest: format and chars weigh 0 (the arithmetic reward and
    test_completion_chars declare it), spread 1 (its reward declares nothing)."""
    rows = sync_run.phase("grpo")
    assert all(r["reward_chars"] > 0 for r in rows), rows  # else the declared weight would not show
    for r in rows:
        assert r["reward_mean"] == pytest.approx(r["reward_correct"] + r["reward_spread"], abs=1e-6), r


def test_a_run_without_checkpointing_leaves_no_checkpoint(sync_run):
    assert sync_run.summary["steps"] == 3 and not (sync_run.run_dir / "checkpoints").exists()  # checkpoint_every 0


def test_the_placement_plan_names_every_role_the_reference_actor_included(sync_run):
    plan = json.loads((sync_run.run_dir / "placement.json").read_text())
    assert {role: len(where["nodes"]) for role, where in plan.items()} == {
        "generator": 1,
        "rollout worker": 1,
        "learner": 1,
        "reference": 1,
    }


def test_dynamic_sampling_drops_groups_without_signal(sync_run):
    s, rows = sync_run.summary, sync_run.phase("grpo")
    assert s["steps"] == 3
    assert s["filtered_groups"] > 0 and rows[-1]["filtered_groups"] == s["filtered_groups"]
    # Every group generated was either trained on whole or filtered out, never both, never lost: the refills
    # asked only for what was missing (no failures or stale samples in this run).
    assert s["failed_samples"] == s["stale_samples"] == 0
    trained_groups = [r["trained_samples"] / 4 for r in rows]
    assert all(g in (0, 1, 2) for g in trained_groups)  # whole groups of 4, at most prompts_per_step = 2
    assert s["samples"] == 4 * (sum(trained_groups) + s["filtered_groups"])
    assert sum(trained_groups) > 0


def test_overlong_filtering_run_completes(lagged_run):
    rows = lagged_run.phase("grpo")
    assert lagged_run.summary["steps"] == 3 and len(rows) == 3
    assert all(np.isfinite(r["pg_loss"]) for r in rows)


@pytest.mark.parametrize("overlong_filter", [True, False])
def test_overlong_filter_takes_truncated_completions_out_of_the_loss(dp_setup, overlong_filter):
    """A completion cut at the length limit moves the weights only without the filter: with it, the update is
    the one of the same batch with that row's loss mask zeroed by hand."""
    from rlfabric.trajectory import from_token_sequences

    model_dir, _ = dp_setup
    record = from_token_sequences(
        [[5, 6], [5, 6], [5, 6]],
        [[7, 8, 9], [10, 11, 12, 13], [7, 14]],
        [[-1.0] * 3, [-1.0] * 4, [-1.0] * 2],
        [[0] * 3, [0] * 4, [0] * 2],
        episode_ids=[0, 1, 2],
        group_ids=[0, 0, 0],
        final_rewards={"correct": [1.0, 0.0, 0.0]},
        truncated=[False, True, False],  # the second was cut at the limit
    )
    by_hand = copy.deepcopy(record)
    by_hand.loss_mask[1] = 0.0
    spec = {"overlong_filter": overlong_filter, "advantage": "rloo"}

    def learner(batch_spec: dict) -> LLMLearnerCore:
        kwargs = learner_kwargs(model_dir, "token_mean", 8, batch_spec=batch_spec)
        kwargs["grpo"]["max_logprob_gap"] = None  # these behaviour logprobs are made up: no trace check
        return LLMLearnerCore(**kwargs)

    filtered, masked = learner(spec), learner({**spec, "overlong_filter": False})
    before = filtered.state_dict_cpu()
    reported = filtered.train_on([record], None, 1e-2)
    masked.train_on([by_hand], None, 1e-2)
    assert reported.get("overlong_filtered") == (1.0 if overlong_filter else None)  # the row it took out
    assert max_abs_diff(before, masked.state_dict_cpu()) > 1e-6  # the two kept rows did train
    same = max_abs_diff(filtered.state_dict_cpu(), masked.state_dict_cpu()) < 1e-7
    assert same == overlong_filter


# -- 8. run outputs --------------------------------------------------------------------------------------------


def test_metrics_plot_and_samples(lagged_run):
    rows, s = lagged_run.rows, lagged_run.summary
    first_eval = next(i for i, r in enumerate(rows) if r.get("phase") == "eval")
    first_train = next(i for i, r in enumerate(rows) if r.get("phase") in ("grpo", "sft"))
    assert first_eval < first_train
    assert rows[first_eval]["label"] == "initial" and 0 <= rows[first_eval]["eval_accuracy"] <= 1
    assert [r["label"] for r in lagged_run.phase("eval")] == ["initial", "after_sft", "final"]
    assert [r["sft_step"] for r in lagged_run.phase("sft")] == list(range(1, LAGGED_SFT_STEPS + 1))
    for r in lagged_run.phase("sft"):  # beside the loss: the gradient, the tokens it averages over, lr, time
        assert r["sft_grad_norm"] > 0 and r["sft_tokens"] >= 1 and r["sft_step_time_s"] > 0
        assert r["sft_lr"] == yaml.safe_load((lagged_run.run_dir / "config.yaml").read_text())["sft"]["lr"]
    for key in ("eval_accuracy_initial", "eval_accuracy_after_sft", "eval_accuracy_final"):
        assert 0 <= s[key] <= 1
    assert s["eval_accuracy_final"] == lagged_run.phase("eval")[-1]["eval_accuracy"]
    assert (lagged_run.run_dir / "learning_curve.png").stat().st_size > 0
    assert (lagged_run.run_dir / "samples.jsonl").is_file()
    assert json.loads((lagged_run.run_dir / "summary.json").read_text())["steps"] == 3
    # every checkpoint_every steps and at the end
    assert [p.name for p in sorted((lagged_run.run_dir / "checkpoints").iterdir())] == ["step_000002", "step_000003"]
    assert (lagged_run.run_dir / "checkpoints" / "step_000002" / "optimizer.pt").is_file()
    assert not (lagged_run.run_dir / "final_model" / "optimizer.pt").exists()  # the model alone
    shown = [json.loads(line) for line in (lagged_run.run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(shown) == 8 and {"prompt", "completion", "metadata", "components", "error"} <= set(shown[0])
    assert [s["prompt"] for s in shown] == [s["prompt"] for s in lagged_run.summary["sample_completions"]]


def test_tensorboard_has_sft_at_its_own_steps_and_grpo_at_its_steps(lagged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(lagged_run.run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("sft/loss")] == list(range(1, LAGGED_SFT_STEPS + 1))
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 0, 3]  # initial, after SFT, final


def test_progress_line_shows_the_step_total_and_the_time_left():
    row = {
        "phase": "grpo",
        "step": 12,
        "reward_mean": 0.5,
        "accuracy": 0.25,
        "policy_version": 40,
        "samples_per_s": 100.0,
        "failed_samples": 0,
        "time_s": 30.0,
    }
    assert progress_line(row, 100, 65.4) == (
        "step    12/100 | reward  0.500 | acc 0.250 | v40 |  100.0 samples/s | failed 0 |     30s | ETA 1m05s"
    )
    assert progress_line({**row, "lr": 4.5e-4}, 100, 65.4) == (
        "step    12/100 | reward  0.500 | acc 0.250 | v40 | lr 4.5e-04 |  100.0 samples/s | failed 0 |     30s | "
        "ETA 1m05s"
    )
    sft = {"phase": "sft", "sft_step": 20, "sft_loss": 1.5, "time_s": 7.0}
    assert progress_line(sft, 1000, None) == "sft     20/1000 | loss 1.500 |      7s | ETA ?"
    evaluation = {"phase": "eval", "step": 0, "label": "after_sft", "eval_accuracy": 0.32, "time_s": 41.0}
    assert progress_line(evaluation) == "eval after SFT | held-out accuracy 0.320 |     41s"
    assert progress_line({**evaluation, "step": 25, "label": "step_25"}).startswith("eval step    25 | held-out")


def test_each_phase_has_its_own_time_left_and_the_reward_model_stage_shows_it(monkeypatch):
    from rlfabric.run import progress

    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    cfg = config_from_dict(merged(BASE, {"reward_model": {"pairs": "x.jsonl", "steps": 50}, "sft": {"steps": 100}}))
    line = progress.PhaseProgressLine(cfg)
    rm = {"phase": "rm", "rm_step": 10, "rm_loss": 0.7, "rm_accuracy": 0.5, "time_s": 1.0}
    assert line(rm).endswith("| ETA ?")  # no rate yet
    now[0] = 104.0
    assert line({**rm, "rm_step": 20}).endswith("| ETA 12s")  # 10 steps in 4 s, 30 left
    sft = {"phase": "sft", "sft_step": 5, "sft_loss": 1.5, "time_s": 5.0}
    assert line(sft).endswith("| ETA ?")  # a new phase starts its own rate
    now[0] = 110.0
    assert line({**rm, "rm_step": 52}).endswith("| ETA 0s")  # past the total (a last batch that overshoots)


def test_ppo_progress_line_shows_the_time_left():
    from rlfabric.run.progress import ppo_progress_line

    row = {"iteration": 3, "env_steps": 6144, "env_steps_per_s": 2048.0, "episode_return_mean": None}
    row.update(policy_version=3, dropped_fragments=0, runner_restarts=1)
    assert ppo_progress_line(row, 20480, 7.2) == (
        "iter    3 | env steps      6,144 ( 30.0%) |    2,048 steps/s | return    n/a | "
        "v3 dropped 0 restarts 1 | ETA 7s"
    )


# -- 9. CLI config errors ----------------------------------------------------------------------------------------


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=180)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


def test_cli_rejects_a_bad_advantage_in_one_line(tmp_path):
    proc = cli([sys.executable, "-m", "rlfabric.cli", "train", "grpo.advantage=foo"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and "grpo.advantage" in lines[0] and "foo" in lines[0], proc.stderr


def test_cli_rejects_an_unknown_reward_before_ray_starts(tmp_path):
    exe = shutil.which("rlfabric")
    command = [exe] if exe else [sys.executable, "-m", "rlfabric.cli"]
    run_dir = tmp_path / "run"
    proc = cli([*command, "train", "rewards.functions=[{name: nope}]", "--run-dir", str(run_dir)], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and "rewards.functions[0]" in lines[0] and "'nope'" in lines[0], proc.stderr
    assert not run_dir.exists()  # nothing was set up: the trainer failed in its constructor
    assert "Ray" not in proc.stderr + proc.stdout


# -- 10. Resume ------------------------------------------------------------------------------------------------


def test_resume_continues_a_grpo_run_from_its_latest_checkpoint(local_ray, tmp_path):
    """A run stopped after step 3 with its latest checkpoint at step 2 (a crash before the final checkpoint)
    continues from step 2 with the checkpoint's weights, policy version, prompt order and KL reference; the step
    it redoes is logged once. Its linear learning-rate decay is stretched over the new total."""
    run_dir = tmp_path / "run"
    first = run_grpo(
        run_dir,
        sft={"steps": 3, "lr": 1e-2},
        grpo={"kl_coef": 0.1, "reference": "actor", "lr": 1e-2, "lr_schedule": "linear"},
        training={"total_steps": 3, "checkpoint_every": 2},
    )
    shutil.rmtree(run_dir / "checkpoints" / "step_000003")  # the finished run's own: as if it crashed before it
    checkpoint = run_dir / "checkpoints" / "step_000002"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["reference_model"] == {"path": "reference_model", "in_run": True}  # the policy after SFT

    trainer = GRPOTrainer.from_run_dir(run_dir, ["training.total_steps=4"], quiet=True)
    try:
        trainer.setup()
        assert (trainer.counters.step, trainer.version) == (2, state["version"])
        published, version, _ = ray.get(trainer.learners[0].publish.remote())
        assert version == state["version"]
        assert ray.get(trainer.generators.handles[0].version.remote()) == state["version"]
        saved = load_causal_lm(str(checkpoint)).state_dict()
        assert max_abs_diff(as_state_dict(ray.get(published[0])), saved) == 0.0
        summary = trainer.train()
    finally:
        trainer.close()

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("phase") == "grpo"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # lr * (1 - t / T): T = 3 for the first session's steps 1-2, T = 4 once resumed
    assert [r["lr"] for r in steps] == pytest.approx([1e-2, 1e-2 * 2 / 3, 1e-2 * 2 / 4, 1e-2 * 1 / 4])
    assert steps[2]["policy_version"] == first.phase("grpo")[2]["policy_version"]  # step 3 redone from v(step 2)
    assert steps[3]["policy_version"] == steps[2]["policy_version"] + 1
    assert [r["label"] for r in rows if r.get("phase") == "eval"] == ["initial", "after_sft", "final"]
    assert summary["steps"] == 4
    assert summary["time_total_s"] > state["elapsed_s"] > 0  # the clock counts both sessions
    assert steps[2]["time_s"] > state["elapsed_s"]
    assert summary["eval_accuracy_initial"] == first.summary["eval_accuracy_initial"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    # the prompt order went on from the checkpoint's: steps 3 and 4 took its last 2 + 2 prompts (taken from the end)
    after = json.loads((run_dir / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert after["order"] == state["order"][:-4]


def test_resume_of_an_async_run_that_ended(local_ray, tmp_path):
    """max_policy_lag 1, no SFT, the KL reference in the learner (the initial model), one checkpoint kept: a run
    that ended continues for one more step from the checkpoint of its last step; the prompts generated ahead are
    taken again; the checkpoint it resumed from is pruned and the first session's final evaluation becomes a step
    evaluation."""
    run_dir = tmp_path / "run"
    run_grpo(
        run_dir,
        grpo={"kl_coef": 0.1, "reference": "learner"},
        training={"total_steps": 3, "checkpoint_every": 2, "keep_checkpoints": 1, "max_policy_lag": 1},
    )
    state = json.loads((run_dir / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    # 64 prompts, 2 a step: 3 steps trained on 6; the 2 of the batch generated ahead for a fourth are kept
    assert len(state["order"]) == 64 - 3 * 2
    assert state["reference_model"] == {"path": "initial_model", "in_run": True}
    summary = train_resumed(run_dir, ["training.total_steps=4", "training.checkpoint_every=1"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("phase") == "grpo"] == [1, 2, 3, 4]
    assert [r["label"] for r in rows if r.get("phase") == "eval"] == ["initial", "step_3", "final"]
    assert summary["steps"] == 4
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000004"]
    # 1 + lag rollouts of 2 prompts were in flight at each step: 4 steps drew 2 x (4 + 1) prompts, the first
    # session's ahead batch (2 prompts) again after the resume.
    after = json.loads((run_dir / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert len(after["order"]) == len(state["order"]) - 2


def train_resumed(run_dir: Path, overrides: list[str]) -> dict:
    trainer = GRPOTrainer.from_run_dir(run_dir, overrides, quiet=True)
    try:
        return trainer.train()
    finally:
        trainer.close()


def test_trainer_state_keeps_where_the_kl_reference_is(tmp_path):
    """Inside the run directory: relative to it (run folders move); a hub id or another folder: as given."""
    from rlfabric.llm_run_state import reference_entry, reference_path

    run_dir = tmp_path / "run"
    (run_dir / "reference_model").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    cases = {
        str(run_dir / "reference_model"): {"path": "reference_model", "in_run": True},
        "Qwen/Qwen2.5-0.5B-Instruct": {"path": "Qwen/Qwen2.5-0.5B-Instruct", "in_run": False},
        str(tmp_path / "elsewhere"): {"path": str((tmp_path / "elsewhere").resolve()), "in_run": False},
    }
    for reference_dir, stored in cases.items():
        entry = json.loads(json.dumps(reference_entry(reference_dir, run_dir)))
        assert entry == stored
        assert Path(reference_path(entry, run_dir)) == Path(reference_dir)
    moved = tmp_path / "moved"
    run_dir.rename(moved)  # a run folder that moved still finds its own reference
    assert reference_path({"path": "reference_model", "in_run": True}, moved) == str(moved / "reference_model")
    assert reference_entry(None, moved) is None and reference_path(None, moved) is None


def test_resume_skips_an_incomplete_checkpoint_and_names_an_unreadable_one(tmp_path):
    run_dir = saved_run(tmp_path, step=2)
    (run_dir / "checkpoints" / "step_000004").mkdir()  # a crash while saving: no trainer_state.json yet
    assert latest_checkpoint(run_dir).name == "step_000002"
    (run_dir / "checkpoints" / "step_000002" / "trainer_state.json").write_text('{"counters": {"st')
    with pytest.raises(ConfigError, match=r"trainer_state.json' cannot be read .*delete that checkpoint folder"):
        GRPOTrainer.from_run_dir(run_dir)


def saved_run(tmp_path: Path, step: int, **sections: dict) -> Path:
    """A run directory as a GRPO run leaves it, reduced to what --resume reads before any actor starts."""
    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / f"step_{step:06d}"
    checkpoint.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(config_from_dict(merged(BASE, sections))))
    (checkpoint / "trainer_state.json").write_text(json.dumps({"counters": {"step": step}, "reference_model": None}))
    (run_dir / "initial_model").mkdir()
    return run_dir


def test_a_run_at_its_total_resumes_only_to_finish_and_a_finished_one_is_refused(tmp_path):
    """A checkpoint at the last step and no summary: the run stopped in its last step or its final evaluation, and
    --resume finishes it. With the summary of a finished run, --resume needs a larger total."""
    run_dir = saved_run(tmp_path, step=3)  # BASE trains 3 steps
    assert GRPOTrainer.from_run_dir(run_dir).resume_from.name == "step_000003"
    (run_dir / "summary.json").write_text('{"algo": "grpo", "steps": 3}')
    with pytest.raises(
        ConfigError,
        match=r"^--resume '.*run': the run finished at step 3 of 3 \(its latest checkpoint, step_000003\); pass "
        r"training.total_steps=N with N > 3 to train longer$",
    ):
        GRPOTrainer.from_run_dir(run_dir)
    assert GRPOTrainer.from_run_dir(run_dir, ["training.total_steps=4"]).cfg.training.total_steps == 4


def test_a_run_saved_before_lr_schedules_resumes_at_the_constant_rate_it_trained_with(tmp_path):
    run_dir = saved_run(tmp_path, step=2, grpo={"lr_schedule": "linear"})
    assert GRPOTrainer.from_run_dir(run_dir).cfg.grpo.lr_schedule == "linear"  # saved: kept
    config = run_dir / "config.yaml"
    config.write_text("".join(line for line in config.read_text().splitlines(True) if "lr_schedule" not in line))
    assert GRPOTrainer.from_run_dir(run_dir).cfg.grpo.lr_schedule == "constant"  # saved before the key existed
    assert GRPOTrainer.from_run_dir(run_dir, ["grpo.lr_schedule=cosine"]).cfg.grpo.lr_schedule == "cosine"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.builtin.hidden_size=64"], r"^model.builtin.hidden_size = 64 is not valid with --resume.* 32$"),
        (["data.train=task:countdown"], r"^data.train = 'task:countdown' is not valid with --resume"),
        (["training.total_steps=1"], r"^training.total_steps = 1 is not valid with --resume: .* at step 2 already"),
        (["grpo.kl_coef=0.1"], r"^grpo.kl_coef = 0.1 is not valid with --resume: this run saved no KL reference"),
    ],
)
def test_resume_refuses_what_the_checkpoint_cannot_continue(tmp_path, overrides, message):
    run_dir = saved_run(tmp_path, step=2, sft={"steps": 3})
    with pytest.raises(ConfigError, match=message):
        GRPOTrainer.from_run_dir(run_dir, overrides)


def test_ctrl_c_stops_a_grpo_run_between_steps_with_a_checkpoint_of_every_step_done(tmp_path):
    """The first SIGINT is honoured at the next step boundary: a checkpoint of the steps done (3 is not a
    checkpoint_every multiple), exit 130 and the --resume hint; the last logged step is the checkpoint's."""
    run_dir = tmp_path / "run"
    overrides = ["sft.steps=0", "training.total_steps=1000", "training.eval_every=0", "training.checkpoint_every=3"]
    tiny = ["model.builtin={num_layers: 1, hidden_size: 32, num_heads: 2, max_positions: 64}", "data.num_eval=4"]
    cmd = [sys.executable, "-m", "rlfabric.cli", "train", *overrides, *tiny, "--run-dir", str(run_dir), "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 150
        while not (run_dir / "checkpoints" / "step_000003" / "trainer_state.json").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 150 s"
            time.sleep(0.1)
        time.sleep(0.3)  # into a step past the checkpoint, most likely
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "stopping after this step" in err and f"--resume {run_dir}" in err, err

    steps = [r["step"] for r in read_metrics(run_dir) if r.get("phase") == "grpo"]
    latest = latest_checkpoint(run_dir)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3
    assert latest is not None and latest.name == f"step_{steps[-1]:06d}", (latest, steps)
    assert json.loads((latest / "trainer_state.json").read_text())["counters"]["step"] == steps[-1]


def test_a_new_run_in_a_used_directory_points_to_resume(tmp_path):
    run_dir = saved_run(tmp_path, step=2)
    with pytest.raises(ConfigError, match=r"already holds a run: continue it with --resume"):
        GRPOTrainer(config_from_dict(BASE), run_dir)


def test_a_new_run_never_writes_over_a_finished_run_without_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("algo: grpo\n")
    (run_dir / "metrics.jsonl").write_text("")
    GRPOTrainer(config_from_dict(BASE), run_dir)  # stopped before its first step: nothing to lose, reused
    (run_dir / "metrics.jsonl").write_text('{"phase": "grpo", "step": 1}\n')
    with pytest.raises(ConfigError, match=r"already holds a run"):  # a training row alone: stopped mid-run
        GRPOTrainer(config_from_dict(BASE), run_dir)
    (run_dir / "metrics.jsonl").write_text("")
    (run_dir / "summary.json").write_text('{"algo": "grpo"}')
    with pytest.raises(ConfigError, match=r"already holds a run"):  # a finished run's summary alone
        GRPOTrainer(config_from_dict(BASE), run_dir)
    (run_dir / "metrics.jsonl").write_text('{"phase": "grpo", "step": 1}\n')
    with pytest.raises(ConfigError, match=r"already holds a run \(it has no checkpoint to resume\): choose another"):
        GRPOTrainer(config_from_dict(BASE), run_dir)
    assert (run_dir / "summary.json").read_text() == '{"algo": "grpo"}'
    # a reward model trained there first (train-rm, or the stage of a run that stopped after it) is reused
    (run_dir / "metrics.jsonl").write_text('{"phase": "rm", "rm_step": 10}\n{"phase": "rm_eval", "rm_step": 10}\n')
    (run_dir / "summary.json").write_text('{"reward_model": "reward_model"}')
    GRPOTrainer(config_from_dict(BASE), run_dir)


def test_a_resumed_run_keeps_the_reward_weights_it_trained_with(tmp_path):
    """Runs save the weights their reward functions declare (format: 0 for arithmetic). A run saved before
    functions declared them weighed a component its config left out 1, and keeps it; its former default format: 0
    where no reward gives format is dropped. A mapping given on resume takes the declared defaults, as a new run."""
    cases = [
        ({"correct": 1.0, "format": 0.0}, [{"name": "arithmetic"}], {"correct": 1.0, "format": 0.0}),  # saved since
        ({"correct": 1.0}, [{"name": "arithmetic"}], {"correct": 1.0, "format": 1.0}),  # saved before: as trained
        ({"format": 0.0}, [{"name": "test_spread"}], {}),  # the former default, for a reward without format
    ]
    for k, (saved, functions, resumed) in enumerate(cases):
        run_dir = saved_run(tmp_path / str(k), step=2, rewards={"functions": functions, "weights": saved})
        assert GRPOTrainer.from_run_dir(run_dir).cfg.rewards.weights == resumed, (saved, functions)
    given = GRPOTrainer.from_run_dir(tmp_path / "1" / "run", ["rewards.weights={correct: 2.0}"])  # saved before
    assert given.cfg.rewards.weights == {"correct": 2.0, "format": 0.0}


def test_cli_resume_without_a_checkpoint_says_so_in_one_line(tmp_path):
    run_dir = saved_run(tmp_path, step=2)  # BASE: checkpoint_every 0
    shutil.rmtree(run_dir / "checkpoints")
    proc = cli([sys.executable, "-m", "rlfabric.cli", "train", "--resume", str(run_dir)], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert error_lines(proc) == [
        f"rlfabric: config error: --resume {str(run_dir)!r}: no checkpoint found under checkpoints/: the run was "
        "started with training.checkpoint_every: 0, which saves none"
    ], proc.stderr
    run_dir = saved_run(tmp_path / "every_2", step=2, training={"checkpoint_every": 2})
    shutil.rmtree(run_dir / "checkpoints")
    with pytest.raises(ConfigError) as info:
        GRPOTrainer.from_run_dir(run_dir)
    assert str(info.value) == (
        f"--resume {str(run_dir)!r}: no checkpoint found under checkpoints/: the run stopped before its first "
        "(training.checkpoint_every: 2)"
    )


def test_cli_resume_refuses_run_dir(tmp_path):
    run_dir = saved_run(tmp_path, step=2)
    proc = cli([sys.executable, "-m", "rlfabric.cli", "train", "--resume", str(run_dir), "--run-dir", "x"], tmp_path)
    assert proc.returncode == 2 and "--run-dir is for new runs" in proc.stderr, proc.stderr


def test_resume_names_a_missing_initial_model(tmp_path):
    run_dir = saved_run(tmp_path, step=2)
    (run_dir / "initial_model").rmdir()
    with pytest.raises(ConfigError, match=r"initial_model/ is missing from the run directory"):
        GRPOTrainer.from_run_dir(run_dir)
