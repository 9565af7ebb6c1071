"""Likelihood rewards: a frozen model's and the synced policy's teacher-forced log-probability of a reference text,
checked against forward passes done here by hand; a sample that cannot be scored fails alone; a scorer call past
its deadline is cancelled; bad kwargs; the scorer's resources; a killed scorer survived."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from grpo_runs import BASE, TINY, merged, run_grpo

from rlfabric.actors.likelihood_scorer import LikelihoodScorer
from rlfabric.actors.reward_service import RewardServiceCore
from rlfabric.config import ConfigError, config_from_dict
from rlfabric.likelihood_scorers import SCORER_NAME_PREFIX
from rlfabric.llm_actors import actor_requests
from rlfabric.llm_driver import GRPOTrainer
from rlfabric.llm_run_state import FINAL_MODEL_DIR, INITIAL_MODEL_DIR, SAMPLES_FILE, checkpoints
from rlfabric.models.hf import build_small_model_dir
from rlfabric.placement import check_fits
from rlfabric.rewards import RewardInput, Unscored, pointwise, register_reward, resolve_reward
from rlfabric.rewards.likelihood import get_or_cancel

TARGET = "= {answer}"  # the reference answer after the completion


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_small_model_dir(tmp_path_factory.mktemp("lm") / "model", seed=3, **TINY)


def direct_logprobs(folder: Path | str, context: str, target: str) -> np.ndarray:
    """log softmax(logits)[next token] at each target token, from one unpadded forward pass of transformers."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    tgt = tokenizer(target, add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ctx + tgt])).logits[0]
    logp = torch.log_softmax(logits, dim=-1)
    return np.array([logp[len(ctx) + k - 1, tgt[k]].item() for k in range(len(tgt))])


def sample(prompt: str, completion: str, answer: str) -> RewardInput:
    return RewardInput(prompt, completion, {"answer": answer}, "stop", len(completion))


def test_a_frozen_likelihood_reward_is_the_teacher_forced_logprob_of_a_direct_forward_pass(model_dir):
    groups = [
        [sample("3+4=", "7", "7"), sample("3+4=", "12 then 7", "7")],
        [sample("10+25=", "", "35"), sample("10+25=", "3", "35"), sample("10+25=", "35 ok", "35")],
    ]
    frozen = {"target": TARGET, "weights": str(model_dir), "separator": "\n", "batch_size": 2}
    service = RewardServiceCore(
        [
            {"name": "likelihood", "kwargs": frozen},
            {"name": "likelihood", "kwargs": {**frozen, "reduce": "sum", "component": "total"}},
            {"name": "likelihood", "kwargs": {**frozen, "reduce": "mean_prob", "component": "prob"}},
            {"name": "likelihood", "kwargs": {**frozen, "improvement": True, "component": "gain"}},
            {"name": "teacher_logprob", "kwargs": {"path": str(model_dir)}},
        ],
        30.0,
    )
    results = service.score(groups)
    for group, scored in zip(groups, results, strict=True):
        for s, r in zip(group, scored, strict=True):
            assert r.error is None, r.error
            with_it = direct_logprobs(model_dir, s.prompt + s.completion + "\n", "= " + s.metadata["answer"])
            without = direct_logprobs(model_dir, s.prompt + "\n", "= " + s.metadata["answer"])
            assert set(r.components) == {"likelihood", "total", "prob", "gain", "teacher_logprob"}  # no version
            assert r.components["likelihood"] == pytest.approx(with_it.mean(), abs=1e-4)
            assert r.components["total"] == pytest.approx(with_it.sum(), abs=1e-4)
            assert r.components["prob"] == pytest.approx(np.exp(with_it).mean(), abs=1e-5)
            assert r.components["gain"] == pytest.approx(with_it.mean() - without.mean(), abs=1e-4)
            teacher = direct_logprobs(model_dir, s.prompt, s.completion).mean() if s.completion else 0.0
            assert r.components["teacher_logprob"] == pytest.approx(teacher, abs=1e-4)
    means = [r.components["likelihood"] for g in results for r in g]
    assert len(set(np.round(means, 4))) == len(means)  # the completions matter


def test_a_row_longer_than_max_length_keeps_the_target_whole_and_the_end_of_the_context(model_dir):
    long = sample("1+2+3+4+5+6+7+8=", "36 is the sum", "36")
    spec = {"name": "likelihood", "kwargs": {"target": TARGET, "weights": str(model_dir), "max_length": 8}}
    (got,) = resolve_reward(spec)([long])
    # 8 tokens: the target "= 36" and the context's last 4 characters (the character tokenizer: one per char)
    expected = direct_logprobs(model_dir, (long.prompt + long.completion)[-4:], "= 36").mean()
    assert got["likelihood"] == pytest.approx(expected, abs=1e-4)


