"""Docs that must match the code.

docs/config.md has two parts, "## algo: grpo ..." (``LLMConfig``) and "## algo: ppo" (``Config``); each lists
every leaf key of its dataclass with its default. examples/arithmetic_grpo.yaml spells out every ``LLMConfig`` key
at its default. After changing a default, rewrite both (defaults only; comments and meanings stay) with:

    python tests/test_docs.py --sync
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import re
import shlex
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from rlfabric.config import Config, ConfigError, config_from_dict, load_config
from rlfabric.config_base import coerce
from rlfabric.grpo_config import LLMConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DOC = ROOT / "docs" / "config.md"
GRPO_EXAMPLE = ROOT / "examples" / "arithmetic_grpo.yaml"
GRPO_HEADING = "## algo: grpo"
PPO_HEADING = "## algo: ppo"
KEY_ROW = re.compile(r"^\| `([a-z_.]+)` \|", flags=re.MULTILINE)
DEFAULT_ROW = re.compile(r"^(\| `([a-z_.]+)` \| )`([^`]*)`( \|)", flags=re.MULTILINE)


# -- helpers (also used by --sync) ------------------------------------------------------------------------------


def _leaf_fields(cls: type, prefix: str = "") -> list[str]:
    names = []
    for f in dataclasses.fields(cls):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            names += _leaf_fields(type(sub), f"{prefix}{f.name}.")
        else:
            names.append(prefix + f.name)
    return names


def _default(cls: type, key: str) -> tuple[Any, Any]:
    """(default value, type annotation) of a dotted leaf key of the dataclass ``cls``."""
    node: Any = cls()
    *sections, leaf = key.split(".")
    for name in sections:
        node = getattr(node, name)
    return getattr(node, leaf), typing.get_type_hints(type(node))[leaf]


def _doc_parts() -> dict[type, str]:
    """The text of each part of docs/config.md, by the dataclass it documents."""
    doc = CONFIG_DOC.read_text()
    grpo_at, ppo_at = doc.index("\n" + GRPO_HEADING), doc.index("\n" + PPO_HEADING)
    assert grpo_at < ppo_at, "docs/config.md: the algo: grpo part comes first, then algo: ppo"
    return {LLMConfig: doc[grpo_at:ppo_at], Config: doc[ppo_at:]}


def yaml_text(value: Any) -> str:
    """``value`` as one line of YAML flow text that reads back as the same value (floats always with a dot)."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != 0 and abs(value) < 1e-2:  # YAML 1.1 floats need a dot and a signed exponent: 5.0e-4
            mantissa, exponent = f"{value:.12e}".split("e")
            mantissa = mantissa.rstrip("0")
            return f"{mantissa}0e{int(exponent)}" if mantissa.endswith(".") else f"{mantissa}e{int(exponent)}"
        return repr(value)
    if isinstance(value, str):
        plain = re.fullmatch(r"[A-Za-z0-9_./+-][A-Za-z0-9_./:?=&+-]*", value) is not None
        return value if plain and yaml.safe_load(value) == value else '"' + value.replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{yaml_text(str(k))}: {yaml_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    raise TypeError(f"no YAML text for {value!r}")


def _wrong_doc_defaults(cls: type, part: str) -> list[str]:
    problems = []
    for _, key, text, _ in DEFAULT_ROW.findall(part):
        default, annotation = _default(cls, key)
        try:
            documented = coerce(yaml.safe_load(text), annotation, key)
        except (ConfigError, yaml.YAMLError) as exc:
            problems.append(f"{key}: documented default `{text}` does not read as the field's type ({exc})")
            continue
        if documented != default:
            problems.append(f"{key}: documented `{text}`, the dataclass says `{yaml_text(default)}`")
    return problems


def _yaml_leaf_keys(data: dict[str, Any], cls: type, prefix: str = "") -> set[str]:
    keys = set()
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        if dataclasses.is_dataclass(hints.get(name)) and isinstance(value, dict):
            keys |= _yaml_leaf_keys(value, hints[name], f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


# -- the tests --------------------------------------------------------------------------------------------------


def test_config_reference_lists_every_key_and_nothing_else():
    for cls, part in _doc_parts().items():
        documented = set(KEY_ROW.findall(part))
        expected = set(_leaf_fields(cls))
        assert documented == expected, (
            f"{cls.__name__}: undocumented {sorted(expected - documented)}, not fields {sorted(documented - expected)}"
        )
        with_default = [key for _, key, _, _ in DEFAULT_ROW.findall(part)]
        assert sorted(with_default) == sorted(KEY_ROW.findall(part)), f"{cls.__name__}: a row's default is not `...`"


def test_config_reference_defaults_are_the_dataclass_defaults():
    """Every default in docs/config.md equals the dataclass's; fix with `python tests/test_docs.py --sync`."""
    problems = [p for cls, part in _doc_parts().items() for p in _wrong_doc_defaults(cls, part)]
    assert not problems, "\n".join(problems)


def test_yaml_text_reads_back_as_the_same_value():
    for cls in (LLMConfig, Config):
        for key in _leaf_fields(cls):
            default, annotation = _default(cls, key)
            assert coerce(yaml.safe_load(yaml_text(default)), annotation, key) == default, key


def test_readme_quickstart_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(line for line in readme.splitlines() if "pytest" in line and line.startswith("pip install"))
    assert test_command.split("#")[0].strip() in ci


def test_every_example_config_is_valid():
    from rlfabric.config import load_config
    from rlfabric.data import TASK_PREFIX, load_prompts
    from rlfabric.registry import resolve
    from rlfabric.reward_model_stage import run_reward_model_specs
    from rlfabric.rewards import resolve_reward

    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert {p.name for p in examples} >= {"cartpole_ppo.yaml", "halfcheetah_ppo.yaml", "arithmetic_grpo.yaml"}
    for path in examples:
        cfg = load_config(path)
        if isinstance(cfg, Config):
            resolve(cfg.env.id)
            continue
        assert isinstance(cfg, LLMConfig), path
        trained_here = run_reward_model_specs(cfg.rewards.functions) if cfg.reward_model.pairs else []
        for i, spec in enumerate(cfg.rewards.functions):
            if i not in trained_here:  # the run's own reward model exists once the run has trained it
                resolve_reward(dataclasses.asdict(spec), f"{path.name}: rewards.functions[{i}]")
        for spec in (cfg.data.train, cfg.data.eval, cfg.reward_model.pairs):
            if spec.startswith(TASK_PREFIX):  # generated tasks: the name and options are checked by a few rows
                load_prompts(spec, num_rows=4, prompt_key=cfg.data.prompt_key)


def test_cartpole_example_is_the_ppo_defaults():
    """`rlfabric train examples/cartpole_ppo.yaml` trains PPO with every default."""
    from rlfabric.config import load_config

    assert load_config(ROOT / "examples" / "cartpole_ppo.yaml") == Config()


def test_arithmetic_example_spells_out_the_embedded_default():
    """`rlfabric train` with no config and examples/arithmetic_grpo.yaml train the same thing, and the example
    names every key."""
    from rlfabric.config import load_config

    assert load_config(GRPO_EXAMPLE) == load_config(None) == LLMConfig()
    data = yaml.safe_load(GRPO_EXAMPLE.read_text())
    assert _yaml_leaf_keys(data, LLMConfig) == set(_leaf_fields(LLMConfig))


# -- the Python in README.md and docs/*.md ----------------------------------------------------------------------

DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.MULTILINE | re.DOTALL)
# Where the classes the docs list field by field live.
DOC_CLASS_HOMES = ("rlfabric.rewards", "rlfabric.engines.base", "rlfabric.text_env")
# Calls that start a training run: running a doc example stops before the first of these.
TRAINING_CALLS = {"train", "train_llm", "Trainer", "GRPOTrainer"}


def _python_blocks(path: Path) -> list[tuple[str, str]]:
    """(file:line, code) of every python code block in a markdown file."""
    text = path.read_text()
    return [(f"{path.name}:{text[: m.start()].count(chr(10)) + 2}", m.group(1)) for m in PYTHON_BLOCK.finditer(text)]


def _parse_listing(code: str) -> ast.Module | None:
    """A block as Python; a listing that opens with a signature line (not Python) parses from its next line on."""
    lines = code.splitlines()
    for start in range(len(lines)):
        try:
            return ast.parse("\n".join(lines[start:]))
        except SyntaxError:
            continue
    return None


@dataclasses.dataclass
class _Instance:
    """A doc example's object made by calling an rlfabric class (``trainer = GRPOTrainer(...)``)."""

    cls: type


def _doc_block(name: str, doc: Path = ROOT / "README.md") -> str:
    """The block of ``doc`` that starts with the comment ``# <name>`` (a file the docs tell the user to write)."""
    blocks = [code for _, code in _python_blocks(doc) if code.startswith(f"# {name}")]
    assert len(blocks) == 1, f"{doc.name}: no python block starting with '# {name}'"
    return blocks[0]


def _is_users_file(code: str) -> bool:
    """A block that is a file the user writes (it opens with ``# <name>.py``), not a listing of rlfabric's classes."""
    first = code.split("\n", 1)[0]
    return first.startswith("# ") and ".py" in first.split()[1]


def _cli_train_line(text: str, marker: str) -> tuple[Path | None, list[str], list[str]]:
    """(config path, overrides, --import modules) of the ``rlfabric train`` command line that contains ``marker``."""
    line = next(line for line in text.splitlines() if "rlfabric train" in line and marker in line)
    words = shlex.split(line, comments=True)
    words = words[words.index("train") + 1 :]
    path, overrides, imports = None, [], []
    while words:
        word = words.pop(0)
        if word == "--import":
            imports.append(words.pop(0))
        elif "=" in word:
            overrides.append(word)
        else:
            path = ROOT / word
    return path, overrides, imports


def _check_names(where: str, tree: ast.Module) -> list[str]:
    """Every rlfabric name the code imports or reaches by attribute exists, and every call of an rlfabric callable
    binds to its signature (positional count and keyword names)."""
    problems: list[str] = []
    names: dict[str, Any] = {}
    for node in ast.walk(tree):
        try:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "rlfabric":
                        module = importlib.import_module(alias.name)
                        names[alias.asname or "rlfabric"] = (
                            module if alias.asname else importlib.import_module("rlfabric")
                        )
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "rlfabric":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    names[alias.asname or alias.name] = getattr(module, alias.name)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{where}: line {node.lineno}: {ast.unparse(node)}: {exc}")

    def resolve(expr: ast.expr) -> Any:
        if isinstance(expr, ast.Name):
            return names.get(expr.id)
        if isinstance(expr, ast.Attribute):
            owner = resolve(expr.value)
            if owner is None:
                return None
            target = owner.cls if isinstance(owner, _Instance) else owner
            if not hasattr(target, expr.attr):
                problems.append(f"{where}: line {expr.lineno}: {ast.unparse(expr)}: no attribute {expr.attr!r}")
                return None
            found = getattr(target, expr.attr)
            if isinstance(owner, _Instance) and inspect.isfunction(found):
                static = isinstance(inspect.getattr_static(owner.cls, expr.attr), staticmethod)
                return found if static else functools.partial(found, None)  # bound to the instance
            return found
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            resolve(node)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            made = resolve(node.value.func)
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(made, type):
                    names[target.id] = _Instance(made)
        if isinstance(node, ast.Call) and not any(isinstance(a, ast.Starred) for a in node.args):
            fn = resolve(node.func)
            if callable(fn) and all(k.arg is not None for k in node.keywords):
                try:
                    inspect.signature(fn).bind(*[None] * len(node.args), **{k.arg: None for k in node.keywords})
                except TypeError as exc:
                    problems.append(f"{where}: line {node.lineno}: {ast.unparse(node.func)}(...) does not fit: {exc}")
    return list(dict.fromkeys(problems))  # an attribute is met again as the callee of its call


def _run_until_training(code: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """Run a doc example's statements in order, stopping before the first that starts a training run."""
    for statement in ast.parse(code).body:
        calls = [n.func for n in ast.walk(statement) if isinstance(n, ast.Call)]
        called = {c.id if isinstance(c, ast.Name) else getattr(c, "attr", None) for c in calls}
        if called & TRAINING_CALLS:
            break
        exec(compile(ast.Module([statement], []), "<doc>", "exec"), namespace)
    return namespace


def _reward_inputs(*samples: dict[str, Any]) -> list[Any]:
    """RewardInputs made with exactly the fields docs/llm.md lists for them (those with a default: when given)."""
    from rlfabric.rewards import RewardInput

    listed = _documented_classes()["RewardInput"]
    return [
        RewardInput(**{name: sample[name] for name, optional in listed[0] if name in sample or not optional})
        for sample in samples
    ]


def _documented_classes() -> dict[str, tuple[list[tuple[str, bool]], list[tuple[str, list[str]]]]]:
    """Class name -> (fields as (name, has a default), methods as (name, parameter names)) as the docs list them."""
    classes = {}
    for path in DOC_FILES:
        for _, code in _python_blocks(path):
            tree = None if _is_users_file(code) else _parse_listing(code)
            for node in tree.body if tree else []:
                if not isinstance(node, ast.ClassDef):
                    continue
                fields = [
                    (item.target.id, item.value is not None)
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                ]
                methods = [
                    (item.name, [a.arg for a in item.args.args + item.args.kwonlyargs])
                    for item in node.body
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                ]
                classes[node.name] = (fields, methods)
    return classes


def test_python_in_the_docs_uses_names_that_exist_with_their_signatures():
    """README.md and docs/*.md: each rlfabric import, attribute and call in a python block is real and fits."""
    blocks = [(where, _parse_listing(code)) for path in DOC_FILES for where, code in _python_blocks(path)]
    assert len(blocks) >= 6 and all(tree is not None for _, tree in blocks), [w for w, t in blocks if t is None]
    problems = [p for where, tree in blocks for p in _check_names(where, tree)]
    assert not problems, "\n".join(problems)


def test_the_names_checker_notices_a_wrong_name_or_call():
    tree = ast.parse(
        "import rlfabric\nfrom rlfabric.rewards import register_reward\nrlfabric.load_configs(None)\n"
        "register_reward('x', print, 3)\nrlfabric.load_config(None, overrides=[], strict=True)\n"
    )
    problems = _check_names("example", tree)
    assert len(problems) == 3 and "load_configs" in problems[0], problems


def test_classes_the_docs_list_have_those_fields_and_methods():
    documented = _documented_classes()
    assert {"RewardInput", "RewardResult", "Completion", "Engine"} <= set(documented)
    problems = []
    for name, (fields, methods) in documented.items():
        homes = [importlib.import_module(m) for m in DOC_CLASS_HOMES]
        real = next((getattr(home, name) for home in homes if hasattr(home, name)), None)
        if real is None:
            problems.append(f"{name}: the docs list it, but none of {', '.join(DOC_CLASS_HOMES)} has it")
            continue
        if dataclasses.is_dataclass(real):
            actual = [
                (f.name, f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
                for f in dataclasses.fields(real)
            ]
        else:
            actual = [(key, hasattr(real, key)) for key in real.__annotations__]
        if actual != fields:
            problems.append(f"{name}: the docs list fields {fields}, the code has {actual}")
        for method, params in methods:
            fn = getattr(real, method, None)
            if fn is None or list(inspect.signature(fn).parameters) != params:
                got = None if fn is None else list(inspect.signature(fn).parameters)
                problems.append(f"{name}.{method}: the docs show parameters {params}, the code has {got}")
    assert not problems, "\n".join(problems)


def test_readme_reward_example_scores_as_the_readme_says():
    """README's my_rewards.py, registered and configured exactly as its command line does, scores a group."""
    from rlfabric.rewards import resolve_reward

    module = types.ModuleType("my_rewards")
    exec(_doc_block("my_rewards.py"), module.__dict__)
    path, overrides, imports = _cli_train_line((ROOT / "README.md").read_text(), "--import my_rewards")
    assert imports == ["my_rewards"] and path is None
    cfg = load_config(path, overrides)
    assert isinstance(cfg, LLMConfig) and cfg.rewards.weights == {"correct": 1.0, "short": 0.5}
    (spec,) = cfg.rewards.functions
    score = resolve_reward(dataclasses.asdict(spec))
    group = _reward_inputs(
        {
            "prompt": "12+35=",
            "completion": " 47\n",
            "metadata": {"answer": "47"},
            "finish_reason": "stop",
            "num_tokens": 5,
        },
        {
            "prompt": "12+35=",
            "completion": "46",
            "metadata": {"answer": "47"},
            "finish_reason": "length",
            "num_tokens": 12,
        },
    )
    assert score(group) == [{"correct": 1.0, "short": -0.05}, {"correct": 0.0, "short": -0.12}]


def test_readme_env_example_registers_an_env_the_trainer_builds(tmp_path, monkeypatch):
    """README's my_envs.py (with a stand-in for its MyEnv) and its command line and Python give a Trainer of it."""
    import gymnasium as gym

    import rlfabric
    from rlfabric.driver import Trainer

    class MyEnv(gym.Env):
        observation_space = gym.spaces.Box(-1.0, 1.0, (2,))
        action_space = gym.spaces.Discrete(2)

        def __init__(self, size: int) -> None:
            self.size = size

    module = types.ModuleType("my_envs")
    module.MyEnv = MyEnv
    exec(_doc_block("my_envs.py"), module.__dict__)
    monkeypatch.setitem(sys.modules, "my_envs", module)
    path, overrides, imports = _cli_train_line((ROOT / "README.md").read_text(), "--import my_envs")
    assert imports == ["my_envs"]
    cfg = load_config(path, overrides)
    assert cfg.env.id == "my-env" and rlfabric.make_env(cfg.env.id, cfg.env.kwargs).size == 7

    python = next(code for _, code in _python_blocks(ROOT / "README.md") if code.startswith("import my_envs"))
    monkeypatch.chdir(ROOT)  # the example's config path is relative to the checkout
    namespace = _run_until_training(python, {})
    assert isinstance(namespace["cfg"], Config) and namespace["cfg"].env.id == "my-env"
    trainer = Trainer(namespace["cfg"], tmp_path / "run")  # resolves the registered env; starts nothing yet
    assert trainer.pool is None


def test_the_agents_guides_text_env_passes_envs_check_as_shown(monkeypatch, capsys):
    """docs/agents.md's my_text.py, imported as its command line does, plays one turn through rlfabric envs check."""
    from rlfabric.cli import main

    doc = ROOT / "docs" / "agents.md"
    module = types.ModuleType("my_text")
    exec(_doc_block("my_text.py", doc), module.__dict__)
    monkeypatch.setitem(sys.modules, "my_text", module)
    line = next(line for line in doc.read_text().splitlines() if line.startswith("rlfabric envs check echo"))
    words = shlex.split(line, comments=True)
    assert words[:3] == ["rlfabric", "envs", "check"] and "--import" in words, words
    assert main(words[1:]) == 0
    assert capsys.readouterr().out == (
        "OK echo (text env): reset -> 'Say cab:'; step('cab') -> 'bye', rewards {'correct': 1.0}\n"
    )


def test_llm_guide_python_api_example_configures_and_scores_as_shown():
    """docs/llm.md's Python API example up to its training call: the reward it registers and the config it loads."""
    from rlfabric.rewards import resolve_reward

    (code,) = [c for _, c in _python_blocks(ROOT / "docs" / "llm.md") if "register_reward(" in c]
    namespace = _run_until_training(code, {})
    cfg = namespace["cfg"]
    assert isinstance(cfg, LLMConfig) and cfg.training.total_steps == 50
    names = [spec.name for spec in cfg.rewards.functions]
    assert names == ["arithmetic", "ends_cleanly"]
    score = resolve_reward(dataclasses.asdict(cfg.rewards.functions[1]))
    group = _reward_inputs(
        {"prompt": "1+1=", "completion": "2", "metadata": {"answer": "2"}, "finish_reason": "stop", "num_tokens": 2},
        {"prompt": "1+1=", "completion": "22", "metadata": {"answer": "2"}, "finish_reason": "length", "num_tokens": 8},
    )
    assert score(group) == [{"clean_stop": 0.2}, {"clean_stop": 0.0}]
    arithmetic = resolve_reward(dataclasses.asdict(cfg.rewards.functions[0]))
    assert [c["correct"] for c in arithmetic(group)] == [1.0, 0.0]


# -- python tests/test_docs.py --sync ---------------------------------------------------------------------------


def sync_config_doc() -> list[str]:
    """Rewrite the defaults column of docs/config.md from the dataclasses; return the keys it could not place."""
    doc = CONFIG_DOC.read_text()
    grpo_at, ppo_at = doc.index("\n" + GRPO_HEADING), doc.index("\n" + PPO_HEADING)
    pieces = [(None, doc[:grpo_at]), (LLMConfig, doc[grpo_at:ppo_at]), (Config, doc[ppo_at:])]
    out, missing = [], []
    for cls, text in pieces:
        if cls is not None:
            fields = set(_leaf_fields(cls))

            def replace(m: re.Match, cls: type = cls, fields: set[str] = fields) -> str:
                if m.group(2) not in fields:
                    return m.group(0)
                return f"{m.group(1)}`{yaml_text(_default(cls, m.group(2))[0])}`{m.group(4)}"

            text = DEFAULT_ROW.sub(replace, text)
            documented = set(KEY_ROW.findall(text))
            missing += [f"{cls.__name__}: {k} (add a row)" for k in sorted(fields - documented)]
            missing += [f"{cls.__name__}: {k} (no such field; remove its row)" for k in sorted(documented - fields)]
        out.append(text)
    CONFIG_DOC.write_text("".join(out))
    return missing


_YAML_LINE = re.compile(r"^(?P<indent> *)(?P<key>[a-z_]+):(?P<value>[^#]*?)(?P<gap>\s*)(?P<comment>#.*)?$")


def sync_grpo_example() -> list[str]:
    """Rewrite each value of examples/arithmetic_grpo.yaml to the LLMConfig default, keeping the comments."""
    lines, path, out = GRPO_EXAMPLE.read_text().splitlines(), [], []
    fields = set(_leaf_fields(LLMConfig))
    for line in lines:
        m = _YAML_LINE.match(line)
        if not m or line.lstrip().startswith("#"):
            out.append(line)
            continue
        depth = len(m["indent"]) // 2
        path = [*path[:depth], m["key"]]
        key = ".".join(path)
        if key not in fields:  # a section header
            out.append(line)
            continue
        head = f"{m['indent']}{m['key']}: {yaml_text(_default(LLMConfig, key)[0])}"
        if m["comment"]:
            column = len(line) - len(m["comment"])
            head = head.ljust(column) if len(head) < column - 1 else head + "  "
            head += m["comment"]
        out.append(head)
    GRPO_EXAMPLE.write_text("\n".join(out) + "\n")
    present = _yaml_leaf_keys(yaml.safe_load(GRPO_EXAMPLE.read_text()), LLMConfig)
    return [f"{GRPO_EXAMPLE.name}: {k} (add it)" for k in sorted(fields - present)] + [
        f"{GRPO_EXAMPLE.name}: {k} (no such field; remove it)" for k in sorted(present - fields)
    ]


if __name__ == "__main__":
    if sys.argv[1:] != ["--sync"]:
        sys.exit("usage: python tests/test_docs.py --sync   (rewrite the defaults in docs/config.md and the example)")
    todo = sync_config_doc() + sync_grpo_example()
    print("synced docs/config.md defaults and examples/arithmetic_grpo.yaml values")
    for item in todo:
        print("  by hand:", item)
    sys.exit(1 if todo else 0)


# -- docs/migrating.md ----------------------------------------------------------------------------------------

MIGRATING_DOC = ROOT / "docs" / "migrating.md"


def _migrating_tables() -> dict[str, str]:
    """The text of docs/migrating.md's TRL part, its CleanRL part and its verl part, by library name."""
    doc = MIGRATING_DOC.read_text()
    trl_at, cleanrl_at, verl_at = doc.index("\n## TRL"), doc.index("\n## CleanRL"), doc.index("\n## verl")
    assert trl_at < cleanrl_at < verl_at, "docs/migrating.md: the TRL part, then CleanRL, then verl"
    return {"TRL": doc[trl_at:cleanrl_at], "CleanRL": doc[cleanrl_at:verl_at], "verl": doc[verl_at:]}


def test_the_migration_tables_and_the_alias_table_agree():
    """Each name the unknown-key error maps (rlfabric/config_aliases.py) is a row of its library's table in
    docs/migrating.md with the same rlfabric key, and that key exists in the schema."""
    from rlfabric.config_aliases import ALIASES

    parts = _migrating_tables()
    schema = {"grpo": set(_leaf_fields(LLMConfig)), "ppo": set(_leaf_fields(Config))}
    for alias in ALIASES:
        assert alias.target in schema[alias.algo], f"{alias.name}: {alias.target} is not an {alias.algo} key"
        row = re.search(rf"^\| `{alias.name}` \| (.*?) \|", parts[alias.library], flags=re.MULTILINE)
        assert row, f"docs/migrating.md: no {alias.library} row for `{alias.name}`"
        assert f"`{alias.target}`" in row.group(1), f"docs/migrating.md: `{alias.name}` is not `{alias.target}`"
    for library, part in parts.items():  # and the other way: each row of a table is a name the error answers
        rows = set(re.findall(r"^\| `([^`]+)` \| `", part, flags=re.MULTILINE))
        mapped = {alias.name for alias in ALIASES if alias.library == library}
        assert rows <= mapped, f"docs/migrating.md: {library} rows the alias table lacks: {sorted(rows - mapped)}"


def test_the_migration_guides_yaml_configs_are_valid():
    """The minimal config for one's own model and the CleanRL MuJoCo block validate as written."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", MIGRATING_DOC.read_text(), flags=re.MULTILINE | re.DOTALL)
    assert len(blocks) == 2
    own, mujoco = (config_from_dict(yaml.safe_load(block)) for block in blocks)
    assert own.model.path == "Qwen/Qwen2.5-0.5B-Instruct" and own.sft.steps == 0 and own.grpo.lr == 1e-6
    assert own.sampling.max_new_tokens == 256
    assert mujoco.ppo.train_batch_size // mujoco.ppo.minibatch_size == 32  # CleanRL's num_minibatches
    example = load_config(ROOT / "examples" / "halfcheetah_ppo.yaml")
    assert mujoco.ppo == example.ppo and mujoco.runners == example.runners
