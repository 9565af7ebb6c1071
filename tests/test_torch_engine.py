"""TorchEngine against transformers on small local models: greedy tokens, logprobs, sampling, batching, weights.

Every model here is built locally (character tokenizer, a few random layers); nothing downloads. The random
weights are re-drawn at a larger scale than transformers' init so that greedy decoding produces varied tokens
instead of repeating one, which would make the comparisons weak.
"""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch

from rlfabric.engines.base import SamplingParams
from rlfabric.engines.fast_decoder import _runs
from rlfabric.engines.sampling import sample_from_probs
from rlfabric.engines.torch_engine import TorchEngine
from rlfabric.models.hf import build_char_tokenizer, build_small_model_dir, build_small_qwen2

PROMPTS = ["hello world", "1+2=", "the quick brown fox", "x", "(3*4)-5=?", "abc abc abc abc"]
BOTH_PATHS = pytest.mark.parametrize("fast", [True, False], ids=["fast", "fallback"])
# The fast path decodes with the native attention kernel where it builds (rlfabric.engines.native), else with
# torch ops; the second case forces torch ops, so both are checked against transformers.
ENGINE_PATHS = pytest.mark.parametrize(
    "options",
    [{}, {"native_kernels": False}, {"use_fast_path": False}],
    ids=["fast", "fast-torch-attention", "fallback"],
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(text) for text in PROMPTS]


