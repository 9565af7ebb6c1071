"""Prompts as a Hugging Face TRL user brings them, and the checks of the model's tokenizer on them.

Covered: conversational prompts (a list of chat messages, TRL's "conversational" format) in JSONL and parquet,
rendered with the chat template and its generation prompt with or without ``data.chat_template``, their rows
checked one line each, deduplicated between train and eval, trained on end to end and shown rendered to the
rewards and in samples.jsonl; a tokenizer without a chat template (a byte-level BPE one: not blamed on ' '); a
model folder without tokenizer files and a tokenizer larger than the model's vocabulary, found before Ray; an
explicit ``data.eval`` file that loses rows says so, and ``data.num_eval: null`` takes every held-out row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from grpo_runs import run_grpo, setup_error

from rlfabric.cli import main
from rlfabric.config import ConfigError, config_from_dict, load_config
from rlfabric.data import load_heldout, load_prompts
from rlfabric.llm_driver import GRPOTrainer
from rlfabric.models.chat_tokens import UnspellableText, spelled, unspellable
from rlfabric.models.hf import (
    build_char_tokenizer,
    build_small_model_dir,
    build_small_qwen2,
    encode_prompt,
    load_tokenizer,
    save_pretrained,
)

TINY = {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "max_positions": 64}
SYSTEM = "answer with a number"


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def sums(n: int, start: int = 0) -> list[dict[str, Any]]:
    """``n`` conversational rows "a+b=" (a system and a user message) with their answers."""
    pairs = [(a, b) for a in range(10) for b in range(10)][start : start + n]
    return [{"prompt": chat(f"{a}+{b}="), "answer": str(a + b)} for a, b in pairs]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def config(tmp_path: Path, train: str, model: str = "builtin", **data: Any) -> Path:
    cfg: dict[str, Any] = {
        "algo": "grpo",
        "model": {"path": model, "builtin": TINY},
        "data": {"train": train, "num_train": 20, "num_eval": 4, **data},
        "sft": {"steps": 0},
        "training": {"total_steps": 1},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def byte_level_bpe() -> Any:
    """A small byte-level BPE tokenizer (a space is stored as 'Ġ', as in GPT-2 and Qwen) with no chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["What is 1 + 2 ? It is 3 ."] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


# -- (1) conversational prompts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("write", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
def test_a_conversational_prompt_file_reads_and_encodes_through_the_chat_template(tmp_path, write):
    train = write(tmp_path / f"train.{'jsonl' if write is write_jsonl else 'parquet'}", sums(3))
    rows = load_prompts(train)
    assert rows[0]["prompt"] == chat("0+0=")
    tokenizer = build_char_tokenizer()
    expected = tokenizer.apply_chat_template(chat("0+0="), add_generation_prompt=True, tokenize=False)
    assert expected == f"system: {SYSTEM}<eos>\nuser: 0+0=<eos>\nassistant: "
    for chat_template in (False, True):  # a conversational prompt always goes through the template
        assert tokenizer.decode(encode_prompt(tokenizer, rows[0]["prompt"], chat_template)) == expected


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        (["hello"], "is a list whose message 0 is a str, not an object"),
        ([{"role": "user"}], "is a list of chat messages whose message 0 has no 'content'"),
        ([{"role": "user", "content": "hi"}, {"role": 1, "content": "x"}], "whose message 1 has a int 'role'"),
        ([], "is an empty list of chat messages"),
        (3, "is a int, not a string or a list of chat messages"),
    ],
    ids=["strings", "no content", "int role", "empty", "int"],
)
def test_a_malformed_conversational_prompt_is_one_line_naming_file_row_and_problem(tmp_path, prompt, says):
    rows = sums(3)
    rows[2]["prompt"] = prompt
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ConfigError) as info:
        load_prompts(str(path))
    message = str(info.value)
    assert message.startswith(f"data.train = {str(path)!r}: row 2: 'prompt' ")
    assert says in message and "\n" not in message
    assert message.endswith('each an object with string "role" and "content" (e.g. {"role": "user", "content": "..."})')


