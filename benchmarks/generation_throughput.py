"""Generation throughput: TorchEngine side by side with transformers' ``generate``, same model and batch, one run.

Setting (the torch engine issue's): the 4-layer, 256-wide Qwen2 model from ``build_small_qwen2`` with the character
tokenizer (random weights), ``--batch-prompts`` prompts of 10-20 tokens, each repeated ``--samples`` times,
``--max-new-tokens`` new tokens sampled at temperature 1 (no top-k/top-p). EOS is disabled on both sides, so
every sequence generates exactly ``--max-new-tokens`` tokens and both contenders do the same work (a random model
would otherwise stop rows at random points). ``--eos`` turns it on for both: each side then counts the tokens it
generated up to and including EOS, and transformers keeps computing finished rows until the last one ends while
the engine drops them from its batch.

Contenders, timed alternately (so machine noise hits both alike) after warm-up repetitions:

1. ``transformers``: ``model.generate(do_sample=True)`` on the left-padded batch (the anchor);
2. ``TorchEngine``: one ``generate`` call with every prompt;
3. ``TorchEngine, concurrent callers``: one ``generate`` call per prompt group (``--samples`` copies each), all
   at once, as a generator actor serving several env runners would see them.

It prints a table with tokens/s and the ratio to the anchor, and writes ``benchmarks/results/
generation_throughput.json``.

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
from rlfabric.engines.torch_engine import TorchEngine
from rlfabric.models.hf import build_char_tokenizer, build_small_qwen2

HERE = Path(__file__).resolve().parent
PROMPT_CHARS = "0123456789+-*/=() abcdefghijklmnopqrstuvwxyz?"


def make_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    texts = ["".join(rng.choice(PROMPT_CHARS) for _ in range(rng.randint(10, 20))) for _ in range(count)]
    return [tokenizer.encode(text) for text in texts]


def hf_generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, eos: bool) -> Callable[[], int]:
    """A callable that runs transformers' generate on the left-padded batch and returns the tokens generated."""
    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")  # pads on the left
    eos_id = tokenizer.eos_token_id

    def run() -> int:
        with torch.inference_mode():
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

    return run


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
    p.add_argument("--out", default=str(HERE / "results" / "generation_throughput.json"))
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    tokenizer = build_char_tokenizer()
    model = build_small_qwen2(tokenizer, num_layers=args.layers, hidden_size=args.hidden, seed=args.seed)
    prompts = make_prompts(tokenizer, args.batch_prompts, args.seed)
    batch = [prompt for prompt in prompts for _ in range(args.samples)]

    # [] as the EOS ids: no stop tokens, like eos_token_id=None on the transformers side.
    engine = TorchEngine(model, tokenizer if args.eos else [], max_batch_size=len(batch), seed=args.seed)
    assert engine.uses_fast_path, engine.fallback_reason
    loop = asyncio.new_event_loop()
    contenders = {
        "transformers generate": hf_generate(model, tokenizer, batch, args.max_new_tokens, args.eos),
        "TorchEngine": engine_generate(engine, loop, [batch], args.max_new_tokens),
        "TorchEngine, concurrent callers": engine_generate(
            engine, loop, [[prompt] * args.samples for prompt in prompts], args.max_new_tokens
        ),
    }
    load_before = os.getloadavg()  # other work on the machine skews both contenders; record how much there was
    results = time_alternately(contenders, args.warmup, args.reps)
    load_after = os.getloadavg()
    loop.run_until_complete(engine.shutdown())
    loop.close()

    anchor = results["transformers generate"]["tokens_per_s"]
    print(f"{len(batch)} sequences x {args.max_new_tokens} new tokens, {args.threads} torch threads")
    print(f"load average (1 min) before/after: {load_before[0]:.1f} / {load_after[0]:.1f}")
    print(f"{'contender':<34}{'median s':>10}{'tokens/s':>12}{'vs transformers':>18}")
    for name, r in results.items():
        print(f"{name:<34}{r['median_s']:>10.3f}{r['tokens_per_s']:>12,.0f}{r['tokens_per_s'] / anchor:>17.2f}x")

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
            **vars(args),
            "sequences": len(batch),
            "prompt_lengths": [len(prompt) for prompt in prompts],
            "model": f"Qwen2 {args.layers} layers x {args.hidden} wide, char tokenizer, random weights",
            "sampling": f"temperature 1, no top-k/top-p, EOS {'enabled' if args.eos else 'disabled'}",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "results": results,
        "ratio_vs_transformers": {name: r["tokens_per_s"] / anchor for name, r in results.items()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
