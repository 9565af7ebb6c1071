"""Anchor: TRL's multi-turn tool rollout (``GRPOTrainer`` with ``environment_factory``), episodes per second.

The TRL side of ``benchmarks/multi_turn_rollout.py``. TRL 1.16 runs tool-using episodes inside
``GRPOTrainer._generate_and_score_completions``: it generates a turn for every episode with the model's own
``generate`` (no vLLM on CPU), parses tool calls from the decoded text with the chat template's response schema,
calls the environment's tool methods, appends the tool messages' tokens and generates again over the whole
conversation, up to ``max_tool_calling_iterations`` times. That loop is what is timed here, on the same
model shape as rlfabric's side (Qwen2, 4 layers, 256 wide, random weights, fp32, 2 threads), the same number of
episodes, turns and new tokens per turn (``generation_kwargs.max_new_tokens``; ``max_completion_length`` is the
whole episode's budget, set large enough that no tool result is dropped).

A random model writes no tool calls, and TRL ends an episode at the first turn without one. So, as on rlfabric's
side (where the env answers every turn as a lookup), every turn but the last is made a tool call: the turn is
generated and timed as usual, then its ids are replaced by the Hermes call ``lookup`` on the asked key
(``ScriptedToolCalls._generate_single_turn``), which TRL parses and runs. The tokenizer is character-level, like
rlfabric's, plus Qwen's ``<|im_start|>``/``<|im_end|>`` and TRL's own Qwen2.5 chat template, which TRL needs to
find tool calls.

Usage (normally called by multi_turn_rollout.py)::

    python benchmarks/anchor_trl_multi_turn.py --episodes 64 --turns 4
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import string  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

GROUP = 4  # generations per prompt (TRL's num_generations, at least 2): every GROUP-th task, played GROUP times


def qwen_char_tokenizer() -> Any:
    """A character-level tokenizer with Qwen's chat specials and TRL's Qwen2.5 template (tool-call parsing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen2_5_chat_template

    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    chars = list(dict.fromkeys(string.printable))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>", padding_side="left"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


class LookupEnv:
    """The environment TRL builds per episode: a hidden table and its ``lookup`` tool (as KeyLookup's)."""

    def reset(self, **row: Any) -> None:
        self.table = dict(row["table"])
        return None

    def lookup(self, key: str) -> str:
        """The value stored under a key of the table.

        Args:
            key: the key to look up.

        Returns:
            The value.
        """
        return str(self.table[key]) if key in self.table else f"error: no key {key}"


def run_trl_multi_turn(
    tasks: list[dict[str, Any]], turns: int, turn_tokens: int, rounds: int, threads: int
) -> dict[str, Any]:
    """Median seconds of TRL's rollout of ``len(tasks)`` episodes (``GROUP`` per task) of ``turns`` turns."""
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    tokenizer = qwen_char_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=4096,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=True,
        )
    )

    class ScriptedToolCalls(GRPOTrainer):
        """Every turn but the last becomes a lookup call after it is generated (see the module docstring)."""

        def _generate_single_turn(self, prompt_ids, images, multimodal, num_generations, **options):  # noqa: ANN001
            ids, logprobs = super()._generate_single_turn(prompt_ids, images, multimodal, num_generations, **options)
            self.generated_tokens += sum(len(i) for i in ids)
            turn, self.turn = self.turn, self.turn + 1
            if turn < turns - 1:
                call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "%s"}}\n</tool_call><|im_end|>'
                ids = [tokenizer.encode(call % self.keys[i % len(self.keys)]) for i in range(len(ids))]
            return ids, logprobs

    rows = [{"prompt": [{"role": "user", "content": f"Value of key {t['key']}?"}], **t} for t in tasks[::GROUP]]
    dataset = Dataset.from_list(rows)
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            use_vllm=False,
            bf16=False,
            per_device_train_batch_size=len(tasks),
            num_generations=GROUP,
            max_completion_length=4096,  # the episode's budget: never reached, so no tool result is dropped
            generation_kwargs={"max_new_tokens": turn_tokens},
            max_tool_calling_iterations=turns - 1,
            report_to="none",
            logging_steps=1,
        )
        trainer = ScriptedToolCalls(
            model=model,
            processing_class=tokenizer,
            args=args,
            train_dataset=dataset,
            environment_factory=LookupEnv,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        )
        batch = [rows[i // GROUP] for i in range(len(tasks))]
        trainer.keys = [row["key"] for row in batch]  # the asked key of each episode's own table
        trainer.model.eval()
        seconds, generated = [], 0
        for round_ in range(rounds + 1):  # round 0 warms up
            trainer.turn, trainer.generated_tokens = 0, 0
            start = time.perf_counter()
            out_batch = trainer._generate_and_score_completions(batch)
            elapsed = time.perf_counter() - start
            if trainer.turn != turns:
                raise RuntimeError(f"TRL played {trainer.turn} turns, expected {turns}")
            if round_:
                seconds.append(elapsed)
                generated = trainer.generated_tokens
        lengths = out_batch["completion_mask"].sum(1).float().mean().item()
    seconds.sort()
    median = seconds[len(seconds) // 2]
    return {
        "seconds": median,
        "episodes_per_s": len(tasks) / median,
        "sampled_tokens_per_s": generated / median,
        "completion_tokens_mean": lengths,
        "times": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from rlfabric.tasks import key_lookup_rows

    tasks = [{k: r[k] for k in ("key", "table")} for r in key_lookup_rows(args.episodes // GROUP, seed=0)]
    tasks = [t for t in tasks for _ in range(GROUP)]
    print(json.dumps(run_trl_multi_turn(tasks, args.turns, args.turn_tokens, args.rounds, args.threads), indent=2))


if __name__ == "__main__":
    main()