def test_a_sample_that_cannot_be_scored_fails_alone_and_the_others_are_scored(model_dir):
    good = [sample("3+4=", "7", "7"), sample("10+25=", "35", "35")]
    empty_answer = sample("3+4=", "7", "")
    no_answer = RewardInput("3+4=", "7", {"question": "3+4"}, "stop", 1)
    too_long = sample("3+4=", "7", "1" * 12)  # 12 target tokens (one per character) fill max_length 12
    frozen = {"weights": str(model_dir), "max_length": 12}  # target: the answer itself
    service = RewardServiceCore([{"name": "likelihood", "kwargs": frozen}], 30.0)
    (first, empty, missing), (long, second) = service.score([[good[0], empty_answer, no_answer], [too_long, good[1]]])
    assert empty.error == "likelihood: the target is empty: nothing to score"
    assert missing.error.startswith("likelihood: target 'answer' needs metadata['answer']; this sample's metadata")
    assert "the target's 12 tokens fill the 12" in long.error
    for s, r in ((good[0], first), (good[1], second)):
        assert r.error is None, r.error
        expected = direct_logprobs(model_dir, s.prompt + s.completion, s.metadata["answer"]).mean()
        assert r.components["likelihood"] == pytest.approx(expected, abs=1e-4)

    # improvement: a baseline that cannot be scored (no prompt before the target) fails its sample alone.
    gain = RewardServiceCore([{"name": "likelihood", "kwargs": {**frozen, "improvement": True}}], 30.0)
    ((no_prompt, scored),) = gain.score([[sample("", "7", "7"), good[0]]])
    assert no_prompt.error.startswith("likelihood: with the prompt alone as context (improvement): cannot score")
    with_it = direct_logprobs(model_dir, "3+4=7", "7").mean()
    assert scored.components["likelihood"] == pytest.approx(with_it - direct_logprobs(model_dir, "3+4=", "7").mean())

    # teacher_logprob: a completion that fills the teacher's context, or follows an empty prompt, fails alone.
    teacher = RewardServiceCore([{"name": "teacher_logprob", "kwargs": {"path": str(model_dir), "max_length": 8}}], 30)
    ((fits, overlong, unprompted),) = teacher.score([[good[0], sample("3+4=", "7" * 8, "7"), sample("", "7", "7")]])
    assert fits.components["teacher_logprob"] == pytest.approx(direct_logprobs(model_dir, "3+4=", "7").mean(), abs=1e-4)
    assert "the completion as the teacher's target" in overlong.error and "8 tokens fill the 8" in overlong.error
    assert "the context is empty" in unprompted.error


CHECKED_FIELD = r"rewards\.functions\[1\]\.kwargs"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"weights": "no/such/model"}, r"weights = 'no/such/model': expected 'policy' .* or the folder of a causal LM"),
        ({"reduce": "max"}, r"reduce = 'max': expected one of mean, sum, mean_prob"),
        ({"target": "= {}"}, r"target = '= \{\}': a template's fields name metadata keys"),
        ({"target": "= {answer"}, r"target = '= \{answer': not a valid template"),
        ({"batch_size": 0}, r"batch_size = 0: must be an integer >= 1"),
        ({"scorer_gpus": -1}, r"scorer_gpus = -1: must be a number >= 0"),
        ({"temperature": 0.5}, r"reward 'likelihood' cannot take them"),
    ],
)
def test_bad_likelihood_kwargs_are_one_config_error_naming_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=CHECKED_FIELD + ".*" + message):
        resolve_reward({"name": "likelihood", "kwargs": kwargs}, "rewards.functions[1]")


def test_a_teacher_without_a_model_and_a_bad_shadow_likelihood_fail_before_any_actor_starts(tmp_path, no_ray):
    with pytest.raises(ConfigError, match=r"rewards\.functions\[0\]\.kwargs: .* path = '': give the folder"):
        resolve_reward({"name": "teacher_logprob"}, "rewards.functions[0]")
    cfg = config_from_dict(
        merged(BASE, {"rewards": {"shadow": {"functions": [{"name": "likelihood", "kwargs": {"reduce": "max"}}]}}})
    )
    with pytest.raises(ConfigError, match=r"^rewards\.shadow\.functions\[0\]\.kwargs: .*reduce = 'max'"):
        GRPOTrainer(cfg, tmp_path / "run", quiet=True)
    assert not ray.is_initialized()


