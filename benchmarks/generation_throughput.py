"""Generation throughput: TorchEngine side by side with transformers' ``generate``, same model and batch, one run.

Setting (the torch engine issue's): the 4-layer, 256-wide Qwen2 model from ``build_small_qwen2`` with the character
tokenizer (random weights), ``--batch-prompts`` prompts of 10-20 tokens, each repeated ``--samples`` times,
``--max-new-tokens`` new tokens sampled at temperature 1 (no top-k/top-p). EOS is disabled on both sides, so
every sequence generates exactly ``--max-new-tokens`` tokens and both contenders do the same work (a random model
would otherwise stop rows at random points). ``--eos`` turns it on for both: each side then counts the tokens it
generated up to and including EOS, and transformers keeps computing finished rows until the last one ends while
the engine drops them from its batch.

Contenders, timed alternately (so machine noise hits both alike) after warm-up repetitions:

1. ``transformers generate``: ``model.generate(do_sample=True)`` on the left-padded batch (the anchor);
2. ``TorchEngine``: one ``generate`` call with every prompt;
3. ``TorchEngine, concurrent callers``: one ``generate`` call per prompt group (``--samples`` copies each), all
   at once, as a generator actor serving several env runners would see them;
4. ``TorchEngine, torch attention``: the engine with ``native_kernels=False``, its decode attention in torch ops
   instead of the native kernel (``rlfabric.engines.native``), to show what the kernel gives;
5. ``transformers generate, bf16 autocast`` and ``TorchEngine, bf16 matmuls`` (``matmul_dtype="bfloat16"``):
   the same two with their matrix multiplications in bfloat16 and float32 weights.

All torch work (building the model, every contender) runs on the engine's compute thread: OpenMP keeps one thread
team per calling thread, and a second team would make libgomp stop spin-waiting for both, slowing every contender.

It prints a table with tokens/s and the ratio to the anchor, and writes ``benchmarks/results/
generation_throughput.json`` (``generation_throughput_eos.json`` with ``--eos``).

Usage::

    python benchmarks/generation_throughput.py [--batch-prompts 8] [--samples 8] [--max-new-tokens 32] [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch
import transformers

from rlfabric.engines.base import SamplingParams
from rlfabric.engines.torch_engine import TorchEngine, on_compute_thread
from rlfabric.models.hf import build_char_tokenizer, build_small_qwen2

HERE = Path(__file__).resolve().parent
ANCHOR = "transformers generate"
ANCHOR_BF16 = "transformers generate, bf16 autocast"
PROMPT_CHARS = "0123456789+-*/=() abcdefghijklmnopqrstuvwxyz?"


def make_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    texts = ["".join(rng.choice(PROMPT_CHARS) for _ in range(rng.randint(10, 20))) for _ in range(count)]
    return [tokenizer.encode(text) for text in texts]


def hf_generate(
    model, tokenizer, prompts: list[list[int]], max_new_tokens: int, eos: bool, bf16: bool = False
) -> Callable[[], int]:
    """A callable that runs transformers' generate on the left-padded batch and returns the tokens generated."""
    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")  # pads on the left
    eos_id = tokenizer.eos_token_id

    def generate() -> int:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model.generate(
                **batch,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_id if eos else None,  # None: every row makes max_new_tokens tokens
                pad_token_id=tokenizer.pad_token_id,
            )
        generated = out[:, batch["input_ids"].shape[1] :]
        if not eos:
            assert generated.shape[1] == max_new_tokens, generated.shape
            return generated.numel()
        # Up to and including each row's first EOS (rows pad with pad_token_id after it).
        ended = (generated == eos_id).int().cumsum(1)
        return int(((ended == 0) | ((ended == 1) & (generated == eos_id))).sum())

    return lambda: on_compute_thread(generate)


