"""CUDA checks of what multi-turn agent training runs on a GPU, without Ray or vLLM (a bare CUDA torch image):

1. the torch engine's session continuation on CUDA: three-turn conversations, each turn continuing its session's
   stored KV, give exactly the greedy tokens of prefilling the whole conversation again;
2. the GRPO objective with per-token step-credit advantages (GiGPO over hand-made step groups, laid onto the
   tokens) gives the same loss and gradient on CUDA as on the CPU;
3. learner throughput on CUDA: forward and backward of a 4 x 256 Qwen2-style model on 64 sequences of 256 tokens,
   float32 and bfloat16 autocast, tokens per second.

    python scripts/gpu_agent_check.py      # exit 0 when 1 and 2 hold

On an image with CUDA torch and transformers but neither Ray nor Gymnasium, give ``import rlfabric`` two empty
stand-ins first (nothing here uses them): a ``gymnasium`` package holding ``class Env`` and ``registry = {}``, and a
``ray`` package whose ``cloudpickle`` is the ``cloudpickle`` package or ``pickle``, on PYTHONPATH.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlfabric.algorithms.grpo import policy_objective  # noqa: E402
from rlfabric.algorithms.step_credit import gigpo_advantages  # noqa: E402
from rlfabric.engines.base import SamplingParams  # noqa: E402
from rlfabric.engines.torch_engine import TorchEngine  # noqa: E402
from rlfabric.models.hf import build_char_tokenizer, build_small_qwen2  # noqa: E402


def conversations(engine: TorchEngine, tokenizer, sessions: bool) -> list[list[int]]:
    """Three greedy turns of four conversations; each turn appends the sampled ids and a fixed reply."""
    contexts = [tokenizer.encode(t) for t in ("hello", "1+2=", "the fox", "abc abc")]
    keys = [f"c{i}" for i in range(len(contexts))] if sessions else None
    sampled = []
    for turn in range(3):
        out = asyncio.run(engine.generate(contexts, SamplingParams(temperature=0, max_new_tokens=8), sessions=keys))
        sampled.append([c.token_ids for c in out])
        reply = tokenizer.encode(f" ok{turn} ")
        contexts = [ctx + c.token_ids + reply for ctx, c in zip(contexts, out, strict=True)]
    return sampled


def check_sessions() -> bool:
    tokenizer = build_char_tokenizer()
    model = build_small_qwen2(tokenizer, num_layers=2, hidden_size=64).eval()
    continued = conversations(TorchEngine(model, [], device="cuda"), tokenizer, sessions=True)
    whole = conversations(TorchEngine(model, [], device="cuda"), tokenizer, sessions=False)
    ok = continued == whole
    print(f"1. session continuation on CUDA = full prefill, 3 turns x 4 conversations: {ok}")
    return ok


def check_step_credit_loss() -> bool:
    # Two groups of two episodes, two steps each; steps 0 of a group share a state, steps 1 do not.
    step_row = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    group = np.array([0, 0, 1, 1])
    step_rewards = np.array([0.0, 1.0, 0.0, 0.0, 0.5, 0.0, 0.0, 1.0], np.float32)
    episode_rewards = np.array([1.0, 0.0, 0.5, 1.0], np.float32)
    keys = np.array(["s0", "a", "s0", "b", "s1", "c", "s1", "d"], dtype=object)
    advantages = gigpo_advantages(step_row, group, step_rewards, episode_rewards, keys, omega=1.0, gamma=0.9)
    token_adv = np.repeat(advantages.reshape(4, 2), 5, axis=1).astype(np.float32)  # 5 tokens per step
    generator = torch.Generator().manual_seed(0)
    new = torch.randn(4, 10, generator=generator) * 0.1 - 1.0
    old = new.detach() + torch.randn(4, 10, generator=generator) * 0.05
    mask = torch.ones(4, 10)
    results = []
    for device in ("cpu", "cuda"):
        logp = new.clone().to(device).requires_grad_(True)
        loss, _ = policy_objective(logp, old.to(device), torch.from_numpy(token_adv).to(device), mask.to(device))
        loss.backward()
        results.append((loss.item(), logp.grad.cpu()))
    (cpu_loss, cpu_grad), (gpu_loss, gpu_grad) = results
    ok = abs(cpu_loss - gpu_loss) < 1e-5 and torch.allclose(cpu_grad, gpu_grad, atol=1e-6)
    print(f"2. GiGPO per-token loss, CPU {cpu_loss:.6f} vs CUDA {gpu_loss:.6f}, gradients equal: {ok}")
    return ok


def learner_throughput() -> None:
    tokenizer = build_char_tokenizer()
    model = build_small_qwen2(tokenizer).cuda().train()
    ids = torch.randint(3, len(tokenizer), (64, 256), device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        for _ in range(3):  # warm-up
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        torch.cuda.synchronize()
        start, reps = time.perf_counter(), 10
        for _ in range(reps):
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        torch.cuda.synchronize()
        rate = reps * ids.numel() / (time.perf_counter() - start)
        print(f"3. learner forward+backward, 4x256 model, 64 x 256 tokens, {dtype}: {rate:,.0f} tokens/s")


def main() -> int:
    print(torch.cuda.get_device_name(0), "torch", torch.__version__)
    ok = check_sessions() & check_step_credit_loss()
    learner_throughput()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
