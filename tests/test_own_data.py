"""A user's own prompt data, as a new user brings it: each mistake is one line naming the setting, the file and
the fix, before Ray starts and without leaving a run folder.

Covered: prompts and SFT demonstrations the builtin character tokenizer cannot spell (train and held-out rows),
an ``sft.answer_key`` column the file lacks or leaves null, a builtin reward's ``answer_key`` column the file
lacks (and the reward's own error when the rows come later), a file shorter than ``data.num_train`` /
``data.num_eval`` ask for, a null prompt, and a preference-pairs file with the wrong columns or too few rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from grpo_runs import setup_error

from rlfabric.cli import main
from rlfabric.config import ConfigError, load_config
from rlfabric.data import load_prompts
from rlfabric.llm_driver import GRPOTrainer
from rlfabric.reward_model_training import load_pair_rows
from rlfabric.rewards import RewardInput
from rlfabric.rewards.builtin import arithmetic_reward, math_reward
from rlfabric.run.paths import with_local_paths_resolved

TINY = {"builtin": {"num_layers": 1, "hidden_size": 32, "num_heads": 2}}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def doubles(n: int, question: str = "Double {i}?", **extra: Any) -> list[dict[str, Any]]:
    """``n`` rows in a user's own column names: question, solution (and ``extra`` columns, formatted by i)."""
    return [
        {"question": question.format(i=i), "solution": str(2 * i), **{k: v.format(i=i) for k, v in extra.items()}}
        for i in range(n)
    ]


