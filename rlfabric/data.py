"""Prompt datasets: generated tasks and user files, as lists of row dicts.

A data spec (``data.train``, ``data.eval``) is one of:

* ``task:<name>`` or ``task:<name>?key=value&key=value``: a task from ``rlfabric.envs.text_tasks.TASKS`` that
  generates its rows from the seed; the options are passed to its generator, values read as int, float,
  ``true``/``false``, or else kept as strings. Example: ``task:arithmetic?max_operand=20&ops=+-*``.
* a path to a ``.jsonl``, ``.json`` (a list of objects) or ``.parquet`` file, read with ``datasets.load_dataset``
  (local files only). File rows keep their order; ``num_rows`` takes the first rows and the seed is not used.

Every row must hold a prompt under the prompt key: a string, or (TRL's "conversational" format) a list of chat
messages, each an object with string ``role`` and ``content``, which the model sees through its tokenizer's chat
template (``rlfabric.models.hf.encode_prompt``); every other column is per-sample metadata that the reward
functions receive (``row_metadata``). The rows of a text env or an agent are its tasks (``TASK_FIELDS``): the env's
reset writes the prompt, so a task needs no prompt column, and one without it is told apart by its whole content.
"""

from __future__ import annotations

import glob
import hashlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfabric.config import ConfigError

TASK_PREFIX = "task:"
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Held-out rows from a generated task are drawn in rounds of fresh seeds until enough new prompts turn up.
HELDOUT_ROUNDS = 50


@dataclass(frozen=True)
class RowFields:
    """The settings a data error tells the user to change. The defaults are a prompt file's; preference pairs
    (``reward_model.pairs``) read files through the same helpers with fixed columns and their own counts."""

    count: str = "data.num_train"  # the setting that asks for the training rows
    count_takes_null: bool = True  # whether it may be null (every row of a file)
    heldout_count: str = "data.num_eval"  # the setting that asks for the held-out rows
    heldout: str = "data.eval"  # the setting naming a file of held-out rows ("": they always come from the same file)
    prompt_key: str = "data.prompt_key"  # the setting naming the prompt column ("": the columns are fixed)
    columns: tuple[str, ...] = ()  # with prompt_key "": the text columns every row needs, the prompt's first
    tasks: bool = False  # rows are a text env's or an agent's tasks: a prompt column is optional


PROMPT_FIELDS = RowFields()
TASK_FIELDS = RowFields(tasks=True)


