"""The vLLM engine against the engine contract.

The tests marked ``gpu`` need a CUDA GPU and vLLM installed and are skipped elsewhere; they build a small Qwen2 model
locally (nothing is downloaded), serve it with vLLM and check it against transformers on the same weights. The
others run everywhere: the module imports without vLLM and says how to install it, the weight packing that carries
updates to vLLM's workers round-trips every tensor, and the gate that orders generation and weight swaps.
"""

from __future__ import annotations

import asyncio
import importlib.util
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from rlfabric.engines.base import Completion, SamplingParams
from rlfabric.engines.vllm_engine import INSTALL_HINT, VersionGate, VLLMEngine, pack_weights, unpack_weights
from rlfabric.models.hf import build_char_tokenizer, build_small_qwen2, save_pretrained

HAS_VLLM = importlib.util.find_spec("vllm") is not None

# ---------------------------------------------------------------------------------------------------------------
# Everywhere


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_without_vllm_the_module_imports_and_the_engine_says_how_to_install(tmp_path):
    with pytest.raises(ImportError) as error:
        VLLMEngine(str(tmp_path))
    assert str(error.value) == INSTALL_HINT
    assert "pip install 'rlfabric[vllm]'" in str(error.value)


def test_weight_packing_round_trips_every_tensor():
    shared = torch.randn(4, 6)
    state_dict = {
        "embed.weight": shared,
        "lm_head.weight": shared,  # tied weights share storage
        "transposed": torch.randn(3, 5).t(),  # not contiguous
        "half": torch.randn(7, dtype=torch.bfloat16),
        "index": torch.arange(5),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }
    buckets = list(pack_weights(state_dict, bucket_bytes=64))
    assert len(buckets) > 1
    for bucket in buckets:  # a bucket stays under the bound unless one tensor alone is larger
        assert len(bucket) == 1 or sum(len(data) for *_, data in bucket) <= 64
    unpacked = dict(pair for bucket in buckets for pair in unpack_weights(bucket))
    assert list(unpacked) == list(state_dict)
    for name, tensor in state_dict.items():
        assert unpacked[name].dtype == tensor.dtype, name
        assert torch.equal(unpacked[name], tensor), name


def test_weight_packing_casts_floating_point_tensors_to_the_engine_dtype():
    state_dict = {"w": torch.randn(3, 3), "step": torch.tensor([7])}
    (bucket,) = pack_weights(state_dict, dtype=torch.bfloat16)
    unpacked = dict(unpack_weights(bucket))
    assert unpacked["w"].dtype == torch.bfloat16
    assert torch.equal(unpacked["w"], state_dict["w"].to(torch.bfloat16))
    assert unpacked["step"].dtype == torch.int64


def test_a_weight_swap_waits_for_running_calls_and_holds_new_ones_until_it_is_done():
    async def scenario() -> list[str]:
        gate, log, release = VersionGate(), [], asyncio.Event()

        async def generate(name: str) -> None:
            async with gate.generating():
                log.append(f"{name} start")
                await release.wait()
                log.append(f"{name} end")

        async def swap() -> None:
            async with gate.swapping():
                log.append("swap")

        running = [asyncio.ensure_future(generate("a")), asyncio.ensure_future(generate("b"))]
        await asyncio.sleep(0)
        swapping = asyncio.ensure_future(swap())
        await asyncio.sleep(0)
        arriving = asyncio.ensure_future(generate("c"))
        for _ in range(3):
            await asyncio.sleep(0)
        assert log == ["a start", "b start"] and gate.running == 2  # the swap waits, and so does "c"
        release.set()
        await asyncio.gather(*running, swapping, arriving)
        return log

    log = asyncio.run(scenario())
    assert sorted(log[2:4]) == ["a end", "b end"]
    assert log[4:] == ["swap", "c start", "c end"]


def test_a_cancelled_call_releases_the_gate():
    async def scenario() -> None:
        gate = VersionGate()

        async def generate() -> None:
            async with gate.generating():
                await asyncio.Event().wait()  # never set

        async def swap() -> None:
            async with gate.swapping():
                assert gate.running == 0

        call = asyncio.ensure_future(generate())
        await asyncio.sleep(0)
        assert gate.running == 1
        call.cancel()
        await asyncio.wait_for(swap(), timeout=5)

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------------------------
# On a GPU with vLLM

PROMPTS = ["12+34=", "7*8=", "(3+4)*2=", "Hello", "what is 9-5?", "100/4=", "2+2=", "abc"]


