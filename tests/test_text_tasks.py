"""Generated text tasks and prompt datasets: determinism, correct answers, held-out splits, file loading."""

from __future__ import annotations

import json

import datasets
import pytest

from rlfabric.config import ConfigError
from rlfabric.data import load_heldout, load_prompts, parse_task_spec, row_metadata
from rlfabric.models.hf import DEFAULT_ALPHABET
from rlfabric.rewards.builtin import evaluate_expression, expression_numbers, parse_expression
from rlfabric.tasks import TASKS, TEACHER_SAMPLES, arithmetic_rows, countdown_rows


def test_envs_see_the_same_task_table_the_data_specs_read():
    from rlfabric.envs import text_tasks

    assert text_tasks.TASKS is TASKS and text_tasks.arithmetic_rows is arithmetic_rows
    assert load_prompts("task:countdown", num_rows=3, seed=1) == countdown_rows(3, 1)


def test_generators_are_deterministic_in_the_seed():
    # Entries named by path ("mcp") start servers; tests/test_mcp_tasks.py checks theirs.
    for generate in (g for g in TASKS.values() if callable(g)):
        assert generate(50, seed=3) == generate(50, seed=3)
        assert generate(50, seed=3) != generate(50, seed=4)
        assert generate(10, seed=3) == generate(50, seed=3)[:10]  # a longer run extends a shorter one


def test_arithmetic_answers_are_right_and_prompts_use_the_tokenizer_alphabet():
    rows = arithmetic_rows(500, seed=0, min_operand=0, max_operand=30, ops="+-*/")
    seen_ops = set()
    for row in rows:
        assert set(row["prompt"] + row["answer"]) <= set(DEFAULT_ALPHABET)
        left, op, right = _split_binary(row["prompt"].removesuffix("="))
        seen_ops.add(op)
        expected = {"+": left + right, "-": left - right, "*": left * right}.get(op)
        if op == "/":
            assert left % right == 0 and right >= 1
            expected = left // right
        assert row["answer"] == str(expected)
        if op != "/":
            assert 0 <= left <= 30 and 0 <= right <= 30
    assert seen_ops == set("+-*/")
    assert any(r["answer"].startswith("-") for r in rows)  # subtraction gives negative answers


def _split_binary(expr: str) -> tuple[int, str, int]:
    for i, ch in enumerate(expr):
        if ch in "+-*/" and i > 0:
            return int(expr[:i]), ch, int(expr[i + 1 :])
    raise AssertionError(f"no operator in {expr!r}")


def test_countdown_targets_are_reachable_and_the_prompt_format_is_compact():
    rows = countdown_rows(300, seed=1, num_numbers=4, max_number=12)
    for row in rows:
        numbers, target = row["numbers"], row["target"]
        assert row["prompt"] == " ".join(map(str, numbers)) + f" -> {target}:"
        assert set(row["prompt"]) <= set(DEFAULT_ALPHABET)
        assert len(numbers) == 4 and all(1 <= x <= 12 for x in numbers) and target >= 1
        tree = parse_expression(row["answer"])  # the reference answer is a valid solution
        assert tree is not None
        assert sorted(expression_numbers(tree)) == sorted(numbers)
        assert evaluate_expression(tree) == target
    assert set("".join(row["answer"] for row in rows)) >= set("+-*")  # every operator occurs


def test_bad_generator_options_raise_clear_errors():
    with pytest.raises(ValueError, match="ops = 'x'"):
        arithmetic_rows(3, 0, ops="x")
    with pytest.raises(ValueError, match="min_operand = 9, max_operand = 3"):
        arithmetic_rows(3, 0, min_operand=9, max_operand=3)
    with pytest.raises(ValueError, match="num_numbers = 1"):
        countdown_rows(3, 0, num_numbers=1)