def load_prompts(
    spec: str,
    *,
    num_rows: int | None = None,
    seed: int = 0,
    prompt_key: str = "prompt",
    field: str = "data.train",
    fields: RowFields = PROMPT_FIELDS,
    keep_out: int = 0,
    note: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """The rows ``spec`` names; ``num_rows`` is required for generated tasks and optional (all rows) for files.
    ``fields``: the settings its errors name; ``keep_out``: the rows of the same file the caller holds out after
    these (``fields.heldout_count`` of them), so a file too short for both says how to split it; ``note`` is told,
    in one line, of a file's rows that neither those nor the held-out ones use."""
    if num_rows is not None and (not isinstance(num_rows, int) or num_rows < 0):
        raise ConfigError(f"{field} = {spec!r}: number of rows {num_rows!r} must be an integer >= 0")
    if spec.startswith(TASK_PREFIX):
        generate, options = _task(spec, field)
        if num_rows is None:
            raise ConfigError(f"{field} = {spec!r}: a generated task needs a number of rows, got none")
        rows = _generate(generate, options, num_rows, seed, spec, field)
    else:
        rows = _read_file(spec, field)
        _check_columns(rows, spec, prompt_key, field, fields)
        if num_rows is not None:
            if len(rows) < num_rows:
                raise ConfigError(
                    f"{field} = {spec!r}: has {_rows(len(rows))}, fewer than the {num_rows} asked for "
                    f"({fields.count}): {_fewer_rows_fix(len(rows), keep_out, fields)}"
                )
            if note is not None and len(rows) > num_rows + keep_out:
                note(_unused_rows_note(len(rows), num_rows, keep_out, spec, field, fields))
            rows = rows[:num_rows]
    _check_rows(rows, spec, prompt_key, field, fields)
    return rows


def _unused_rows_note(available: int, used: int, keep_out: int, spec: str, field: str, fields: RowFields) -> str:
    """A file has more rows than training (``used``) and the held-out rows after them (``keep_out``) take."""
    held = f" and holds out {keep_out} of the rest ({fields.heldout_count})" if keep_out else ""
    every = available - keep_out if keep_out or not fields.count_takes_null else "null"
    return (
        f"{field} = {spec!r}: {available - used - keep_out} of its {available} rows are not used: the run trains on "
        f"the first {used} ({fields.count}){held}; {fields.count}: {every} uses every row"
    )


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def _fewer_rows_fix(available: int, keep_out: int, fields: RowFields) -> str:
    """How to ask for no more rows than a file has, ``keep_out`` of them held out after the training rows."""
    if not keep_out:
        every = ", or null for every row" if fields.count_takes_null else ""
        return f"set {fields.count} to at most {available}{every}"
    if available > keep_out:
        left = f"leaving the {keep_out} rows {fields.heldout_count} asks for"
        fix = f"set {fields.count} to at most {available - keep_out}, {left}"
    else:
        fix = f"lower {fields.count} and {fields.heldout_count} ({keep_out}) to at most {available} rows together"
    if not fields.heldout:
        return f"{fix} (the held-out rows are those training leaves)"
    return (
        f"{fix} ({fields.heldout} is '': the held-out rows are those training leaves); with {fields.heldout} set to "
        f"a file of held-out prompts, {fields.count} at most {available}"
    )


def load_heldout(
    spec: str,
    *,
    train_rows: list[dict[str, Any]],
    num_rows: int | None = None,
    seed: int = 0,
    prompt_key: str = "prompt",
    field: str = "data.eval",
    count_field: str = "data.num_eval",
    fields: RowFields = PROMPT_FIELDS,
    note: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Evaluation rows whose prompts appear neither in ``train_rows`` nor twice among themselves (``count_field``:
    the setting that asked for ``num_rows``, None: every such row of a file; ``fields``: the other settings named).

    A generated task draws them with seeds derived from ``seed`` (so the same spec as training gives other rows),
    round after round until ``num_rows`` new prompts turn up; a file keeps its rows whose prompt is new. A file of
    held-out rows of its own (``field`` is ``fields.heldout``) that loses rows so says, in one line to ``note``.
    """
    seen = {row_identity(row, prompt_key) for row in train_rows}
    if not spec.startswith(TASK_PREFIX):
        file_rows = load_prompts(spec, prompt_key=prompt_key, field=field, fields=fields)
        own_file = bool(fields.heldout) and field == fields.heldout
        new, in_train, repeats = _new_rows(file_rows, seen, prompt_key)
        dropped = _dropped_text(len(file_rows), in_train, repeats, fields) if own_file and in_train + repeats else ""
        if dropped and note is not None:
            note(f"{field} = {spec!r}: {dropped}")
        rows = new if num_rows is None else new[:num_rows]
        if num_rows is not None and len(rows) < num_rows:
            kind = "task is not a training task" if fields.tasks else "prompt is not a training prompt"
            fixes = _fewer_heldout_fixes(len(rows), count_field, fields, len(train_rows), own_file)
            if dropped:
                fixes[-1] += f" ({dropped})"
            raise ConfigError(
                f"{field} = {spec!r}: has {_rows(len(rows))} whose {kind}, "
                f"fewer than the {num_rows} asked for ({count_field}): {', '.join(fixes[:-1])}"
                f"{', or ' if len(fixes) > 1 else ''}{fixes[-1]}"
            )
        return rows
    if num_rows is None:
        raise ConfigError(f"{field} = {spec!r}: a generated task needs a number of rows, got none")
    generate, options = _task(spec, field)
    rows: list[dict[str, Any]] = []
    for round_ in range(HELDOUT_ROUNDS):
        batch = _generate(generate, options, 2 * num_rows + 16, derive_seed(seed, f"heldout/{round_}"), spec, field)
        _check_rows(batch, spec, prompt_key, field, fields)
        rows += _new_rows(batch, seen, prompt_key)[0][: num_rows - len(rows)]
        if len(rows) == num_rows:
            return rows
    raise ConfigError(
        f"{field} = {spec!r}: found only {len(rows)} prompts that are not among the {len(seen)} training "
        f"prompts, {num_rows} asked for ({count_field}); ask for fewer rows or widen the task's options"
    )


def _dropped_text(total: int, in_train: int, repeats: int, fields: RowFields) -> str:
    """What a held-out file loses, e.g. "3 of its 20 rows are left out: 2 whose prompt is also a training prompt,
    1 repeating an earlier row's prompt"."""
    what = "task" if fields.tasks else "prompt"
    reasons = [f"{in_train} whose {what} is also a training {what}"] if in_train else []
    if repeats:
        reasons.append(f"{repeats} repeating an earlier row's {what}")
    return f"{in_train + repeats} of its {_rows(total)} are left out of the held-out set: {', '.join(reasons)}"


def _fewer_heldout_fixes(
    available: int, count_field: str, fields: RowFields, num_train: int, own_file: bool
) -> list[str]:
    """How to ask for no more held-out rows than ``available``: a file of their own (``own_file``) takes more rows,
    the rows training leaves of its file grow when training takes fewer."""
    every = " (or null for every row)" if own_file and count_field == fields.heldout_count else ""
    fixes = [f"lower {count_field} to at most {available}{every}"] if available else []
    if own_file:
        what = "tasks" if fields.tasks else "prompts"
        fixes.append(f"add rows to {fields.heldout} whose {what} are not training {what}")
        return fixes
    fixes.append(f"train on fewer rows ({fields.count}: {num_train} now) to leave more out")
    if fields.heldout:
        fixes.append(f"set {fields.heldout} to a file of held-out prompts")
    return fixes


def check_prompt_lengths(
    prompt_ids: Mapping[str, Sequence[Sequence[int]]], *, max_new_tokens: int, max_positions: int | None, model: str
) -> None:
    """Refuse prompts that do not fit the model's context with ``max_new_tokens`` generated after them.

    ``prompt_ids`` maps a data field ("data.train", "data.eval") to its encoded prompts; ``max_positions`` is the
    model's context length (None: unknown, nothing is checked); ``model`` is ``model.path``, named in the error.
    """
    if max_positions is None:
        return
    room = max_positions - max_new_tokens
    for field, prompts in prompt_ids.items():
        too_long = [i for i, ids in enumerate(prompts) if len(ids) > room]
        if not too_long:
            continue
        row = max(too_long, key=lambda i: len(prompts[i]))
        longest = len(prompts[row])
        limit = (
            "model.builtin.max_positions"
            if model == "builtin"
            else f"max_position_embeddings of model.path = {model!r}"
        )
        raise ConfigError(
            f"{field}: {len(too_long)} of {len(prompts)} prompts are too long for the model: the longest (row {row}) "
            f"is {longest} tokens, and with sampling.max_new_tokens = {max_new_tokens} it needs "
            f"{longest + max_new_tokens} positions, more than the model's {max_positions} ({limit}); shorten or drop "
            "those prompts, lower sampling.max_new_tokens, or use a model with a longer context"
        )


def row_metadata(row: dict[str, Any], prompt_key: str = "prompt") -> dict[str, Any]:
    """What the reward functions see of a row: every column except the prompt."""
    return {k: v for k, v in row.items() if k != prompt_key}


def data_sources(rows: Sequence[Mapping[str, Any]]) -> list[str] | None:
    """Each row's data source, its ``data_source`` column (verl's and Hugging Face datasets' name for where a row
    comes from; "none" where it has none), or None when the rows come from fewer than two sources: figures per
    source would repeat the totals."""
    names = ["none" if row.get("data_source") is None else str(row["data_source"]) for row in rows]
    return names if len(set(names)) >= 2 else None


def derive_seed(seed: int, purpose: str) -> int:
    """A seed for ``purpose`` that does not collide with ``seed`` itself or other purposes (a 63-bit hash)."""
    digest = hashlib.sha256(f"{seed}/{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def parse_task_spec(spec: str, field: str = "data.train") -> tuple[str, dict[str, Any]]:
    """``"task:name?a=1&b=x"`` -> ``("name", {"a": 1, "b": "x"})``."""
    name, _, query = spec[len(TASK_PREFIX) :].partition("?")
    options: dict[str, Any] = {}
    for item in query.split("&") if query else []:
        key, eq, value = item.partition("=")
        if not key or not eq:
            raise ConfigError(f"{field} = {spec!r}: option {item!r} is not key=value (options look like ?a=1&b=2)")
        options[key] = _parse_value(value)
    return name, options


def _parse_value(text: str) -> Any:
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _task(spec: str, field: str) -> tuple[Callable[..., list[dict[str, Any]]], dict[str, Any]]:
    from rlfabric.tasks import TASKS

    name, options = parse_task_spec(spec, field)
    if name not in TASKS:
        raise ConfigError(f"{field} = {spec!r}: no task {name!r}; tasks are {', '.join(sorted(TASKS))}")
    generate = TASKS[name]
    if isinstance(generate, str):  # a generator in an upper layer (one that starts servers), named by its path
        from rlfabric.shipping import import_callable

        generate = import_callable(generate)
    allowed = [p for p in inspect.signature(generate).parameters if p not in ("n", "seed")]
    for key in options:
        if key not in allowed:
            raise ConfigError(f"{field} = {spec!r}: {key!r} is not an option of task {name!r} ({', '.join(allowed)})")
    return generate, options


def _generate(
    generate: Callable[..., list[dict[str, Any]]], options: dict[str, Any], n: int, seed: int, spec: str, field: str
) -> list[dict[str, Any]]:
    try:
        return generate(n, seed, **options)
    except (ValueError, TypeError) as exc:  # a bad option value: say which spec it came from
        raise ConfigError(f"{field} = {spec!r}: {exc}") from exc


def data_files(spec: str, field: str) -> list[Path]:
    """The files a file spec names: one path, or a glob pattern (``shards/train-*.parquet``, as Hugging Face
    datasets' shards are named) matching files of one format, sorted by name; a ConfigError naming ``field`` when
    there are none or the format is not one rlfabric reads."""
    path = Path(spec).expanduser()
    if path.suffix not in FILE_FORMATS:
        raise ConfigError(f"{field} = {spec!r}: not 'task:<name>' and not a {', '.join(FILE_FORMATS)} file")
    where = "" if path.is_absolute() else f" ({path.absolute()}: relative paths start at the current directory)"
    if path.is_file() or not glob.has_magic(str(path)):
        if not path.is_file():
            raise ConfigError(f"{field} = {spec!r}: file does not exist{where}")
        return [path]
    matched = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
    if not matched:
        raise ConfigError(f"{field} = {spec!r}: the pattern matches no file{where}")
    return matched


def _read_file(spec: str, field: str) -> list[dict[str, Any]]:
    """Every row of the file(s) ``spec`` names (``data_files``), in file order."""
    files = data_files(spec, field)
    rows: list[dict[str, Any]] = []
    for path in files:
        label = f"{field} = {spec!r}" + (f" (file {str(path)!r})" if len(files) > 1 else "")  # which one failed
        rows += _read_one_file(path, label)
    return rows


def _read_one_file(path: Path, label: str) -> list[dict[str, Any]]:
    """The rows of one file; ``label`` starts its errors (the setting, and the file when a pattern matched it)."""
    import datasets

    bars_were_on, verbosity = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()  # a bar per small file only clutters the run's output
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its parse errors are logged, then raised: say it once
    try:
        table = datasets.load_dataset(FILE_FORMATS[path.suffix], data_files=str(path.resolve()), split="train")
    except Exception as exc:  # malformed JSON or parquet: one line naming the file, not a long arrow trace
        if _holds_no_rows(path):  # datasets fails on empty files with errors that do not say so
            raise ConfigError(f"{label}: the file holds no rows") from None
        root = exc  # datasets wraps the parser's error (which names the row) in a generic one
        while root.__cause__ is not None:
            root = root.__cause__
        reason = (str(root).strip().splitlines() or [""])[0]
        raise ConfigError(f"{label}: could not be read: {root.__class__.__name__}: {reason}") from exc
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars_were_on:
            datasets.enable_progress_bars()
    if len(table) == 0:
        raise ConfigError(f"{label}: the file holds no rows")
    return table.to_list()


def _holds_no_rows(path: Path) -> bool:
    """True for an empty or blank JSONL file, a JSON file holding ``[]``, and a parquet file of zero rows."""
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows == 0
        if path.suffix == ".json":
            text = path.read_text().strip()
            return not text or json.loads(text) == []
        with path.open() as f:
            return not any(line.strip() for line in f)
    except (OSError, ValueError):  # unreadable or malformed: not "empty", the datasets error says what it is
        return False


def _check_columns(rows: list[dict[str, Any]], spec: str, prompt_key: str, field: str, fields: RowFields) -> None:
    """A file's rows share their columns: refuse a file without the prompt column (or, for fixed columns, without
    one of them), naming the columns it has and the setting to change."""
    if not rows or fields.tasks:  # a task's env writes the prompt: any columns will do
        return
    has = ", ".join(map(repr, rows[0]))
    if fields.prompt_key:
        if prompt_key not in rows[0]:
            raise ConfigError(
                f"{field} = {spec!r}: no {prompt_key!r} column ({fields.prompt_key}); its columns are {has}: set "
                f"{fields.prompt_key} to the one holding the prompt text"
            )
        return
    missing = [c for c in fields.columns if c not in rows[0]]
    if missing:
        raise ConfigError(
            f"{field} = {spec!r}: no {', '.join(map(repr, missing))} column{'s' if len(missing) > 1 else ''}; its "
            f"columns are {has}: every row needs "
            f"the text columns {', '.join(fields.columns)} (these names are fixed: rename the file's columns)"
        )


def _check_rows(rows: list[dict[str, Any]], spec: str, prompt_key: str, field: str, fields: RowFields) -> None:
    if fields.tasks:
        return
    where = f"{fields.prompt_key}: {prompt_key}" if fields.prompt_key else "the prompt column"
    for i, row in enumerate(rows):
        if prompt_key not in row:  # a generated task's row (a file's columns are checked before)
            raise ConfigError(
                f"{field} = {spec!r}: row {i} has no {prompt_key!r} (its keys: {', '.join(map(str, row))}); "
                f"every row needs a string prompt under {where}"
            )
        prompt = row[prompt_key]
        if prompt is None:  # a file row with null there, or without the column its other rows have
            raise ConfigError(
                f"{field} = {spec!r}: row {i}'s {prompt_key!r} is null or missing; every row needs a string prompt "
                f"under {where}: fill it in or drop the row"
            )
        if isinstance(prompt, str):
            continue
        if not fields.prompt_key:  # fixed text columns (preference pairs): strings only
            raise ConfigError(f"{field} = {spec!r}: row {i}: {prompt_key!r} is a {type(prompt).__name__}, not a string")
        problem = messages_problem(prompt)
        if problem is not None:
            raise ConfigError(
                f"{field} = {spec!r}: row {i}: {prompt_key!r} {problem}; a prompt is a string or a list of chat "
                'messages, each an object with string "role" and "content" (e.g. {"role": "user", "content": "..."})'
            )


def is_conversation(prompt: Any) -> bool:
    """Whether ``prompt`` is a list of chat messages (TRL's conversational format) rather than a string."""
    return isinstance(prompt, list)


def messages_problem(prompt: Any) -> str | None:
    """What keeps ``prompt`` from being a conversational prompt (a non-empty list of objects with string ``role``
    and ``content``), as the rest of a sentence that starts with the column's name; None when it is one."""
    if not isinstance(prompt, list):
        return f"is a {type(prompt).__name__}, not a string or a list of chat messages"
    if not prompt:
        return "is an empty list of chat messages"
    for j, message in enumerate(prompt):
        if not isinstance(message, dict):
            return f"is a list whose message {j} is a {type(message).__name__}, not an object"
        for key in ("role", "content"):
            if message.get(key) is None:
                return f"is a list of chat messages whose message {j} has no {key!r}"
            if not isinstance(message[key], str):
                kind = type(message[key]).__name__
                return f"is a list of chat messages whose message {j} has a {kind} {key!r}, not a string"
    return None


def chat_messages(prompt: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversational prompt's messages as a chat template takes them: without the null fields a file's reader
    fills in where other rows' messages have keys this one lacks (``name``, ``tool_calls``)."""
    return [{k: v for k, v in message.items() if v is not None} for message in prompt]


def prompt_identity(prompt: str | list[dict[str, Any]]) -> str:
    """A prompt as a string that tells it apart from others: a string itself, a list of messages as canonical JSON."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(chat_messages(prompt), sort_keys=True, default=str)


def row_identity(row: dict[str, Any], prompt_key: str) -> str:
    """What tells ``row`` apart from the others: its prompt, else (a task with no prompt column) its whole content."""
    if prompt_key in row:
        return prompt_identity(row[prompt_key])
    return json.dumps(row, sort_keys=True, default=str)


def _new_rows(rows: list[dict[str, Any]], seen: set[str], prompt_key: str) -> tuple[list[dict[str, Any]], int, int]:
    """(the rows whose identity (``row_identity``) is neither in ``seen`` nor an earlier row's, how many were left
    out as in ``seen``, how many as repeating an earlier row); ``seen`` then holds the identities taken too."""
    out, in_seen, repeats = [], 0, 0
    taken: set[str] = set()
    for row in rows:
        identity = row_identity(row, prompt_key)
        if identity in seen:
            in_seen += 1
        elif identity in taken:
            repeats += 1
        else:
            taken.add(identity)
            out.append(row)
    seen |= taken
    return out, in_seen, repeats