def sharpen(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Redraw the weights at a larger scale (and non-zero biases) so the model's outputs depend on its input."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if p.dim() == 2:
                p.copy_(noise * 1.5 / math.sqrt(p.shape[-1]))
            elif name.endswith("bias"):
                p.copy_(noise * 0.3)
            else:  # norm weights
                p.copy_(1 + 0.2 * noise)
    return model.eval()


def tiny_model(kind: str, tokenizer) -> torch.nn.Module:
    """A 2-layer, 64-wide model of one of FAST_KINDS or FALLBACK_KINDS (below), sharpened."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    if kind == "qwen2":
        return sharpen(build_small_qwen2(tokenizer, num_layers=2, hidden_size=64))
    ids = {"pad_token_id": 0, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
        **ids,
    }
    configs = {
        "qwen2-gqa": lambda: Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True),
        "qwen2-untied": lambda: Qwen2Config(**common, num_key_value_heads=4, tie_word_embeddings=False),
        # Multi-query attention, biases everywhere, untied head and linear RoPE scaling in one model.
        "llama-mqa-rope-scaled": lambda: LlamaConfig(
            **common,
            num_key_value_heads=1,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
        ),
        # A sliding window shorter than max_seq_len: the fast path does not implement it.
        "mistral-window": lambda: MistralConfig(**common, num_key_value_heads=2, sliding_window=8),
        # Not a Llama-family layout at all.
        "gpt2": lambda: GPT2Config(vocab_size=len(tokenizer), n_positions=256, n_embd=64, n_layer=2, n_head=4, **ids),
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(configs[kind]())
    model.generation_config.pad_token_id = 0
    return sharpen(model)


FAST_KINDS = ["qwen2", "qwen2-gqa", "qwen2-untied", "llama-mqa-rope-scaled"]
FALLBACK_KINDS = ["mistral-window", "gpt2"]


@pytest.fixture(scope="module")
def models(tokenizer):
    """Read-only models by kind (tests that change weights build their own)."""
    return {kind: tiny_model(kind, tokenizer) for kind in FAST_KINDS + FALLBACK_KINDS}


def generate(engine: TorchEngine, prompts, **params):
    return asyncio.run(engine.generate(prompts, SamplingParams(**params)))


def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_ids) -> list[int]:
    """transformers' greedy generate on one prompt alone (no padding), stopping after any of ``stop_ids``."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(stop_ids) or None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) of each completion token, from one full forward pass."""
    ids = torch.tensor([prompt + completion])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return (logits / temperature).log_softmax(-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def first_token_probs(model, prompt: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    return (logits / temperature).softmax(-1)


# ------------------------------------------------------------------------------------------------------------------
# (a) greedy decoding equals transformers, including stopping
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", FAST_KINDS + FALLBACK_KINDS)
@ENGINE_PATHS
def test_greedy_matches_transformers(models, prompts, kind, options):
    model = models[kind]
    fast = options.get("use_fast_path", True)
    engine = TorchEngine(model, [], **options)
    assert engine.uses_fast_path == (fast and kind in FAST_KINDS), engine.fallback_reason

    results = generate(engine, prompts, max_new_tokens=12, temperature=0)
    for prompt, completion in zip(prompts, results, strict=True):
        assert completion.token_ids == hf_greedy(model, prompt, 12, ())
        assert completion.finish_reason == "length" and completion.prompt_ids == prompt

    # Stop on a token greedy decoding emits mid-way through the first prompt: once as the engine's EOS, once as
    # a request's stop_token_ids (on top of the model's own EOS).
    stop = results[0].token_ids[4]
    for engine, params in [
        (TorchEngine(model, [stop], **options), {}),
        (TorchEngine(model, **options), {"stop_token_ids": (stop,)}),
    ]:
        stop_ids = engine.eos_ids | {stop}
        stopped = generate(engine, prompts, max_new_tokens=12, temperature=0, **params)
        for prompt, completion in zip(prompts, stopped, strict=True):
            assert completion.token_ids == hf_greedy(model, prompt, 12, stop_ids)
            assert completion.finish_reason == ("stop" if completion.token_ids[-1] in stop_ids else "length")
        assert stopped[0].finish_reason == "stop" and stopped[0].token_ids[-1] == stop
        assert any(c.finish_reason == "length" for c in stopped)


def test_default_size_model_from_pretrained(tmp_path, tokenizer):
    """The benchmark's 4 x 256 model, saved and loaded as any Hugging Face model would be."""
    path = build_small_model_dir(tmp_path / "model")
    engine = TorchEngine.from_pretrained(path)
    assert engine.uses_fast_path and engine.eos_ids == {tokenizer.eos_token_id}
    model = sharpen(copy.deepcopy(engine.model))
    asyncio.run(engine.load_weights(dict(model.state_dict()), version=1))  # how weights reach a running engine
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    results = generate(engine, prompts, max_new_tokens=16, temperature=0)
    for prompt, completion in zip(prompts, results, strict=True):
        assert completion.token_ids == hf_greedy(model, prompt, 16, engine.eos_ids)
        assert torch.allclose(
            torch.tensor(completion.logprobs), hf_logprobs(model, prompt, completion.token_ids), atol=1e-4
        )


BF16_NOISE = 0.05  # log-probability differences bf16 rounding makes between two correct implementations


def test_bfloat16_fast_path(tokenizer, prompts):
    """bf16 as on GPU: transformers' greedy tokens, except where two tokens tie to within bf16 noise (another
    summation order may round either way; the sequences then part); logprobs within that noise of a full forward."""
    model = tiny_model("llama-mqa-rope-scaled", tokenizer).to(torch.bfloat16)
    engine = TorchEngine(model, [])
    exact = 0
    for prompt, completion in zip(prompts, generate(engine, prompts, max_new_tokens=10, temperature=0), strict=True):
        ours, theirs = completion.token_ids, hf_greedy(model, prompt, 10, ())
        expected = hf_logprobs(model, prompt, ours)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=BF16_NOISE)
        parted = next((t for t, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        if parted is None:
            exact += 1
            continue
        # where they part, transformers' own logits rank both tokens within the noise of each other
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + ours[:parted]])).logits[0, -1].float()
        logp = logits.log_softmax(-1)
        assert logp[theirs[parted]] - logp[ours[parted]] <= BF16_NOISE, (prompt, parted)
    assert exact >= len(prompts) // 2  # a near-tie is the exception, not the rule


def test_fallback_reasons(models):
    assert "sliding_window 8" in TorchEngine(models["mistral-window"]).fallback_reason
    assert "gpt2" in TorchEngine(models["gpt2"]).fallback_reason
    # A window no shorter than every sequence changes nothing, so the fast path can serve it.
    assert TorchEngine(models["mistral-window"], max_seq_len=8).uses_fast_path


# ------------------------------------------------------------------------------------------------------------------
# (b) logprobs equal a full forward pass
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen2-gqa", "llama-mqa-rope-scaled"])
@ENGINE_PATHS
def test_logprobs_match_full_forward(models, prompts, kind, options):
    model = models[kind]
    engine = TorchEngine(model, [], seed=1, **options)
    # Greedy: logprobs at temperature 1. Sampled: at the sampling temperature, never truncated by top-k/top-p.
    for params, temperature in [({"temperature": 0}, 1.0), ({"temperature": 0.7, "top_k": 5, "top_p": 0.9}, 0.7)]:
        for prompt, completion in zip(prompts, generate(engine, prompts, max_new_tokens=10, **params), strict=True):
            expected = hf_logprobs(model, prompt, completion.token_ids, temperature)
            assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


# ------------------------------------------------------------------------------------------------------------------
# (c) concurrent callers
# ------------------------------------------------------------------------------------------------------------------


def test_repeated_prompts_share_one_prefill_and_each_gets_its_own_completion(models, prompts):
    # Repeats in runs and scattered, as GRPO groups and mixed callers give them: the prefill runs each distinct
    # prompt once and copies its cache to every slot that needs it.
    model = models["qwen2-gqa"]
    a, b = prompts[0], prompts[3]
    batch = [a, a, b, a, b, b]
    engine = TorchEngine(model, [], max_batch_size=8)
    greedy = generate(engine, batch, max_new_tokens=6, temperature=0)
    for prompt, completion in zip(batch, greedy, strict=True):
        assert completion.token_ids == hf_greedy(model, prompt, 6, stop_ids=[])
    sampled = generate(engine, batch, max_new_tokens=6, temperature=1.0)
    assert len({tuple(c.token_ids) for c in sampled}) > 2  # the copies sample apart
    for prompt, completion in zip(batch, sampled, strict=True):
        expected = hf_logprobs(model, prompt, completion.token_ids)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


def test_runs_of_equal_neighbours():
    assert _runs([4, 4, 7, 4]) == [(0, 2, 4), (2, 3, 7), (3, 4, 4)]
    assert _runs([]) == []


@BOTH_PATHS
def test_concurrent_callers_get_their_own_results(models, prompts, fast):
    model = models["qwen2-gqa"]
    engine = TorchEngine(model, [], use_fast_path=fast, max_batch_size=8)
    # Ten greedy callers with different prompt sets and lengths; the last five arrive while the first are
    # decoding. Two sampling callers share the batches, so rows with different sampling settings mix.
    greedy_calls = [
        (prompts[i % 6 :] + prompts[: i % 3], SamplingParams(max_new_tokens=4 + 3 * i, temperature=0))
        for i in range(10)
    ]
    sampled_calls = [(prompts[:3], SamplingParams(max_new_tokens=9, temperature=0.8, top_k=7, top_p=0.9))] * 2
    alone = [asyncio.run(engine.generate(*call)) for call in greedy_calls]

    async def together():
        seen_running = []

        async def call(i):
            if i >= 5:
                while engine.num_running == 0:
                    await asyncio.sleep(0.001)
                seen_running.append(engine.num_running)
            return await engine.generate(*(greedy_calls + sampled_calls)[i])

        results = await asyncio.gather(*(call(i) for i in range(12)))
        return results, seen_running

    results, seen_running = asyncio.run(together())
    assert all(n > 0 for n in seen_running)
    for got, want in zip(results[:10], alone, strict=True):
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
        for a, b in zip(got, want, strict=True):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    for sampled in results[10:]:
        for prompt, completion in zip(prompts[:3], sampled, strict=True):
            expected = hf_logprobs(model, prompt, completion.token_ids, temperature=0.8)
            assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


def test_cancelled_caller_frees_its_slots(models, prompts):
    engine = TorchEngine(models["qwen2"], [], max_batch_size=4)

    async def scenario():
        abandoned = asyncio.ensure_future(engine.generate(prompts[:4], SamplingParams(max_new_tokens=200)))
        while engine.num_running == 0:
            await asyncio.sleep(0.001)
        requests = list(engine._decoder.running)  # white-box: how far did they get?
        abandoned.cancel()  # as a deadline would
        with pytest.raises(asyncio.CancelledError):
            await abandoned
        # The batch is full (4 slots), so this call only gets in once the abandoned requests leave.
        return requests, await engine.generate(prompts[:2], SamplingParams(max_new_tokens=5, temperature=0))

    requests, results = asyncio.run(scenario())
    assert [len(c.token_ids) for c in results] == [5, 5] and engine.num_running == 0
    assert all(len(r.tokens) < 100 for r in requests)  # they left the batch instead of running to 200 tokens


# ------------------------------------------------------------------------------------------------------------------
# (d) weight updates
# ------------------------------------------------------------------------------------------------------------------


def perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: t + 0.5 * t.std() * torch.randn(t.shape, generator=generator) for name, t in model.state_dict().items()
    }