def _small_model(seed: int) -> tuple[Any, Any]:
    """The character tokenizer and a small Qwen2 (4 layers, 256 wide, head_dim 64: a size vLLM's kernels take).

    The final norm's gain is raised so the logits spread out (top-two gaps of 1e-2 rather than 3e-3 on these
    prompts): a random model's nearly flat logits would let rounding differences between vLLM's kernels and
    transformers' decide greedy ties. Sampling still has plenty of entropy (the top token's probability is about 0.2).
    """
    tokenizer = build_char_tokenizer()
    model = build_small_qwen2(tokenizer, num_layers=4, hidden_size=256, num_heads=4, max_positions=512, seed=seed)
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)
    return tokenizer, model.float().eval()


@dataclass
class Served:
    engine: VLLMEngine
    loop: asyncio.AbstractEventLoop
    dtype: str  # what vLLM runs in: "float32" where it can, else "bfloat16"
    tokenizer: Any
    model_a: Any  # the weights the engine was started with
    model_b: Any  # other weights to swap in
    prompts: list[list[int]]

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    @property
    def exact(self) -> bool:
        return self.dtype == "float32"

    @property
    def atol(self) -> float:
        return 2e-3 if self.exact else 1e-1


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    tokenizer, model_a = _small_model(seed=0)
    _, model_b = _small_model(seed=1)
    path = save_pretrained(model_a, tokenizer, tmp_path_factory.mktemp("vllm") / "model")
    loop = asyncio.new_event_loop()  # one loop for every test: vLLM's output handler lives on the first one used
    engine, failures = None, []
    for dtype in ("float32", "bfloat16"):  # fp32 for exact comparisons where vLLM's attention backends take it
        try:
            engine = VLLMEngine(
                str(path), dtype=dtype, gpu_memory_utilization=0.25, max_model_len=512, enforce_eager=True, seed=0
            )
            break
        except Exception as error:  # noqa: BLE001 - report why and try the next dtype
            failures.append(f"{dtype}: {type(error).__name__}: {error}")
    if engine is None:
        pytest.fail("vLLM could not serve the small model: " + " | ".join(failures))
    if failures:
        print("vLLM runs the small model in bfloat16, looser comparisons:", *failures)
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]
    served = Served(engine, loop, dtype, tokenizer, model_a, model_b, prompts)
    yield served
    served.run(engine.shutdown())
    loop.close()


def _hf_greedy(model: Any, prompt: list[int], max_new_tokens: int, tokenizer: Any) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return out[0, len(prompt) :].tolist()