def engine_generate(
    engine: TorchEngine, loop: asyncio.AbstractEventLoop, groups: list[list[list[int]]], max_new_tokens: int
) -> Callable[[], int]:
    """A callable that runs one engine.generate per group, all concurrently, and returns the tokens generated."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)

    async def all_groups() -> int:
        results = await asyncio.gather(*(engine.generate(group, params) for group in groups))
        return sum(len(c.token_ids) for completions in results for c in completions)

    return lambda: loop.run_until_complete(all_groups())


def time_alternately(contenders: dict[str, Callable[[], int]], warmup: int, reps: int) -> dict[str, dict]:
    """Median tokens/s (and seconds) per contender; each repetition runs every contender once, in turn."""
    for _ in range(warmup):
        for run in contenders.values():
            run()
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    tokens: dict[str, list[int]] = {name: [] for name in contenders}
    for _ in range(reps):
        for name, run in contenders.items():
            start = time.perf_counter()
            tokens[name].append(run())
            seconds[name].append(time.perf_counter() - start)
    return {
        name: {
            "median_s": statistics.median(seconds[name]),
            "tokens_per_s": statistics.median(t / s for t, s in zip(tokens[name], seconds[name], strict=True)),
            "seconds": seconds[name],
            "tokens": tokens[name],
        }
        for name in contenders
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-prompts", type=int, default=8, help="distinct prompts")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch.set_num_threads for both")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos", action="store_true", help="stop sequences at EOS on both sides (see above)")
    p.add_argument("--out", help="result file (default: results/generation_throughput[_eos].json)")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    tokenizer = build_char_tokenizer()
    model = on_compute_thread(
        build_small_qwen2, tokenizer, num_layers=args.layers, hidden_size=args.hidden, seed=args.seed
    )
    prompts = make_prompts(tokenizer, args.batch_prompts, args.seed)
    batch = [prompt for prompt in prompts for _ in range(args.samples)]
    groups = [[prompt] * args.samples for prompt in prompts]

    # [] as the EOS ids: no stop tokens, like eos_token_id=None on the transformers side.
    stop = tokenizer if args.eos else []
    engine = TorchEngine(model, stop, max_batch_size=len(batch), seed=args.seed)
    engine_torch_ops = TorchEngine(model, stop, max_batch_size=len(batch), seed=args.seed, native_kernels=False)
    engine_bf16 = TorchEngine(model, stop, max_batch_size=len(batch), seed=args.seed, matmul_dtype="bfloat16")
    assert engine.uses_fast_path, engine.fallback_reason
    print(f"TorchEngine decodes with {engine.attention}")
    loop = asyncio.new_event_loop()
    contenders = {
        ANCHOR: hf_generate(model, tokenizer, batch, args.max_new_tokens, args.eos),
        "TorchEngine": engine_generate(engine, loop, [batch], args.max_new_tokens),
        "TorchEngine, concurrent callers": engine_generate(engine, loop, groups, args.max_new_tokens),
        "TorchEngine, torch attention": engine_generate(engine_torch_ops, loop, [batch], args.max_new_tokens),
        ANCHOR_BF16: hf_generate(model, tokenizer, batch, args.max_new_tokens, args.eos, bf16=True),
        "TorchEngine, bf16 matmuls": engine_generate(engine_bf16, loop, [batch], args.max_new_tokens),
    }
    load_before = os.getloadavg()  # other work on the machine skews both contenders; record how much there was
    results = time_alternately(contenders, args.warmup, args.reps)
    load_after = os.getloadavg()
    for e in (engine, engine_torch_ops, engine_bf16):
        loop.run_until_complete(e.shutdown())
    loop.close()

    anchor = results[ANCHOR]["tokens_per_s"]
    same_precision = {name: results[ANCHOR_BF16 if "bf16" in name else ANCHOR]["tokens_per_s"] for name in results}
    print(f"{len(batch)} sequences x {args.max_new_tokens} new tokens, {args.threads} torch threads")
    print(f"load average (1 min) before/after: {load_before[0]:.1f} / {load_after[0]:.1f}")
    print(f"{'contender':<40}{'median s':>10}{'tokens/s':>12}{'vs transformers':>17}{'same precision':>16}")
    for name, r in results.items():
        tps = r["tokens_per_s"]
        ratios = f"{tps / anchor:>16.2f}x{tps / same_precision[name]:>15.2f}x"
        print(f"{name:<40}{r['median_s']:>10.3f}{tps:>12,.0f}{ratios}")

    report = {
        "date": date.today().isoformat(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
        "settings": {
            **{k: v for k, v in vars(args).items() if k != "out"},  # no machine paths in results
            "sequences": len(batch),
            "prompt_lengths": [len(prompt) for prompt in prompts],
            "model": f"Qwen2 {args.layers} layers x {args.hidden} wide, char tokenizer, random weights",
            "sampling": f"temperature 1, no top-k/top-p, EOS {'enabled' if args.eos else 'disabled'}",
            "attention": engine.attention,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "results": results,
        "ratio_vs_transformers": {name: r["tokens_per_s"] / anchor for name, r in results.items()},
        "ratio_vs_transformers_same_precision": {
            name: r["tokens_per_s"] / same_precision[name] for name, r in results.items()
        },
    }
    out = Path(args.out or HERE / "results" / f"generation_throughput{'_eos' if args.eos else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