@BOTH_PATHS
def test_load_weights_swaps_between_requests(tokenizer, prompts, fast):
    model = tiny_model("qwen2-untied", tokenizer)
    engine = TorchEngine(model, [], use_fast_path=fast)
    before = generate(engine, prompts, max_new_tokens=10, temperature=0)
    assert {c.version for c in before} == {0}

    new_weights = perturbed(model, seed=1)
    asyncio.run(engine.load_weights(new_weights, version=1))
    assert engine.version == 1
    for name, value in new_weights.items():
        assert torch.equal(model.state_dict()[name], value)  # copied in place, by HF name
    after = generate(engine, prompts, max_new_tokens=10, temperature=0)
    assert {c.version for c in after} == {1}
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert [c.token_ids for c in after] == [hf_greedy(model, p, 10, ()) for p in prompts]


@BOTH_PATHS
def test_requests_in_flight_keep_their_version(tokenizer, prompts, fast):
    model = tiny_model("qwen2", tokenizer)
    engine = TorchEngine(model, [], use_fast_path=fast)
    old_reference = [hf_greedy(model, p, 40, ()) for p in prompts]
    new_weights = perturbed(model, seed=2)
    greedy = SamplingParams(max_new_tokens=40, temperature=0)

    async def scenario():
        running = asyncio.ensure_future(engine.generate(prompts, greedy))
        while engine.num_running == 0:
            await asyncio.sleep(0.001)
        swap = asyncio.ensure_future(engine.load_weights(new_weights, version=7))
        await asyncio.sleep(0.01)
        arriving = asyncio.ensure_future(engine.generate(prompts, greedy))  # during the swap: waits for it
        return await running, await swap, await arriving

    old, _, new = asyncio.run(scenario())
    assert [c.version for c in old] == [0] * len(prompts) and [c.token_ids for c in old] == old_reference
    assert [c.version for c in new] == [7] * len(prompts)
    assert [c.token_ids for c in new] == [hf_greedy(model, p, 40, ()) for p in prompts]  # model now has v7