def config(tmp_path: Path, train: str, **sections: dict[str, Any]) -> Path:
    """A config for ``train`` with the settings a user of such a file sets: its prompt column, row counts that fit,
    the reward reading its answer column; ``sections`` merged over them."""
    cfg: dict[str, Any] = {
        "algo": "grpo",
        "model": dict(TINY),
        "data": {"train": train, "prompt_key": "question", "num_train": 30, "num_eval": 10},
        "rewards": {"functions": [{"name": "arithmetic", "kwargs": {"answer_key": "solution"}}]},
        "sft": {"steps": 0},
        "training": {"total_steps": 1},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# -- (a) text the builtin character tokenizer cannot spell --------------------------------------------------


def test_a_prompt_with_a_character_the_alphabet_lacks_is_one_line_naming_row_characters_and_alphabets(tmp_path):
    train = write_jsonl(tmp_path / "double.jsonl", doubles(40, "What's double {i}?"))
    message = setup_error(tmp_path, config(tmp_path, train))
    assert message == (
        f"model.builtin.alphabet = 'default' has no \"'\", which the 'question' column of data.train = {train!r} "
        "(30 rows, the first row 0: \"What's double 0?\") uses: set it to 'tool', which has them (the named "
        "alphabets are default, tool; 'tool' adds {}[]\"'_\\ for JSON tool calls), or to a string of every "
        "character needed"
    )


def test_a_held_out_prompt_the_alphabet_cannot_spell_names_data_eval_and_its_row(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", doubles(30))
    rows = doubles(10, "Twice {i}?")
    rows[3]["question"] = "Twice 3 & 4?"
    heldout = write_jsonl(tmp_path / "eval.jsonl", rows)
    message = setup_error(tmp_path, config(tmp_path, train, data={"eval": heldout}))
    assert message == (
        f"model.builtin.alphabet = 'default' has no '&', which the 'question' column of data.eval = {heldout!r} "
        "(held-out row 3: 'Twice 3 & 4?') uses: no named alphabet (default, tool) has them: set it to a string of "
        "every character needed"
    )


def test_an_sft_answer_the_alphabet_cannot_spell_is_one_line_through_the_cli(tmp_path, capsys):
    train = write_jsonl(tmp_path / "double.jsonl", doubles(40, teacher="{i}!"))
    cfg = config(tmp_path, train, sft={"steps": 2, "batch_size": 4})
    run_dir = tmp_path / "runs" / "run"
    if ray.is_initialized():
        ray.shutdown()
    capsys.readouterr()
    code = main(["train", str(cfg), "--run-dir", str(run_dir), "--quiet"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    assert err.splitlines()[1:] == [
        "rlfabric: config error: model.builtin.alphabet = 'default' has no '!', which the 'teacher' column of "
        f"data.train = {train!r} (30 rows, the first row 0: '0!') uses: no named alphabet (default, tool) has them: "
        "set it to a string of every character needed"
    ], err
    assert not ray.is_initialized() and not (tmp_path / "runs").exists()


def test_text_the_tool_alphabet_spells_passes_the_checks_before_ray(tmp_path):
    train = write_jsonl(tmp_path / "double.jsonl", doubles(40, "What's double {i}?", teacher="'{i}'"))
    cfg = load_config(config(tmp_path, train, model={**TINY, "builtin": {**TINY["builtin"], "alphabet": "tool"}}))
    cfg.sft.steps = 2
    trainer = GRPOTrainer(cfg, tmp_path / "run", quiet=True)
    try:
        trainer._read_rows()
        trainer._setup_before_ray()  # what setup runs before Ray: the prompts encoded, the answers checked
        assert len(trainer.train_ids) == 30 and len(trainer.eval_ids) == 10
        assert not ray.is_initialized()
    finally:
        trainer.close()


# -- (b) sft.answer_key ------------------------------------------------------------------------------------


def test_an_sft_answer_key_column_the_file_lacks_lists_its_columns_before_ray(tmp_path):
    train = write_jsonl(tmp_path / "double.jsonl", doubles(40))
    message = setup_error(tmp_path, config(tmp_path, train, sft={"steps": 2, "batch_size": 4}))
    assert message == (
        f"sft.answer_key = 'teacher' is not valid for data.train = {train!r}: the file has no such column (its "
        "columns are 'question', 'solution'): set sft.answer_key to the one holding the target completion, or "
        "sft.steps: 0 for no supervised warm-up"
    )


def test_a_null_sft_answer_is_one_line_naming_the_row(tmp_path):
    rows = doubles(40, teacher="{i}")
    rows[5]["teacher"] = None
    train = write_jsonl(tmp_path / "double.jsonl", rows)
    message = setup_error(tmp_path, config(tmp_path, train, sft={"steps": 2, "batch_size": 4}))
    assert message == (
        f"sft.answer_key = 'teacher' is not valid for data.train = {train!r}: row 5's 'teacher' is null or missing, "
        "and every training row needs a demonstration there: fill it in, drop the row, or sft.steps: 0 for no "
        "supervised warm-up"
    )


# -- (c) a builtin reward's answer column ---------------------------------------------------------------------


def test_a_reward_answer_column_the_file_lacks_names_answer_key_before_ray(tmp_path):
    train = write_jsonl(tmp_path / "double.jsonl", doubles(40))
    message = setup_error(tmp_path, config(tmp_path, train, rewards={"functions": [{"name": "arithmetic"}]}))
    assert message == (
        f"rewards.functions[0] = 'arithmetic' is not valid for data.train = {train!r}: it reads metadata['answer'] "
        "(the column its kwargs answer_key names), which the rows lack; set its kwargs answer_key: solution"
    )


def test_a_reward_answer_column_with_several_candidates_lists_them_for_data_eval_and_shadows(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", doubles(30, answer="{i}"))
    heldout = write_jsonl(tmp_path / "eval.jsonl", doubles(10, "Twice {i}?", note="n{i}"))
    shadow = {"shadow": {"functions": [{"name": "math", "kwargs": {"answer_key": "answer"}}]}}
    functions = {"functions": [{"name": "arithmetic", "kwargs": {"answer_key": "solution"}}]}
    message = setup_error(tmp_path, config(tmp_path, train, data={"eval": heldout}, rewards={**functions, **shadow}))
    assert message == (
        f"rewards.shadow.functions[0] = 'math' is not valid for data.eval = {heldout!r}: it reads "
        "metadata['answer'] (the column its kwargs answer_key names), which the rows lack; set its kwargs "
        "answer_key to the one that holds it (solution, note)"
    )


@pytest.mark.parametrize(
    ("sections", "says"),
    [
        (
            {"rewards": {"functions": [{"name": "arithmetic"}]}},
            "rewards.functions[0] = 'arithmetic' is not valid for data.train = {train!r}: it reads metadata['answer'] "
            "(the column its kwargs answer_key names), which the rows lack; set its kwargs answer_key: solution",
        ),
        (
            {"data": {"eval": "{heldout}"}},
            "model.builtin.alphabet = 'default' has no '&', which the 'question' column of data.eval = {heldout!r} "
            "(held-out row 3: 'Twice 3 & 4?') uses: no named alphabet (default, tool) has them: set it to a string "
            "of every character needed",
        ),
    ],
    ids=["reward answer column", "held-out spelling"],
)
def test_rlfabric_eval_checks_the_files_columns_and_spelling_as_train_does(tmp_path, capsys, no_ray, sections, says):
    train = write_jsonl(tmp_path / "train.jsonl", doubles(40))
    rows = doubles(10, "Twice {i}?")
    rows[3]["question"] = "Twice 3 & 4?"
    heldout = write_jsonl(tmp_path / "eval.jsonl", rows)
    if "data" in sections:
        sections = {"data": {"eval": heldout}}
    cfg = config(tmp_path, train, **sections)
    capsys.readouterr()
    code = main(["eval", str(cfg), "--n", "1", "--out", str(tmp_path / "out"), "--quiet"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    assert err.splitlines() == ["rlfabric: config error: " + says.format(train=train, heldout=heldout)], err
    assert not ray.is_initialized() and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("reward", "metadata", "fix"),
    [
        (arithmetic_reward, {"solution": "2"}, "set its kwargs answer_key: solution"),
        (math_reward, {"solution": "2", "source": "x"}, "set its kwargs answer_key to the one that holds it"),
    ],
)
def test_the_rewards_own_error_says_answer_key(reward, metadata, fix):
    name = "arithmetic" if reward is arithmetic_reward else "math"
    with pytest.raises(KeyError) as info:
        reward([RewardInput("1+1=", "2", metadata, "stop", 1)])
    assert info.value.args[0] == (
        f"reward {name!r} needs metadata['answer'] (the column its kwargs answer_key names); this sample's "
        f"metadata has {sorted(metadata)}: {fix}" + (" (solution, source)" if len(metadata) > 1 else "")
    )


# -- (d) row counts and null prompts -------------------------------------------------------------------------


def test_a_file_shorter_than_data_num_train_says_how_many_to_ask_for(tmp_path):
    train = write_jsonl(tmp_path / "double.jsonl", doubles(400))
    message = setup_error(tmp_path, config(tmp_path, train, data={"num_train": 2000, "num_eval": 200}))
    assert message == (
        f"data.train = {train!r}: has 400 rows, fewer than the 2000 asked for (data.num_train): set data.num_train "
        "to at most 200, leaving the 200 rows data.num_eval asks for (data.eval is '': the held-out rows are those "
        "training leaves); with data.eval set to a file of held-out prompts, data.num_train at most 400"
    )
    with pytest.raises(ConfigError) as info:  # a held-out file of its own: only the training rows count
        load_prompts(train, num_rows=2000, prompt_key="question")
    assert str(info.value).endswith("(data.num_train): set data.num_train to at most 400, or null for every row")


def test_a_file_longer_than_training_and_held_out_rows_says_how_many_it_leaves_unused(tmp_path):
    train = write_jsonl(tmp_path / "double.jsonl", doubles(2700))
    said: list[str] = []
    rows = load_prompts(train, num_rows=2000, prompt_key="question", keep_out=200, note=said.append)
    assert len(rows) == 2000 and said == [
        f"data.train = {train!r}: 500 of its 2700 rows are not used: the run trains on the first 2000 "
        "(data.num_train) and holds out 200 of the rest (data.num_eval); data.num_train: 2500 uses every row"
    ]
    said.clear()  # a held-out file of its own: null takes every row
    load_prompts(train, num_rows=2000, prompt_key="question", note=said.append)
    assert said[0].endswith(
        "700 of its 2700 rows are not used: the run trains on the first 2000 (data.num_train); "
        "data.num_train: null uses every row"
    )
    said.clear()
    load_prompts(train, num_rows=2500, prompt_key="question", keep_out=200, note=said.append)
    assert said == []  # every row used


def test_every_row_for_training_leaves_no_held_out_prompts_and_says_the_fix(tmp_path):
    train = write_jsonl(tmp_path / "double.jsonl", doubles(400))
    message = setup_error(tmp_path, config(tmp_path, train, data={"num_train": None, "num_eval": 200}))
    assert message == (
        f"data.train = {train!r}: has 0 rows whose prompt is not a training prompt, fewer than the 200 asked for "
        "(data.num_eval): train on fewer rows (data.num_train: 400 now) to leave more out, or set data.eval to a "
        "file of held-out prompts"
    )
    message = setup_error(tmp_path, config(tmp_path, train, data={"num_train": 300, "num_eval": 200}))
    assert message.endswith(
        "has 100 rows whose prompt is not a training prompt, fewer than the 200 asked for (data.num_eval): lower "
        "data.num_eval to at most 100, train on fewer rows (data.num_train: 300 now) to leave more out, or set "
        "data.eval to a file of held-out prompts"
    )


def test_a_null_prompt_is_named_null_not_missing(tmp_path):
    rows = doubles(40)
    rows[2]["question"] = None
    train = write_jsonl(tmp_path / "double.jsonl", rows)
    message = setup_error(tmp_path, config(tmp_path, train))
    assert message == (
        f"data.train = {train!r}: row 2's 'question' is null or missing; every row needs a string prompt under "
        "data.prompt_key: question: fill it in or drop the row"
    )


# -- (e) preference pairs -----------------------------------------------------------------------------------


def test_a_pairs_file_with_other_columns_names_the_fixed_columns_not_data_prompt_key(tmp_path):
    pairs = write_jsonl(
        tmp_path / "pairs.jsonl", [{"question": f"{i}+1=", "good": "1", "rejected": "0"} for i in range(3)]
    )
    with pytest.raises(ConfigError) as info:
        load_pair_rows(pairs, num_pairs=2, num_eval=1, seed=0)
    assert str(info.value) == (
        f"reward_model.pairs = {pairs!r}: no 'prompt', 'chosen' columns; its columns are 'question', 'good', "
        "'rejected': every row needs the text columns prompt, chosen, rejected (these names are fixed: rename the "
        "file's columns)"
    )


def test_a_short_pairs_file_names_reward_model_num_pairs_and_num_eval(tmp_path):
    pairs = write_jsonl(
        tmp_path / "pairs.jsonl", [{"prompt": f"{i}+1=", "chosen": "a", "rejected": "b"} for i in range(50)]
    )
    with pytest.raises(ConfigError) as info:
        load_pair_rows(pairs, num_pairs=2000, num_eval=20, seed=0)
    assert str(info.value) == (
        f"reward_model.pairs = {pairs!r}: has 50 rows, fewer than the 2000 asked for (reward_model.num_pairs): set "
        "reward_model.num_pairs to at most 30, leaving the 20 rows reward_model.num_eval asks for (the held-out "
        "rows are those training leaves)"
    )
    with pytest.raises(ConfigError) as info:
        load_pair_rows(pairs, num_pairs=45, num_eval=20, seed=0)
    assert str(info.value) == (
        f"reward_model.pairs = {pairs!r}: has 5 rows whose prompt is not a training prompt, fewer than the 20 asked "
        "for (reward_model.num_eval): lower reward_model.num_eval to at most 5, or train on fewer rows "
        "(reward_model.num_pairs: 45 now) to leave more out"
    )
    train, heldout = load_pair_rows(pairs, num_pairs=30, num_eval=20, seed=0)
    assert len(train) == 30 and len(heldout) == 20


def test_a_glob_pattern_reads_every_matching_shard_in_name_order(tmp_path, monkeypatch):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "train-00001-of-00002.jsonl", doubles(3, question="B{i}?"))
    write_jsonl(shards / "train-00000-of-00002.jsonl", doubles(2, question="A{i}?"))
    (shards / "notes.txt").write_text("not a shard")
    rows = load_prompts(str(shards / "train-*.jsonl"), prompt_key="question")
    assert [r["question"] for r in rows] == ["A0?", "A1?", "B0?", "B1?", "B2?"]
    with pytest.raises(ConfigError) as info:
        load_prompts(str(shards / "val-*.jsonl"), prompt_key="question")
    assert str(info.value) == f"data.train = {str(shards / 'val-*.jsonl')!r}: the pattern matches no file"
    (shards / "train-00002-of-00002.jsonl").write_text("")
    with pytest.raises(ConfigError) as info:  # a bad shard is named
        load_prompts(str(shards / "train-*.jsonl"), prompt_key="question")
    empty = str(shards / "train-00002-of-00002.jsonl")
    assert str(info.value) == f"data.train = {str(shards / 'train-*.jsonl')!r} (file {empty!r}): the file holds no rows"
    # a relative pattern is recorded with its directory absolute, so --resume reads the same shards from anywhere
    monkeypatch.chdir(tmp_path)
    saved = with_local_paths_resolved({"data": {"train": "shards/train-*.jsonl", "eval": "shards/none-*.jsonl"}})
    assert saved == {"data": {"train": str(tmp_path / "shards" / "train-*.jsonl"), "eval": "shards/none-*.jsonl"}}