def test_task_specs_with_options():
    assert parse_task_spec("task:arithmetic?max_operand=20&ops=+-*") == (
        "arithmetic",
        {"max_operand": 20, "ops": "+-*"},
    )
    rows = load_prompts("task:arithmetic?max_operand=5&ops=*", num_rows=40, seed=0)
    assert rows == arithmetic_rows(40, 0, max_operand=5, ops="*")
    assert row_metadata(rows[0]) == {"answer": rows[0]["answer"]}
    with pytest.raises(ConfigError, match=r"data.train = 'task:arithmetic\?size=3': 'size' is not an option"):
        load_prompts("task:arithmetic?size=3", num_rows=4, seed=0)
    with pytest.raises(ConfigError, match="no task 'sudoku'; tasks are arithmetic, arithmetic_pairs, countdown"):
        load_prompts("task:sudoku", num_rows=4, seed=0)
    with pytest.raises(ConfigError, match="data.train = 'task:arithmetic\\?ops=%': ops = '%'"):
        load_prompts("task:arithmetic?ops=%", num_rows=4, seed=0)
    with pytest.raises(ConfigError, match="needs a number of rows"):
        load_prompts("task:countdown", seed=0)


def test_heldout_arithmetic_is_disjoint_from_train():
    spec = "task:arithmetic?max_operand=20"  # 2 * 21 * 21 = 882 distinct prompts in all
    train = load_prompts(spec, num_rows=600, seed=0)
    heldout = load_heldout(spec, train_rows=train, num_rows=150, seed=0)
    train_prompts = {r["prompt"] for r in train}
    assert len(heldout) == 150
    assert not train_prompts & {r["prompt"] for r in heldout}
    assert len({r["prompt"] for r in heldout}) == 150  # no repeats within the held-out rows either
    assert heldout == load_heldout(spec, train_rows=train, num_rows=150, seed=0)  # deterministic
    with pytest.raises(ConfigError, match="data.eval = .*found only .* prompts that are not among the"):
        load_heldout("task:arithmetic?max_operand=2&ops=+", train_rows=train, num_rows=20, seed=0)


def test_load_jsonl_and_parquet_keep_other_columns_as_metadata(tmp_path):
    rows = [{"question": f"{i}+1=", "answer": str(i + 1), "level": i % 3} for i in range(6)]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    loaded = load_prompts(str(jsonl), prompt_key="question", seed=0)
    assert loaded == rows
    assert row_metadata(loaded[2], "question") == {"answer": "3", "level": 2}
    assert load_prompts(str(jsonl), num_rows=2, prompt_key="question") == rows[:2]

    parquet = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    assert load_prompts(str(parquet), prompt_key="question", seed=0) == rows

    as_json = tmp_path / "train.json"
    as_json.write_text(json.dumps(rows))
    assert load_prompts(str(as_json), prompt_key="question") == rows

    heldout = load_heldout(str(jsonl), train_rows=rows[:4], prompt_key="question")
    assert heldout == rows[4:]


def test_file_errors_name_the_field_row_and_key(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n')
    with pytest.raises(ConfigError, match=r"data.train = '.*bad.jsonl': row 1's 'prompt' is null or missing"):
        load_prompts(str(path))
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 7, "answer": "4"}\n')
    with pytest.raises(ConfigError, match=r"row 1: 'prompt' is a int, not a string"):
        load_prompts(str(path))
    with pytest.raises(ConfigError, match=r"^data.eval = '.*missing.jsonl': file does not exist$"):
        load_prompts(str(tmp_path / "missing.jsonl"), field="data.eval")
    with pytest.raises(ConfigError, match=r"not 'task:<name>' and not a .jsonl, .json, .parquet file"):
        load_prompts(str(tmp_path / "rows.csv"))
    with pytest.raises(ConfigError, match="has 2 rows, fewer than the 5 asked for"):
        load_prompts(str(path), num_rows=5, prompt_key="answer")


def test_unreliable_teacher_column():
    clean = arithmetic_rows(400, seed=3, max_operand=49, ops="+")
    noisy = arithmetic_rows(400, seed=3, max_operand=49, ops="+", teacher_error=0.6)
    assert [r["prompt"] for r in clean] == [r["prompt"] for r in noisy]  # the error rate does not move prompts
    assert noisy == arithmetic_rows(400, seed=3, max_operand=49, ops="+", teacher_error=0.6)
    demos = [(int(d) - int(r["answer"])) for r in noisy for d in r["teacher"]]
    assert set(demos) == {0, 1} and len(demos) == 400 * TEACHER_SAMPLES
    assert 0.55 < sum(demos) / len(demos) < 0.65
    assert "teacher" not in clean[0]
    with pytest.raises(ValueError, match="teacher_error"):
        arithmetic_rows(3, seed=0, teacher_error=1.5)