def test_load_weights_rejects_bad_state_dicts(tokenizer):
    model = tiny_model("qwen2", tokenizer)
    engine = TorchEngine(model, [])
    good = {name: t.clone() for name, t in model.state_dict().items()}

    with pytest.raises(ValueError, match=r"unknown names \[model.layers.0.mlp.gate.weight\]"):
        asyncio.run(engine.load_weights({**good, "model.layers.0.mlp.gate.weight": torch.zeros(1)}, version=1))
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"missing names \[model.norm.weight\]"):
        asyncio.run(engine.load_weights(missing, version=1))
    with pytest.raises(ValueError, match=r"shape mismatches \[model.norm.weight: got \(3,\), model has \(64,\)\]"):
        asyncio.run(engine.load_weights({**good, "model.norm.weight": torch.ones(3)}, version=1))
    assert engine.version == 0

    # Tied weights: either name covers both; a partial update is allowed when asked for.
    tied = {k: v for k, v in good.items() if k != "lm_head.weight"}
    asyncio.run(engine.load_weights(tied, version=1))
    asyncio.run(engine.load_weights({"model.norm.weight": torch.full((64,), 2.0)}, version=2, strict=False))
    assert engine.version == 2 and torch.equal(model.model.norm.weight, torch.full((64,), 2.0))


# ------------------------------------------------------------------------------------------------------------------
# (e) sampling
# ------------------------------------------------------------------------------------------------------------------