def test_held_out_conversational_prompts_that_are_training_prompts_are_left_out(tmp_path):
    train = load_prompts(write_jsonl(tmp_path / "train.jsonl", sums(10)))
    heldout = write_jsonl(tmp_path / "eval.jsonl", sums(5, start=8) + sums(1, start=12))  # 2 in train, 1 repeated
    notes: list[str] = []
    rows = load_heldout(heldout, train_rows=train, num_rows=None, note=notes.append)
    assert [r["answer"] for r in rows] == ["1", "2", "3"]  # 1+0, 1+1, 1+2
    assert notes == [
        f"data.eval = {heldout!r}: 3 of its 6 rows are left out of the held-out set: 2 whose prompt is also a "
        "training prompt, 1 repeating an earlier row's prompt"
    ]


def test_grpo_trains_on_conversational_prompts_and_shows_them_rendered(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", sums(40))
    heldout = write_jsonl(tmp_path / "eval.jsonl", sums(4, start=40))
    run = run_grpo(
        tmp_path / "run",
        data={"train": train, "eval": heldout, "num_train": None, "num_eval": None},
        model={"path": "builtin", "builtin": {**TINY, "max_positions": 128}},
        training={"total_steps": 2, "eval_every": 2},
    )
    assert run.summary["steps"] == 2
    assert len(run.phase("eval")) >= 1
    # the held-out rows' completions, their prompts as the model saw them (the rewards' prompt too)
    samples = [json.loads(line) for line in (run.run_dir / "samples.jsonl").read_text().splitlines()]
    rendered = {f"system: {SYSTEM}<eos>\nuser: 4+{b}=<eos>\nassistant: ": str(4 + b) for b in range(4)}
    assert samples and all(rendered[s["prompt"]] == s["metadata"]["answer"] for s in samples), samples


def test_conversational_prompts_on_a_tokenizer_without_a_chat_template_are_one_line_before_ray(tmp_path):
    tokenizer = byte_level_bpe()
    folder = save_pretrained(build_small_qwen2(tokenizer, **TINY), tokenizer, tmp_path / "model")
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 2 ?"}], "answer": str(i + 2)} for i in range(30)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    message = setup_error(tmp_path, config(tmp_path, train, model=str(folder)))
    assert message == (
        f"model.path = {str(folder)!r}: its tokenizer has no chat template, and the prompts of data.train = "
        f"{train!r} are chat messages (row 0's 'prompt' is a list), shown through one: use a model whose tokenizer "
        "has one (an instruct or chat model), add one to the tokenizer (tokenizer.chat_template, saved with the "
        "model), or give string prompts"
    )


# -- (2) no chat template is not a missing ' ' --------------------------------------------------------------------


def test_a_byte_level_bpe_tokenizer_spells_a_space_and_its_own_errors_pass_through():
    tokenizer = byte_level_bpe()
    assert " " not in tokenizer.get_vocab()  # stored as 'Ġ'
    assert unspellable(tokenizer, "What is 1 + 2 ?") == ""
    with pytest.raises(ValueError) as info:  # no chat template: the tokenizer's own error, not UnspellableText
        spelled(tokenizer, "What is 1 + 2 ?", lambda: encode_prompt(tokenizer, "What is 1 + 2 ?", True))
    assert not isinstance(info.value, UnspellableText)
    char = build_char_tokenizer("abc ")
    assert unspellable(char, "a b!d") == "!d"  # a character tokenizer without an unknown token: truly unspellable


def test_data_chat_template_on_a_tokenizer_without_one_says_so_not_a_missing_space(tmp_path):
    tokenizer = byte_level_bpe()
    folder = save_pretrained(build_small_qwen2(tokenizer, **TINY), tokenizer, tmp_path / "model")
    train = write_jsonl(
        tmp_path / "train.jsonl", [{"prompt": f"What is 1 + 2 ? {i}", "answer": "3"} for i in range(30)]
    )
    message = setup_error(tmp_path, config(tmp_path, train, model=str(folder), chat_template=True))
    assert message == (
        f"model.path = {str(folder)!r}: its tokenizer has no chat template, and data.chat_template is true: use a "
        "model whose tokenizer has one (an instruct or chat model), add one to the tokenizer "
        "(tokenizer.chat_template, saved with the model), or set data.chat_template: false to prompt with the text "
        "alone"
    )


# -- (3) the tokenizer checked against the model before Ray ------------------------------------------------------


def test_a_model_folder_without_tokenizer_files_is_named_before_ray(tmp_path):
    folder = build_small_model_dir(tmp_path / "model", **TINY)
    for path in folder.iterdir():
        if path.name.startswith(("tokenizer", "chat_template")):
            path.unlink()
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(30)])
    message = setup_error(tmp_path, config(tmp_path, train, model=str(folder)))
    assert message == (
        f"model.path = {str(folder)!r}: the prompt of data.train = {train!r} (row 0) encodes to no tokens; the folder "
        "has no tokenizer files (tokenizer.json, tokenizer_config.json, tokenizer.model, ...): the tokenizer is "
        "probably missing from it; save the model's tokenizer there (tokenizer.save_pretrained(folder))"
    )


