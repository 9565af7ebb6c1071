"""Multi-turn rollout: session continuation against re-prefilling every turn, the same episodes, one run.

Setting (the multi-turn issue's): ``--episodes`` (64) concurrent episodes of the tool-use env (KeyLookup,
``rlfabric/KeyLookup-v0``) played through the production rollout path: ``run_episodes`` -> ``ActBatcher`` ->
``ServedLLMPolicy`` -> a ``Generator`` actor on the torch engine, token-in/token-out. The model is the builtin
4-layer, 256-wide Qwen2 (tool alphabet, random weights, ``--max-positions`` 2048), decoding greedily up to
``--turn-tokens`` tokens a turn, so both contenders sample exactly the same tokens (checked). A random model
writes no tool calls, and its first answer would end every episode; so the env here answers every turn as if the
agent had called ``lookup`` on the asked key (``AlwaysLooksUp``): each episode runs exactly ``--turns`` turns,
each turn's reply a real ``<tool_response>`` of the tool env.

Contenders, alternating round by round on two generator actors built the same way:

1. ``re-prefill every turn`` (``generator.session_cache_mb: 0``): each turn's prompt, the whole conversation so
   far, is prefilled from scratch, as any loop that re-tokenizes the chat pays (the anchor);
2. ``session continuation`` (the default): the engine keeps each episode's KV between its turns and prefills only
   the tokens the conversation gained (``rlfabric.engines.session_cache``).

For each turn count it reports episodes/s, sampled tokens/s and the prompt tokens each side prefilled (from the
generators' counters), and the ratio; the turn count at which the gap opens is read off the table. With one turn
there is nothing to continue: that row is the easy case, labelled as such.

3. ``TRL GRPOTrainer`` (``benchmarks/anchor_trl_multi_turn.py``, unless ``--no-trl``): the same episodes (tasks,
   turns, new tokens per turn, model shape) through TRL's own multi-turn tool loop, in this process while the
   generators idle, for turn counts up to ``--trl-max-turns`` (8; its 16-turn rollout would take a quarter of an
   hour a round here), one timed round after a warm-up. TRL's ``num_generations`` must be at least 2, so it plays
   every 4th task 4 times (sampling at its default temperature 1), the same number of episodes. Its ratio is
   rlfabric's session continuation against it, in episodes/s.

The tasks: ``--episodes`` distinct KeyLookup tasks, the same on both sides. Distinct, because greedy decoding
would make a group's episodes identical token for token, and the torch engine prefills a batch's shared prefixes
once: the re-prefilling side would then pay for one episode of each group. GRPO samples at temperature 1, so a
group's episodes part after the first prompt; distinct tasks keep that shape (only the system prompt and tool
description are shared).

Usage::

    python benchmarks/multi_turn_rollout.py [--episodes 64] [--turns 1 2 4 8 16] [--rounds 2] [--trl-max-turns 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from report import write_report  # benchmarks/ is the script's directory

from rlfabric.actors.generator import Generator
from rlfabric.agent_loop import EpisodeLimits, run_episodes
from rlfabric.envs.key_lookup import KeyLookup, tool_call
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import build_small_model_dir, load_tokenizer
from rlfabric.policies.batching import ActBatcher
from rlfabric.policies.served import ServedLLMPolicy
from rlfabric.tasks import key_lookup_rows
from rlfabric.text_env import TextStep

HERE = Path(__file__).resolve().parent
ANCHOR = "re-prefill every turn"
CONTENDER = "session continuation"
TRL = "TRL GRPOTrainer"


class AlwaysLooksUp(KeyLookup):
    """KeyLookup whose agent is held to calling the tool: every turn is answered as the call ``lookup(key)`` on
    the asked key (see the module docstring), so no episode ends before its last turn."""

    async def reset(self, task: dict[str, Any]) -> str:
        self.asked = str(task["key"])
        return await super().reset(task)

    async def step(self, action: str) -> TextStep:
        return await super().step(tool_call(self.asked))


def play(generator: Any, tasks: list[dict], chat: ChatTokens, limits: EpisodeLimits, turn_tokens: int) -> list:
    policy = ServedLLMPolicy([(0, 0, generator)], {"max_new_tokens": turn_tokens, "temperature": 0.0}, 600.0)
    return asyncio.run(run_episodes(AlwaysLooksUp, tasks, ActBatcher(policy), chat, limits))


def measure(generators: dict[str, Any], tasks, chat, turns: int, args) -> dict[str, Any]:
    limits = EpisodeLimits(max_turns=turns, turn_tokens=args.turn_tokens, max_episode_tokens=args.max_positions)
    times: dict[str, list[float]] = {name: [] for name in generators}
    prefilled: dict[str, int] = {}
    sequences: dict[str, list] = {}
    sampled = 0
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, generator in generators.items():
            before = ray.get(generator.stats.remote())["prefill_tokens"]
            start = time.perf_counter()
            episodes = play(generator, tasks, chat, limits, args.turn_tokens)
            elapsed = time.perf_counter() - start
            if round_ == 0:
                continue
            times[name].append(elapsed)
            prefilled[name] = ray.get(generator.stats.remote())["prefill_tokens"] - before
            sequences[name] = [[t.sampled + t.observation for t in e.turns] for e in episodes]
            sampled = sum(len(t.sampled) for e in episodes for t in e.turns)
            assert all(len(e.turns) == turns and e.error is None for e in episodes), "an episode ended early"
    assert sequences[ANCHOR] == sequences[CONTENDER], "the contenders played different episodes"
    row: dict[str, Any] = {"turns": turns, "episodes": len(tasks), "sampled_tokens": sampled}
    for name in generators:
        median = statistics.median(times[name])
        row[name] = {
            "seconds": median,
            "episodes_per_s": len(tasks) / median,
            "sampled_tokens_per_s": sampled / median,
            "prefilled_tokens": prefilled[name],
            "times": times[name],
        }
    row["speedup"] = row[ANCHOR]["seconds"] / row[CONTENDER]["seconds"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--max-positions", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-trl", action="store_true", help="leave out the TRL contender")
    parser.add_argument("--trl-max-turns", type=int, default=8, help="run TRL only up to this many turns")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "multi_turn_rollout.json")
    args = parser.parse_args()

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_small_model_dir(Path(tmp) / "model", alphabet="tool", max_positions=args.max_positions)
        chat = ChatTokens(load_tokenizer(model_dir))
        options = {"max_batch_size": 256}
        generators = {
            ANCHOR: Generator.remote("torch", str(model_dir), {**options, "session_cache_mb": 0}, args.threads),
            CONTENDER: Generator.remote("torch", str(model_dir), options, args.threads),
        }
        ray.get([g.version.remote() for g in generators.values()])
        tasks = [{k: row[k] for k in ("key", "table")} for row in key_lookup_rows(args.episodes, seed=0)]
        rows = []
        print(f"{'turns':>5} | {'contender':<24} | {'episodes/s':>10} | {'tokens/s':>9} | {'prefilled':>9} | ratio")
        for turns in args.turns:
            row = measure(generators, tasks, chat, turns, args)
            if not args.no_trl and turns <= args.trl_max_turns:
                from anchor_trl_multi_turn import run_trl_multi_turn  # benchmarks/ is the script's directory

                row[TRL] = run_trl_multi_turn(tasks, turns, args.turn_tokens, 1, args.threads)
                row["speedup_vs_trl"] = row[TRL]["seconds"] / row[CONTENDER]["seconds"]
            rows.append(row)
            label = " (easy case: nothing to continue)" if turns == 1 else ""
            for name in (ANCHOR, CONTENDER):
                r = row[name]
                ratio = r["sampled_tokens_per_s"] / row[ANCHOR]["sampled_tokens_per_s"]
                print(
                    f"{turns:>5} | {name:<24} | {r['episodes_per_s']:>10.2f} | {r['sampled_tokens_per_s']:>9.0f} | "
                    f"{r['prefilled_tokens']:>9} | {ratio:.2f}x{label if name == CONTENDER else ''}",
                    flush=True,
                )
            if TRL in row:
                r = row[TRL]
                print(
                    f"{turns:>5} | {TRL:<24} | {r['episodes_per_s']:>10.2f} | {r['sampled_tokens_per_s']:>9.0f} | "
                    f"{'-':>9} | session continuation {row['speedup_vs_trl']:.2f}x faster",
                    flush=True,
                )
    write_report(args.out, "multi_turn_rollout", args, threads=args.threads, rows=rows)


if __name__ == "__main__":
    main()