def assert_frequencies_match(tokens: list[int], probs: torch.Tensor) -> None:
    """Each token's empirical frequency within 4 standard errors of its probability (plus a little slack)."""
    n = len(tokens)
    freq = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double() / n
    tolerance = 4 * (probs * (1 - probs) / n).sqrt() + 2e-3
    assert ((freq - probs).abs() <= tolerance).all(), (freq - probs).abs().max()


@BOTH_PATHS
def test_sampling_matches_the_distribution(tokenizer, prompts, fast):
    model = tiny_model("qwen2-untied", tokenizer)
    with torch.no_grad():
        model.lm_head.weight *= 2  # a peaked distribution: a few likely tokens and a long tail
    engine = TorchEngine(model, [], use_fast_path=fast, seed=3)
    prompt, n = prompts[2], 4000

    def first_tokens(**params):
        return [c.token_ids[0] for c in generate(engine, [prompt] * n, max_new_tokens=1, **params)]

    for temperature in (1.0, 0.6):
        probs = first_token_probs(model, prompt, temperature).double()
        assert probs.max() > 0.1 and (probs > 0.01).sum() >= 4  # the check has teeth
        assert_frequencies_match(first_tokens(temperature=temperature), probs)

    probs = first_token_probs(model, prompt).double()
    top3 = probs.topk(3).indices
    truncated = torch.zeros_like(probs).index_copy(0, top3, probs[top3])
    assert_frequencies_match(first_tokens(top_k=3), truncated / truncated.sum())
    sampled = set(first_tokens(top_p=0.3))
    nucleus = probs.argsort(descending=True)[: int((probs.sort(descending=True).values.cumsum(0) < 0.3).sum()) + 1]
    assert sampled <= set(nucleus.tolist())


def test_sample_from_probs_draws_each_row_from_its_own_distribution():
    """Per-row distributions, zero-probability entries at both ends and in the middle never drawn."""
    rows = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2], [0.1, 0.0, 0.0, 0.0, 0.9], [0.0, 0.0, 1.0, 0.0, 0.0]])
    n = 20_000
    generator = torch.Generator().manual_seed(0)
    draws = sample_from_probs(rows.repeat(n, 1), generator).view(n, len(rows))
    for i, probs in enumerate(rows.double()):
        assert_frequencies_match(draws[:, i].tolist(), probs)
        assert not probs[draws[:, i]].eq(0).any()


@BOTH_PATHS
def test_top_k_1_is_greedy(models, prompts, fast):
    engine = TorchEngine(models["qwen2"], [], use_fast_path=fast)
    greedy = generate(engine, prompts, max_new_tokens=12, temperature=0)
    top1 = generate(engine, prompts, max_new_tokens=12, temperature=1.3, top_k=1)
    assert [c.token_ids for c in top1] == [c.token_ids for c in greedy]


# ------------------------------------------------------------------------------------------------------------------
# (f) finish reasons, limits, shutdown
# ------------------------------------------------------------------------------------------------------------------