def small_vocab_model(tmp_path: Path) -> Path:
    """A model whose embedding has the 15 tokens of a digits-and-signs tokenizer, saved with the default (larger)
    character tokenizer."""
    model = build_small_qwen2(build_char_tokenizer("0123456789+-*/="), **TINY)
    return save_pretrained(model, build_char_tokenizer(), tmp_path / "model")


def test_a_tokenizer_larger_than_the_models_vocabulary_is_named_before_ray(tmp_path):
    folder = small_vocab_model(tmp_path)
    train = write_jsonl(
        tmp_path / "train.jsonl", [{"prompt": f"what is {i}+1?", "answer": str(i + 1)} for i in range(30)]
    )
    message = setup_error(tmp_path, config(tmp_path, train, model=str(folder)))
    tokenizer = load_tokenizer(folder)
    top = max(encode_prompt(tokenizer, "what is 0+1?", False))
    assert message == (
        f"model.path = {str(folder)!r}: its tokenizer ({len(tokenizer)} tokens) does not fit the model, whose "
        f"vocab_size is 18 (config.json): the prompt of data.train = {train!r} (row 0) has token id {top}; use the "
        "tokenizer the model was trained with"
    )


def test_rlfabric_eval_checks_the_tokenizer_against_the_model_too(tmp_path, capsys, no_ray):
    folder = small_vocab_model(tmp_path)
    train = write_jsonl(
        tmp_path / "train.jsonl", [{"prompt": f"what is {i}+1?", "answer": str(i + 1)} for i in range(30)]
    )
    cfg = config(tmp_path, train, model=str(folder))
    capsys.readouterr()
    code = main(["eval", str(cfg), "--n", "1", "--out", str(tmp_path / "out"), "--quiet"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    assert len(err.splitlines()) == 1 and "does not fit the model, whose vocab_size is 18" in err, err
    assert "(held-out row 0)" in err and not ray.is_initialized()


# -- (4) an explicit data.eval file -------------------------------------------------------------------------------


def test_an_explicit_eval_file_too_short_after_filtering_gives_advice_for_a_file(tmp_path):
    train = load_prompts(write_jsonl(tmp_path / "train.jsonl", sums(10)))
    heldout = write_jsonl(tmp_path / "eval.jsonl", sums(5, start=8))
    with pytest.raises(ConfigError) as info:
        load_heldout(heldout, train_rows=train, num_rows=5)
    assert str(info.value) == (
        f"data.eval = {heldout!r}: has 3 rows whose prompt is not a training prompt, fewer than the 5 asked for "
        "(data.num_eval): lower data.num_eval to at most 3 (or null for every row), or add rows to data.eval whose "
        "prompts are not training prompts (2 of its 5 rows are left out of the held-out set: 2 whose prompt is also "
        "a training prompt)"
    )


def test_data_num_eval_null_takes_every_held_out_row_of_a_file(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", sums(20))
    heldout = write_jsonl(tmp_path / "eval.jsonl", sums(7, start=18))
    cfg = load_config(config(tmp_path, train, eval=heldout, num_eval=None))
    trainer = GRPOTrainer(cfg, tmp_path / "run", quiet=True)
    try:
        trainer._read_rows()
    finally:
        trainer.close()
    assert len(trainer.eval_rows) == 5
    assert trainer.data_notes == [
        f"data.eval = {heldout!r}: 2 of its 7 rows are left out of the held-out set: 2 whose prompt is also a "
        "training prompt"
    ]
    with pytest.raises(ConfigError) as info:  # a generated task has no "every row"
        config_from_dict({"algo": "grpo", "data": {"train": "task:arithmetic", "num_eval": None}})
    assert str(info.value) == (
        "data.num_eval = None is not valid: null (every held-out row) takes held-out rows from a file, and "
        "data.train = 'task:arithmetic' is a generated task: give a number of rows"
    )
