"""bfloat16 matmuls for the learner (autocast) with float32 weights, LM head, gradients and logprobs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rlfabric.actors.llm_learner import LLMLearnerCore
from rlfabric.grpo_config import GRPOConfig, SFTConfig
from rlfabric.models.hf import build_char_tokenizer, build_small_model_dir, build_small_qwen2, load_causal_lm
from rlfabric.models.packed_batch import pack_sequences
from rlfabric.models.precision import matmul_precision, resolve_matmul_dtype
from rlfabric.models.sequences import response_logprobs


@pytest.fixture(scope="module")
def model_and_batch():
    tokenizer = build_char_tokenizer()
    model = build_small_qwen2(tokenizer, num_layers=2, hidden_size=64, num_heads=2)
    prompts = [tokenizer.encode(t) for t in ("12+7=", "3+40=", "hello")]
    responses = [tokenizer.encode(t) for t in ("19", "43 ok", "x")]
    batch = pack_sequences(prompts, responses, tokenizer.pad_token_id)
    return model, {k: torch.as_tensor(v) for k, v in batch.items()}


def test_body_runs_in_bfloat16_and_the_head_in_float32(model_and_batch):
    model, b = model_and_batch
    seen = {}
    hooks = [
        model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.update(body=out.dtype)),
        model.lm_head.register_forward_hook(lambda m, a, out: seen.update(head_in=a[0].dtype, head=out.dtype)),
    ]
    try:
        with matmul_precision(model, "bfloat16"):
            model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
        assert seen == {"body": torch.bfloat16, "head_in": torch.float32, "head": torch.float32}
        model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])  # outside: no autocast, no hooks left
        assert seen == {"body": torch.float32, "head_in": torch.float32, "head": torch.float32}
        assert not torch.is_autocast_enabled("cpu")
    finally:
        for hook in hooks:
            hook.remove()


def test_bfloat16_logprobs_and_gradients_stay_close_to_float32(model_and_batch):
    model, b = model_and_batch
    args = (b["input_ids"], b["attention_mask"], int(b["prompt_len"]))
    grads = {}
    logps = {}
    for dtype in ("float32", "bfloat16"):
        model.zero_grad()
        logp, _ = response_logprobs(model, *args, matmul_dtype=dtype)
        (-(logp * b["response_mask"]).sum()).backward()
        logps[dtype] = logp.detach()
        grads[dtype] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert logps["bfloat16"].dtype == torch.float32 and grads["bfloat16"].dtype == torch.float32
    gap = (logps["bfloat16"] - logps["float32"]).abs()
    assert 0 < gap.max() < 0.05
    cosine = torch.nn.functional.cosine_similarity(grads["bfloat16"], grads["float32"], dim=0)
    assert cosine > 0.99
    model.zero_grad()


def test_learner_with_bfloat16_matmuls_trains_float32_weights(tmp_path):
    model_dir = build_small_model_dir(tmp_path / "model", num_layers=1, hidden_size=32, num_heads=2)
    tokenizer = build_char_tokenizer()
    batch = pack_sequences(
        [tokenizer.encode(t) for t in ("1+2=", "5+5=")], [tokenizer.encode("3"), tokenizer.encode("10")], 0
    )
    batch["advantages"] = np.array([1.0, -1.0], dtype=np.float32)
    grpo = {**dataclasses.asdict(GRPOConfig(lr=1e-2)), "norm_length": 4}
    threads = torch.get_num_threads()
    try:
        cores = {
            dtype: LLMLearnerCore(
                str(model_dir), grpo, dataclasses.asdict(SFTConfig()), temperature=1.0, matmul_dtype=dtype
            )
            for dtype in ("float32", "bfloat16")
        }
    finally:
        torch.set_num_threads(threads)
    batch["behaviour_logprobs"] = cores["float32"].logprobs(batch)
    assert np.abs(cores["bfloat16"].logprobs(batch) - batch["behaviour_logprobs"]).max() < 0.05
    before = cores["bfloat16"].state_dict_cpu()
    metrics = cores["bfloat16"].train_step(batch, lr=1e-2)
    after = cores["bfloat16"].state_dict_cpu()
    assert 0 < metrics["logprob_gap"] < 0.05  # behaviour from float32 matmuls, learner's from bfloat16
    assert all(v.dtype == torch.float32 for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_unknown_matmul_dtype_names_the_field():
    with pytest.raises(ValueError, match=r"learner.matmul_dtype = 'bf16': expected one of"):
        resolve_matmul_dtype("bf16", "learner.matmul_dtype")


def test_loading_a_model_in_an_unknown_dtype_names_the_allowed_ones(tmp_path):
    model_dir = build_small_model_dir(tmp_path / "model", num_layers=1, hidden_size=32, num_heads=2)
    with pytest.raises(ValueError, match=r"dtype = 'float64': expected one of \['bfloat16', 'float16', 'float32'\]"):
        load_causal_lm(model_dir, dtype="float64")
    assert next(load_causal_lm(model_dir, dtype="bfloat16").parameters()).dtype == torch.bfloat16


def test_the_learner_trains_without_dropout_so_its_logprobs_are_the_generators(tmp_path):
    """A GPT-2 model saved with dropout 0.5 everywhere: the generators' logprobs come from a plain inference
    forward, and the learner's must equal them (with dropout on they differ by noise on every token), while the
    saved model keeps its config."""
    from transformers import AutoModelForCausalLM, GPT2Config

    tokenizer = build_char_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.5, embd_pdrop=0.5,
        attn_pdrop=0.5, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    batch = pack_sequences(
        [tokenizer.encode(t) for t in ("1+2=", "5+5=")], [tokenizer.encode("3"), tokenizer.encode("10")], 0
    )
    batch["advantages"] = np.array([1.0, -1.0], dtype=np.float32)
    inference = load_causal_lm(tmp_path / "model")  # what a generator runs: dropout inactive
    b = {k: torch.as_tensor(v) for k, v in batch.items()}
    with torch.no_grad():
        logits = inference(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
    prompt_len = int(b["prompt_len"])
    targets = b["input_ids"][:, prompt_len:]
    behaviour = torch.log_softmax(logits[:, prompt_len - 1 : -1], -1).gather(-1, targets[..., None])[..., 0]
    batch["behaviour_logprobs"] = (behaviour * b["response_mask"]).numpy()

    threads = torch.get_num_threads()
    try:
        core = LLMLearnerCore(
            str(tmp_path / "model"), {**dataclasses.asdict(GRPOConfig(lr=1e-3)), "norm_length": 4},
            dataclasses.asdict(SFTConfig()), temperature=1.0,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    metrics = core.train_step(batch, lr=1e-3)
    assert metrics["logprob_gap"] < 1e-5, metrics  # with dropout 0.5 on: 0.08
    core.save(str(tmp_path / "saved"), with_optimizer=False)
    assert GPT2Config.from_pretrained(tmp_path / "saved").attn_pdrop == 0.5