def test_finish_reasons_and_length_limits(models, prompts):
    model = models["qwen2"]
    engine = TorchEngine(model, [], max_seq_len=32)
    greedy = generate(engine, prompts[:1], max_new_tokens=8, temperature=0)[0].token_ids
    at = next(i for i in range(2, 8) if greedy[i] not in greedy[:i])  # a token greedy emits first at step `at`
    stop = greedy[at]
    done = generate(engine, prompts[:2], max_new_tokens=8, temperature=0, stop_token_ids=(stop,))
    assert done[0].finish_reason == "stop" and done[0].token_ids == greedy[: at + 1]
    assert done[1].finish_reason == "length" and len(done[1].token_ids) == 8 and stop not in done[1].token_ids
    one = generate(engine, prompts[:1], max_new_tokens=1)
    assert len(one[0].token_ids) == 1 and one[0].finish_reason == "length"

    # prompts[2] is 19 tokens: 19 + 14 = 33 > 32.
    with pytest.raises(ValueError, match=r"prompt 2: 19 prompt tokens \+ max_new_tokens 14 = 33 exceeds .* 32"):
        generate(engine, prompts, max_new_tokens=14)
    assert len(generate(engine, prompts, max_new_tokens=13)[2].token_ids) == 13  # exactly at the limit
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(engine, [[5], []], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt 0 has token ids outside the vocabulary \[0, 80\)"):
        generate(engine, [[5, 80]], max_new_tokens=4)


def test_shutdown_fails_waiting_requests_and_refuses_new_ones(models, prompts):
    engine = TorchEngine(models["qwen2"], [])

    async def scenario():
        pending = asyncio.ensure_future(engine.generate(prompts, SamplingParams(max_new_tokens=100)))
        while engine.num_running == 0:
            await asyncio.sleep(0.001)
        await engine.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            await pending
        with pytest.raises(RuntimeError, match="shut down"):
            await engine.generate(prompts, SamplingParams())

    asyncio.run(scenario())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@BOTH_PATHS
def test_cuda_greedy_matches_transformers(tokenizer, prompts, fast):
    model = tiny_model("qwen2-gqa", tokenizer)
    engine = TorchEngine(model, [], device="cuda", use_fast_path=fast)
    results = generate(engine, prompts, max_new_tokens=12, temperature=0)
    for prompt, completion in zip(prompts, results, strict=True):
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=12, eos_token_id=None
            )
        assert completion.token_ids == out[0, len(prompt) :].tolist()
    sampled = generate(engine, prompts, max_new_tokens=12, temperature=0.8, top_p=0.9)
    for prompt, completion in zip(prompts, sampled, strict=True):
        ids = torch.tensor([prompt + completion.token_ids], device="cuda")
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / 0.8
        expected = logits.log_softmax(-1).gather(1, torch.tensor(completion.token_ids, device="cuda")[:, None])
        assert torch.allclose(torch.tensor(completion.logprobs), expected.squeeze(1).cpu(), atol=1e-3)


# ------------------------------------------------------------------------------------------------------------------
# matmul_dtype: projections in bfloat16, everything else in the model's dtype
# ------------------------------------------------------------------------------------------------------------------


@BOTH_PATHS
def test_bfloat16_matmuls_stay_close_to_float32(models, prompts, fast):
    """Sampled tokens' logprobs under bf16 projections are within bf16 rounding of a float32 forward pass."""
    model = models["qwen2-gqa"]
    engine = TorchEngine(model, [], use_fast_path=fast, matmul_dtype="bfloat16")
    completions = generate(engine, prompts, max_new_tokens=12, temperature=1.0)
    gaps = torch.cat(
        [
            (torch.tensor(c.logprobs) - hf_logprobs(model, p, c.token_ids)).abs()
            for p, c in zip(prompts, completions, strict=True)
        ]
    )
    assert 0 < gaps.max() < 0.15  # not bit-equal (so bf16 really ran), but close
    assert gaps.mean() < 0.03


def test_bfloat16_copies_follow_weight_updates(tokenizer, prompts):
    """The fast path's bf16 copies of the projections are re-made at every load_weights."""
    model = tiny_model("qwen2-untied", tokenizer)
    engine = TorchEngine(model, [], matmul_dtype="bfloat16")
    before = generate(engine, prompts, max_new_tokens=10, temperature=0)
    new_weights = perturbed(model, seed=3)
    asyncio.run(engine.load_weights(new_weights, version=1))
    after = generate(engine, prompts, max_new_tokens=10, temperature=0)

    fresh = tiny_model("qwen2-untied", tokenizer)
    fresh.load_state_dict(new_weights)
    expected = generate(TorchEngine(fresh, [], matmul_dtype="bfloat16"), prompts, max_new_tokens=10, temperature=0)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert [(c.token_ids, c.logprobs) for c in after] == [(c.token_ids, c.logprobs) for c in expected]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("matmul_dtype", ["float32", "bfloat16"])
def test_cpu_fast_path_multiplies_by_onednn_packed_weights(models, matmul_dtype):
    """Every projection and the LM head have a oneDNN pack (the faster CPU matmul); load_weights tests above
    check that the packs follow weight updates."""
    if matmul_dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 on this CPU: the engine uses F.linear there")
    engine = TorchEngine(models["qwen2"], [], matmul_dtype=matmul_dtype)
    assert engine.uses_fast_path
    linears = engine._decoder.linears
    assert len(linears) == 1 + sum(len(p.attn_in) + len(p.mlp_in) + 2 for p in engine._decoder.layers)
    assert all(linear.packed is not None for linear in linears)