def test_the_policy_scorer_is_counted_with_the_resources_its_kwargs_ask_for():
    policy = {"name": "likelihood", "kwargs": {"weights": "policy", "scorer_cpus": 1.5}}
    cfg = config_from_dict(merged(BASE, {"rewards": {"functions": [{"name": "arithmetic"}, policy]}}))
    (scorer,) = [r for r in actor_requests(cfg) if r.role.startswith("likelihood scorer")]
    assert (scorer.count, dict(scorer.resources)) == (1, {"CPU": 1.5, "GPU": 0.0})
    assert "rewards.functions[1].kwargs.scorer_cpus" in scorer.role
    with pytest.raises(ConfigError, match=r"likelihood scorer \(rewards\.functions\[1\]\.kwargs\.scorer_cpus"):
        check_fits(actor_requests(cfg), [{"CPU": 2.0}])  # 0.5 + 0.5 + 0.25 + 1.5 > 2
    frozen_only = config_from_dict(merged(BASE, {"rewards": {"functions": [{"name": "arithmetic"}]}}))
    assert not [r for r in actor_requests(frozen_only) if r.role.startswith("likelihood scorer")]


# -- the synced policy: the scorer actor, then a real GRPO run ---------------------------------------------------


@ray.remote(num_cpus=0)
class Gate:
    """A call that returns once ``open`` is called."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()

    async def wait(self) -> None:
        await self.opened.wait()

    async def open(self) -> None:
        self.opened.set()


def test_a_scorer_call_past_its_deadline_is_cancelled_and_a_row_it_cannot_score_fails_alone(model_dir, local_ray):
    scorer = LikelihoodScorer.options(name="test-scorer", num_cpus=0).remote(str(model_dir))  # kept: it lives
    kwargs = {"weights": "policy", "scorer": "test-scorer", "max_length": 12, "timeout_s": 60}
    reward = resolve_reward({"name": "likelihood", "kwargs": kwargs})
    good = sample("3+4=", "7", "7")
    scored, empty = reward([good, sample("3+4=", "7", "")])
    assert scored["likelihood_version"] == 0
    assert scored["likelihood"] == pytest.approx(direct_logprobs(model_dir, "3+4=7", "7").mean(), abs=1e-4)
    assert empty == Unscored("the target is empty: nothing to score")

    # The scorer runs one call at a time: held in a weight load that waits on the gate, it answers nothing.
    gate = Gate.remote()
    held = scorer.update_weights.remote([gate.wait.remote()], 1)  # fails once the gate opens: it only holds
    with pytest.raises(ray.exceptions.GetTimeoutError):  # the deadline passes whatever it is: nothing answers
        resolve_reward({"name": "likelihood", "kwargs": {**kwargs, "timeout_s": 0.5}})([good])
    late = scorer.score.remote(["3+4=7"], ["7"], 1)
    with pytest.raises(ray.exceptions.GetTimeoutError):
        get_or_cancel(late, 0.5)
    ray.get(gate.open.remote())
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(held)
    with pytest.raises(ray.exceptions.TaskCancelledError):  # dropped from the queue: it never runs
        ray.get(late)
    assert reward([good])[0]["likelihood"] == pytest.approx(scored["likelihood"])


def record_scored(inputs: list[RewardInput], *, path: str) -> list[dict[str, float]]:
    """Appends each scored sample to ``path`` (one call's samples after the last's), scoring nothing."""
    with open(path, "a") as f:
        for s in inputs:
            f.write(json.dumps({"prompt": s.prompt, "completion": s.completion, "answer": s.metadata["answer"]}) + "\n")
    return [{} for _ in inputs]


register_reward("record_scored", record_scored)


def direct_mean(folder: Path | str, prompt: str, completion: str, answer: str) -> float:
    return float(direct_logprobs(folder, prompt + completion, "= " + answer).mean())


def test_a_policy_likelihood_reward_follows_the_published_weights_and_equals_a_direct_forward(tmp_path, local_ray):
    scored_file = tmp_path / "scored.jsonl"
    run_dir = tmp_path / "run"
    run = run_grpo(
        run_dir,
        rewards={
            "functions": [
                {"name": "likelihood", "kwargs": {"target": TARGET, "weights": "policy", "batch_size": 4}},
                {"name": "record_scored", "kwargs": {"path": str(scored_file)}},
            ]
        },
        grpo={"lr": 1e-2},  # large steps: the weights move visibly in two
        training={"total_steps": 2, "checkpoint_every": 1},
    )
    assert run.summary["policy_version"] == 2 and run.summary["failed_samples"] == 0
    scored = [json.loads(line) for line in scored_file.read_text().splitlines()]
    calls = [scored[i : i + 8] for i in range(0, len(scored), 8)]  # initial eval, step 1, step 2, final eval
    assert len(scored) == 32
    weights = {0: run_dir / INITIAL_MODEL_DIR, 1: checkpoints(run_dir).path(1), 2: run_dir / FINAL_MODEL_DIR}

    # Each training step's mean reward is the mean of direct forwards with the weights of the version it reports.
    for step, row in enumerate(run.phase("grpo"), start=1):
        assert row["reward_likelihood_version"] == step - 1  # sync: scored by the policy that sampled the step
        expected = np.mean([direct_mean(weights[step - 1], **s) for s in calls[step]])
        assert row["reward_likelihood"] == pytest.approx(expected, abs=1e-4)
        assert row["reward_mean"] == pytest.approx(expected, abs=1e-4)  # the version is weighted 0
    initial = run.phase("eval")[0]
    assert initial["eval_reward_mean"] == pytest.approx(np.mean([direct_mean(weights[0], **s) for s in calls[0]]))

    # The final evaluation, sample by sample: the current (version 2) weights, not the first ones.
    shown = [json.loads(line) for line in (run_dir / SAMPLES_FILE).read_text().splitlines()]
    assert len(shown) == 8
    changed = []
    for s in shown:
        args = (s["prompt"], s["completion"], s["metadata"]["answer"])
        assert s["components"]["likelihood_version"] == 2
        assert s["components"]["likelihood"] == pytest.approx(direct_mean(weights[2], *args), abs=1e-4)
        changed.append(abs(s["components"]["likelihood"] - direct_mean(weights[0], *args)))
    assert min(changed) > 1e-3  # the reward moved with the weights on every sample


# -- a scorer that dies -------------------------------------------------------------------------------------------


@pointwise
def kill_scorer_on_call(inputs: list[RewardInput], *, path: str, call: int) -> list[dict[str, float]]:
    """Counts its calls in ``path``; on call number ``call``, SIGKILLs the run's likelihood scorer (listed before
    the likelihood reward, it runs first) and returns once Ray reports it dead."""
    calls = int(Path(path).read_text()) + 1 if Path(path).exists() else 1
    Path(path).write_text(str(calls))
    if calls == call:
        (name,) = [n for n in ray.util.list_named_actors() if n.startswith(SCORER_NAME_PREFIX)]
        scorer = ray.get_actor(name)
        os.kill(ray.get(scorer.pid.remote()), signal.SIGKILL)
        try:
            ray.get(scorer.pid.remote(), timeout=120)
        except ray.exceptions.RayActorError:
            pass
        else:
            raise AssertionError("the scorer answered after SIGKILL")
    return [{} for _ in inputs]


register_reward("kill_scorer_on_call", kill_scorer_on_call)


def test_a_killed_scorer_costs_only_the_groups_it_was_scoring_and_is_replaced(tmp_path, local_ray):
    run = run_grpo(
        tmp_path / "run",
        rewards={
            "functions": [
                {"name": "kill_scorer_on_call", "kwargs": {"path": str(tmp_path / "calls"), "call": 2}},
                {"name": "likelihood", "kwargs": {"target": TARGET}},  # weights: policy by default
            ]
        },
        learner={"weight_transport": "object_store"},  # the test above leaves it at auto: shared memory here
        training={"total_steps": 3, "checkpoint_every": 3},
    )
    assert run.summary["weight_transport"] == "object_store"
    first, second, third = run.phase("grpo")
    # Call 1 is the initial evaluation; call 2, step 1's groups, meets a dead scorer: all 8 samples fail.
    assert first["trained_samples"] == 0 and first["failed_samples"] == 8
    assert first["likelihood_scorer_restarts"] == 1  # replaced after that step, not at the next publication
    assert (second["trained_samples"], third["trained_samples"]) == (8, 8)
    assert (second["reward_likelihood_version"], third["reward_likelihood_version"]) == (0, 1)
    assert third["likelihood_scorer_restarts"] == 1 and third["failed_samples"] == 8
    assert run.summary["trained_samples"] == 16 and run.summary["policy_version"] == 2
    # A resumed run starts a new scorer; the restart of the first session still counts.
    trainer = GRPOTrainer.from_run_dir(tmp_path / "run", ["training.total_steps=4"], quiet=True)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    fourth = [r for r in rows if r.get("phase") == "grpo"][-1]
    assert fourth["step"] == 4 and fourth["likelihood_scorer_restarts"] == 1
    assert summary["likelihood_scorer_restarts"] == 1