def _hf_logprobs(model: Any, completion: Completion, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log_softmax(logits / T) of each generated token, and of the most likely token at each step."""
    ids = torch.tensor([completion.prompt_ids + completion.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(completion.prompt_ids) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    chosen = logprobs[torch.arange(len(completion.token_ids)), torch.tensor(completion.token_ids)]
    return chosen, logprobs.max(dim=-1).values


def _check(served: Served, model: Any, completions: list[Completion], params: SamplingParams, version: int) -> None:
    """Shape, finish reason and version of each completion, and its logprobs against a transformers forward pass."""
    assert len(completions) == len(served.prompts)
    eos = served.tokenizer.eos_token_id
    stops = {eos, *params.stop_token_ids}
    for prompt, completion in zip(served.prompts, completions, strict=True):
        assert completion.prompt_ids == prompt
        assert completion.version == version
        assert 1 <= len(completion.token_ids) == len(completion.logprobs) <= params.max_new_tokens
        assert not stops & set(completion.token_ids[:-1])
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] in stops
        else:
            assert completion.finish_reason == "length" and len(completion.token_ids) == params.max_new_tokens
        chosen, best = _hf_logprobs(model, completion, params.temperature)
        torch.testing.assert_close(torch.tensor(completion.logprobs), chosen, atol=served.atol, rtol=0)
        if params.temperature == 0:  # greedy: every token is transformers' argmax, up to rounding
            assert bool((chosen >= best - served.atol).all())


def _greedy(served: Served, max_new_tokens: int = 24) -> tuple[SamplingParams, list[Completion]]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    return params, served.run(served.engine.generate(served.prompts, params))


@pytest.mark.gpu
def test_greedy_generation_matches_transformers(served):
    params, completions = _greedy(served)
    _check(served, served.model_a, completions, params, served.engine.version)
    if served.exact:
        for completion in completions:
            expected = _hf_greedy(served.model_a, completion.prompt_ids, params.max_new_tokens, served.tokenizer)
            assert completion.token_ids == expected


@pytest.mark.gpu
def test_sampled_logprobs_are_log_softmax_of_logits_over_temperature(served):
    for temperature in (0.7, 1.0, 1.3):
        params = SamplingParams(max_new_tokens=32, temperature=temperature)
        completions = served.run(served.engine.generate(served.prompts, params))
        _check(served, served.model_a, completions, params, served.engine.version)
    group = served.run(served.engine.generate([served.prompts[0]] * 8, SamplingParams(max_new_tokens=32)))
    assert len({tuple(completion.token_ids) for completion in group}) > 1  # it samples


@pytest.mark.gpu
def test_stop_token_ids_end_generation_on_that_token(served):
    _, reference = _greedy(served, max_new_tokens=32)
    prompt, tokens = next((c.prompt_ids, c.token_ids) for c in reference if len(c.token_ids) >= 3)
    stop = tokens[1]
    params = SamplingParams(max_new_tokens=32, temperature=0.0, stop_token_ids=(stop,))
    (completion,) = served.run(served.engine.generate([prompt], params))
    assert completion.finish_reason == "stop"
    assert completion.token_ids == tokens[: tokens.index(stop) + 1]


@pytest.mark.gpu
def test_concurrent_callers_get_their_own_completions(served):
    params, alone = _greedy(served)
    chunks = [served.prompts[i::4] for i in range(4)]

    async def together() -> list[list[Completion]]:
        return await asyncio.gather(*(served.engine.generate(chunk, params) for chunk in chunks))

    results = served.run(together())
    for chunk, completions in zip(chunks, results, strict=True):
        assert [c.prompt_ids for c in completions] == chunk
    by_prompt = {tuple(c.prompt_ids): c for completions in results for c in completions}
    together_in_order = [by_prompt[tuple(prompt)] for prompt in served.prompts]
    _check(served, served.model_a, together_in_order, params, served.engine.version)
    if served.exact:
        assert [c.token_ids for c in together_in_order] == [c.token_ids for c in alone]


@pytest.mark.gpu
def test_load_weights_swaps_weights_in_place_and_tags_the_version(served):
    engine = served.engine
    start = engine.version
    params, before = _greedy(served)
    served.run(engine.load_weights(served.model_b.state_dict(), version=start + 1))
    assert engine.version == start + 1
    _, after = _greedy(served)
    _check(served, served.model_b, after, params, start + 1)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    if served.exact:
        for completion in after:
            expected = _hf_greedy(served.model_b, completion.prompt_ids, params.max_new_tokens, served.tokenizer)
            assert completion.token_ids == expected
    # And back: the first weights give the first completions again.
    served.run(engine.load_weights(served.model_a.state_dict(), version=start + 2))
    _, again = _greedy(served)
    _check(served, served.model_a, again, params, start + 2)
    if served.exact:
        assert [c.token_ids for c in again] == [c.token_ids for c in before]


@pytest.mark.gpu
def test_requests_in_flight_finish_on_the_old_weights_and_later_ones_wait_for_the_new(served):
    engine = served.engine
    start = engine.version
    params = SamplingParams(max_new_tokens=200, temperature=0.0)

    async def scenario() -> tuple[list[Completion], list[Completion], list[Completion]]:
        reference = await engine.generate(served.prompts, params)
        in_flight = asyncio.ensure_future(engine.generate(served.prompts, params))
        await asyncio.sleep(0)  # the call is now running
        swap = asyncio.ensure_future(engine.load_weights(served.model_b.state_dict(), version=start + 1))
        await asyncio.sleep(0)  # the swap has closed the gate and waits for the call
        assert not swap.done() and engine.version == start
        arriving = asyncio.ensure_future(engine.generate(served.prompts, params))
        old, _, new = await asyncio.gather(in_flight, swap, arriving)
        return reference, old, new

    reference, old, new = served.run(scenario())
    assert all(c.version == start for c in old) and all(c.version == start + 1 for c in new)
    _check(served, served.model_a, old, params, start)
    _check(served, served.model_b, new, params, start + 1)
    if served.exact:
        assert [c.token_ids for c in old] == [c.token_ids for c in reference]
    assert [c.token_ids for c in new] != [c.token_ids for c in old]
    served.run(engine.load_weights(served.model_a.state_dict(), version=start + 2))


@pytest.mark.gpu
def test_the_engine_keeps_the_arguments_its_contract_depends_on(served, tmp_path):
    with pytest.raises(ValueError, match="logprobs_mode"):
        VLLMEngine(str(tmp_path), logprobs_mode="raw_logprobs")