def test_unknown_matmul_dtype_is_refused(models):
    with pytest.raises(ValueError, match=r"matmul_dtype = 'bf16'.*bfloat16"):
        TorchEngine(models["qwen2"], [], matmul_dtype="bf16")


# ------------------------------------------------------------------------------------------------------------------
# Session continuation and stop strings (multi-turn)
# ------------------------------------------------------------------------------------------------------------------

SESSION_KINDS = ["qwen2", "qwen2-gqa", "llama-mqa-rope-scaled"]
# Each conversation's env replies, one per turn after the first: different lengths, so the continued prompts of one
# call need different amounts of new prefill (padded rows in one forward).
REPLIES = [["ok", "no, lower please"], ["higher", "x"], ["a much longer reply than the others", "fine"]]


def play_conversations(engine: TorchEngine, tokenizer, prompts, sessions: bool, turns: int = 3, **params):
    """Greedy multi-turn conversations, all in one call per turn: each next prompt is the previous prompt, the
    sampled tokens and the reply's ids appended (token-in/token-out). Returns every turn's completions."""
    keys = [f"conversation-{i}" for i in range(len(prompts))] if sessions else None
    contexts, history = [list(p) for p in prompts], []
    for turn in range(turns):
        completions = asyncio.run(engine.generate(contexts, SamplingParams(temperature=0, **params), sessions=keys))
        history.append(completions)
        if turn + 1 < turns:
            contexts = [
                c.prompt_ids + c.token_ids + tokenizer.encode(REPLIES[i % len(REPLIES)][turn % 2])
                for i, c in enumerate(completions)
            ]
    return history


@pytest.mark.parametrize("kind", SESSION_KINDS)
@pytest.mark.parametrize("native_kernels", [True, False], ids=["native", "torch-attention"])
def test_session_continuation_gives_the_tokens_of_a_full_prefill_and_prefills_only_new_tokens(
    models, tokenizer, prompts, kind, native_kernels
):
    model = models[kind]
    continued = TorchEngine(model, [], native_kernels=native_kernels)
    whole = TorchEngine(model, [], native_kernels=native_kernels)
    with_sessions = play_conversations(continued, tokenizer, prompts[:3], sessions=True, max_new_tokens=6)
    without = play_conversations(whole, tokenizer, prompts[:3], sessions=False, max_new_tokens=6)

    for turn_with, turn_without in zip(with_sessions, without, strict=True):
        assert [c.prompt_ids for c in turn_with] == [c.prompt_ids for c in turn_without]
        assert [c.token_ids for c in turn_with] == [c.token_ids for c in turn_without]
        for c in turn_with:
            assert c.token_ids == hf_greedy(model, c.prompt_ids, 6, ())
            torch.testing.assert_close(
                torch.tensor(c.logprobs), hf_logprobs(model, c.prompt_ids, c.token_ids), atol=1e-4, rtol=0
            )
    # A finished turn leaves prompt + sampled tokens but the last in its session; the next turn prefills the rest.
    expected_new = sum(len(c.prompt_ids) for c in with_sessions[0])
    for before, after in zip(with_sessions, with_sessions[1:], strict=False):
        expected_new += sum(
            len(a.prompt_ids) - (len(b.prompt_ids) + len(b.token_ids) - 1) for a, b in zip(after, before, strict=True)
        )
    stats, baseline = continued.stats(), whole.stats()
    assert stats["prefill_tokens"] == expected_new
    assert baseline["prefill_tokens"] == sum(len(c.prompt_ids) for turn in without for c in turn)
    assert stats["reused_tokens"] == baseline["prefill_tokens"] - expected_new > 0
    assert baseline["reused_tokens"] == 0


def test_sessions_and_fresh_prompts_in_one_call_and_edited_history(models, tokenizer, prompts):
    """A call mixing continued sessions with new prompts, and a session whose next prompt rewrites part of its
    history: only the shared prefix is reused, and every completion is what a full prefill gives."""
    model = models["qwen2-gqa"]
    engine = TorchEngine(model, [])
    greedy = SamplingParams(max_new_tokens=5, temperature=0)
    first = asyncio.run(engine.generate(prompts[:2], greedy, sessions=["a", "b"]))
    kept = first[0].prompt_ids + first[0].token_ids + tokenizer.encode("go on")
    edited = first[1].prompt_ids[:2] + tokenizer.encode("EDITED") + first[1].token_ids  # shares 2 tokens
    second = asyncio.run(engine.generate([kept, prompts[3], edited], greedy, sessions=["a", None, "b"]))
    for c in second:
        assert c.token_ids == hf_greedy(model, c.prompt_ids, 5, ())
    assert engine.stats()["reused_tokens"] == len(first[0].prompt_ids) + len(first[0].token_ids) - 1 + 2


def test_session_cache_evicts_the_oldest_sessions_past_its_budget(models, tokenizer, prompts):
    model = models["qwen2"]
    token_bytes = 2 * 2 * model.config.num_key_value_heads * (64 // model.config.num_attention_heads) * 4
    engine = TorchEngine(model, [], session_cache_mb=40 * token_bytes / 2**20)  # room for 40 tokens
    history = play_conversations(engine, tokenizer, prompts[:3], sessions=True, max_new_tokens=6)
    for turn in history:
        for c in turn:
            assert c.token_ids == hf_greedy(model, c.prompt_ids, 6, ())
    stats = engine.stats()
    assert stats["session_evictions"] > 0
    assert stats["sessions"] < 3 and stats["reused_tokens"] > 0  # not all three conversations fit in 40 tokens


def test_weight_update_clears_the_sessions(tokenizer, prompts):
    model = tiny_model("qwen2", tokenizer)
    engine = TorchEngine(model, [])
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    first = asyncio.run(engine.generate(prompts[:2], greedy, sessions=["a", "b"]))
    asyncio.run(engine.load_weights(perturbed(model, seed=3), version=1))
    assert engine.stats()["sessions"] == 0
    nexts = [c.prompt_ids + c.token_ids + tokenizer.encode("more") for c in first]
    second = asyncio.run(engine.generate(nexts, greedy, sessions=["a", "b"]))
    assert engine.stats()["reused_tokens"] == 0  # stale keys and values were not reused
    assert [c.token_ids for c in second] == [hf_greedy(model, p, 6, ()) for p in nexts]
    assert {c.version for c in second} == {1}


@BOTH_PATHS
def test_stop_strings_end_a_completion_at_their_first_occurrence(models, tokenizer, prompts, fast):
    model = models["qwen2"]
    engine = TorchEngine(model, tokenizer, use_fast_path=fast)
    free = generate(engine, prompts, max_new_tokens=24, temperature=0)
    checked = 0
    for prompt, c in zip(prompts, free, strict=True):
        text = tokenizer.decode(c.token_ids, skip_special_tokens=True)  # special tokens have no text
        if len(text) < 8:
            continue
        stop = text[5:8]  # three characters the completion produces
        end = next(k for k in range(len(c.token_ids) + 1) if stop in tokenizer.decode(c.token_ids[:k], True))
        params = SamplingParams(max_new_tokens=24, temperature=0, stop=[stop, "never produced: 999"])
        stopped = asyncio.run(engine.generate([prompt], params))
        assert stopped[0].token_ids == c.token_ids[:end] and stopped[0].finish_reason == "stop"
        checked += 1
    assert checked >= 3


def test_stop_strings_need_a_tokenizer_and_are_checked(models, prompts):
    engine = TorchEngine(models["qwen2"], [])
    with pytest.raises(ValueError, match="SamplingParams.stop needs the TorchEngine to have a tokenizer"):
        generate(engine, prompts, stop=["</tool_call>"])
    with pytest.raises(ValueError, match="SamplingParams.stop = "):
        SamplingParams(stop="</tool_call>")
    with pytest.raises(ValueError, match="generate: 1 sessions for 2 prompts"):
        asyncio.run(engine.generate(prompts[:2], SamplingParams(), sessions=["a"]))
