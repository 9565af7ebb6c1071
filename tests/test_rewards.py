"""Reward functions: math answer checking, the built-in rewards' components, and the reward registry."""

from __future__ import annotations

import functools
from fractions import Fraction

import pytest

from rlfabric import rewards
from rlfabric.config import ConfigError
from rlfabric.rewards import (
    RewardInput,
    RewardNotFoundError,
    RewardSpec,
    answers_match,
    extract_answer,
    normalize_answer,
    register_reward,
    resolve_reward,
)
from rlfabric.rewards.math_verify import find_answer


def sample(completion: str, num_tokens: int = 5, **metadata) -> RewardInput:
    return RewardInput("p", completion, metadata, finish_reason="stop", num_tokens=num_tokens)


@pytest.mark.parametrize(
    ("text", "expected", "form"),
    [
        (r"so the result is \boxed{42}.", "42", "boxed"),
        (r"first \boxed{1} then \boxed{2}", "2", "boxed"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", "boxed"),
        (r"\boxed{x^{2} + \sqrt{y_{1}}}", r"x^{2} + \sqrt{y_{1}}", "boxed"),
        (r"\boxed{7} and an unclosed \boxed{8", "7", "boxed"),
        ("Answer: 17", "17", "marker"),
        ("answer: -3.5. That is all", "-3.5", "marker"),
        ("The answer: $1,234$", "1,234", "marker"),
        ("work work\n#### 72", "72", "marker"),
        ("Answer: 3/4 of the cake", "3/4", "marker"),
        (r"Answer: \frac{2}{3}", r"\frac{2}{3}", "marker"),
        ("Answer: blue.", "blue", "marker"),
        ("3 apples and 4 pears make 7 fruit", "7", "number"),
        ("it costs 1,250.75 dollars", "1,250.75", "number"),
        ("from 10 down to -2", "-2", "number"),
        ("x2 and y", None, "none"),
        ("no numbers here", None, "none"),
        ("", None, "none"),
    ],
)
def test_extract_answer(text, expected, form):
    assert extract_answer(text) == expected
    assert find_answer(text) == (expected, form)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (" 42 ", Fraction(42)),
        ("$42$", Fraction(42)),
        ("42.", Fraction(42)),
        ("1,234", Fraction(1234)),
        ("-1,234.5", Fraction(-2469, 2)),
        ("0.50", Fraction(1, 2)),
        (".25", Fraction(1, 4)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"\dfrac{6}{8}", Fraction(3, 4)),
        (r"-\frac{1}{2}", Fraction(-1, 2)),
        (r"\frac12", Fraction(1, 2)),
        ("3/6", Fraction(1, 2)),
        ("1/0", "1/0"),
        ("1,2", "1,2"),  # not a thousands grouping: left as text
        ("x + 1", "x+1"),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected
    assert type(normalize_answer(raw)) is type(expected)


@pytest.mark.parametrize(
    ("pred", "truth", "match"),
    [
        ("42", "42", True),
        ("42.0", "42", True),
        ("1/2", "0.5", True),
        (r"\frac{1}{2}", "1/2", True),
        ("$1,000$", "1000", True),
        ("7", 7, True),  # truths from JSON may be numbers
        ("0.1", 0.1, True),
        ("42", "43", False),
        ("4.2", "42", False),
        ("x+1", "x + 1", True),
        ("x+1", "1", False),
        ("7", "seven", False),
        (None, "7", False),
    ],
)
def test_answers_match(pred, truth, match):
    assert answers_match(pred, truth) is match


def test_math_reward_components():
    math = resolve_reward("math")
    got = math(
        [
            sample(r"... so \boxed{12}", answer="12"),
            sample("Answer: 12.0", answer="12"),
            sample("I think it is 12", answer="12"),  # right, but not in the expected form
            sample(r"\boxed{13}", answer="12"),
            sample("no idea", answer="12"),
        ]
    )
    assert got == [
        {"correct": 1.0, "format": 1.0},
        {"correct": 1.0, "format": 1.0},
        {"correct": 1.0, "format": 0.0},
        {"correct": 0.0, "format": 1.0},
        {"correct": 0.0, "format": 0.0},
    ]
    with pytest.raises(KeyError, match=r"reward 'math' needs metadata\['answer'\]"):
        math([sample("1", solution="1")])
    assert resolve_reward({"name": "math", "kwargs": {"answer_key": "solution"}})([sample("1", solution="1")]) == [
        {"correct": 1.0, "format": 0.0}
    ]


def test_arithmetic_reward_reads_the_first_line_exactly():
    arithmetic = resolve_reward("arithmetic")
    cases = [("47", 1, 1), (" 47 \n12+3=15", 1, 1), ("-5", 0, 1), ("47.0", 0, 0), ("4 7", 0, 0), ("", 0, 0)]
    got = arithmetic([sample(text, answer="47") for text, _, _ in cases])
    assert got == [{"correct": float(c), "format": float(f)} for _, c, f in cases]
    assert arithmetic([sample("-5", answer="-5")]) == [{"correct": 1.0, "format": 1.0}]


def test_countdown_reward_parses_safely_and_counts_numbers():
    countdown = resolve_reward("countdown")
    meta = {"numbers": [3, 5, 7], "target": 22}
    cases = [
        ("3*5+7", 1, 1),
        ("(7 + 5) * 3 - 14", 0, 1),  # 14 is not a given number
        ("7*3+5-3", 0, 1),  # 3 used twice
        ("5*3+7\nsome chatter", 1, 1),
        ("(3+5)*7/ (7-7)", 0, 1),  # division by zero: parses, never equals
        ("5*3+7=22", 0, 0),
        ("__import__('os').system('true')", 0, 0),
        ("(lambda: 22)()", 0, 0),
        ("-3+5*5", 0, 0),  # unary minus is not allowed
        ("2**5", 0, 0),
        ("3 5 7", 0, 0),
        ("1" * 300, 0, 0),  # too long to be read as an expression
        ("", 0, 0),
    ]
    got = countdown([sample(text, **meta) for text, _, _ in cases])
    assert got == [{"correct": float(c), "format": float(f)} for _, c, f in cases]
    fractions = {"numbers": [2, 3, 4], "target": 6}
    assert countdown([sample("4/2*3", **fractions)]) == [{"correct": 1.0, "format": 1.0}]  # exact division
    thirds = {"numbers": [3, 4, 6], "target": 8}
    assert countdown([sample("4/3*6", **thirds)]) == [{"correct": 1.0, "format": 1.0}]  # 4/3 stays exact


def test_length_reward_is_dapo_soft_overlong_punishment():
    length = resolve_reward({"name": "length", "kwargs": {"max_tokens": 20, "cache_tokens": 8}})
    got = length([sample("", num_tokens=n) for n in (5, 12, 13, 16, 20, 21)])
    assert [g["length_penalty"] for g in got] == [0.0, 0.0, -1 / 8, -4 / 8, -1.0, -1.0]
    scaled = resolve_reward({"name": "length", "kwargs": {"max_tokens": 20, "cache_tokens": 8, "scale": 0.5}})
    assert scaled([sample("", num_tokens=16)]) == [{"length_penalty": -0.25}]
    with pytest.raises(ValueError, match=r"cache_tokens = 30: must be an integer in \[1, max_tokens = 20\]"):
        resolve_reward({"name": "length", "kwargs": {"max_tokens": 20, "cache_tokens": 30}})([])


def brevity(inputs: list[RewardInput], *, limit: int = 3) -> list[dict[str, float]]:
    return [{"brief": float(len(x.completion) <= limit)} for x in inputs]


def test_register_and_resolve():
    register_reward("brevity", brevity)
    assert "brevity" in rewards.list_rewards()
    assert resolve_reward("brevity")([sample("abcd")]) == [{"brief": 0.0}]
    bound = resolve_reward({"name": "brevity", "kwargs": {"limit": 5}})
    assert isinstance(bound, functools.partial) and bound([sample("abcd")]) == [{"brief": 1.0}]
    assert resolve_reward("rlfabric.rewards.builtin:arithmetic_reward")([sample("1", answer="1")])[0]["correct"] == 1
    with pytest.raises(ValueError, match="name 'a:b' is not valid"):
        register_reward("a:b", brevity)


def correctness_reward(completions, answer, **kwargs):  # TRL's form: columns as keyword arguments
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def test_a_trl_style_reward_is_told_the_contract():
    register_reward("trl_style", correctness_reward)
    with pytest.raises(ConfigError) as info:
        resolve_reward("trl_style", field="rewards.functions[0]")
    message = str(info.value)
    assert "missing a required argument: 'answer'" in message and "\n" not in message
    assert message.endswith(
        "a reward is fn(inputs: list[RewardInput], **kwargs) -> list[dict[str, float]], the dataset's columns in "
        "inputs[i].metadata (see docs/migrating.md)"
    )


def test_resolve_errors_name_the_field_and_what_is_registered():
    register_reward("brevity", brevity)
    with pytest.raises(RewardNotFoundError, match=r"rewards.functions\[1\] = 'mth' is not valid") as info:
        resolve_reward("mth", field="rewards.functions[1]")
    listed = str(info.value).split("not a registered reward (")[1].split(")")[0].split(", ")
    assert listed == sorted(rewards.list_rewards()) and {"brevity", "math", "countdown"} <= set(listed)
    with pytest.raises(
        ConfigError,
        match=r"rewards.functions\[0\].kwargs = \{'lmit': 5\}: reward 'brevity' cannot"
        r" take them .*its parameters: limit",
    ):
        resolve_reward({"name": "brevity", "kwargs": {"lmit": 5}}, field="rewards.functions[0]")
    with pytest.raises(ConfigError, match="missing a required argument: 'cache_tokens'"):
        resolve_reward({"name": "length", "kwargs": {"max_tokens": 5}})
    with pytest.raises(ConfigError, match="unknown key.* weight; a reward spec has 'name' and 'kwargs'"):
        RewardSpec.parse({"name": "math", "weight": 2})


@rewards.default_weights(steps=0.0, style=0.5)
def styled(inputs: list[RewardInput], *, scale: float = 1.0) -> list[dict[str, float]]:
    return [{"correct": scale, "steps": 3.0, "style": 1.0} for _ in inputs]


def test_components_a_function_weighs_by_default_and_the_config_overrides():
    # The built-in verifiers' format describes the answer, it is no reward: 0 unless rewards.weights names it.
    verifiers = {f"rewards.functions[{i}]": resolve_reward(name) for i, name in enumerate(["arithmetic", "math"])}
    assert rewards.weights_with_defaults({}, verifiers) == {"format": 0.0}
    assert rewards.weights_with_defaults({"correct": 2.0}, verifiers) == {"correct": 2.0, "format": 0.0}
    assert rewards.weights_with_defaults({"format": 0.1}, verifiers) == {"format": 0.1}
    assert rewards.weights_with_defaults({"x": 1.0}, {"f": brevity}) == {"x": 1.0}  # declares nothing
    # declared on a function of the user's, kept when kwargs are bound
    register_reward("styled", styled)
    bound = resolve_reward({"name": "styled", "kwargs": {"scale": 2.0}})
    assert rewards.weights_with_defaults({"style": 1.0}, {"f": bound}) == {"style": 1.0, "steps": 0.0}


def test_two_functions_that_weigh_a_component_differently_must_be_settled_by_the_config():
    @rewards.default_weights(format=1.0)
    def strict_format(inputs: list[RewardInput]) -> list[dict[str, float]]:
        return [{"format": 1.0} for _ in inputs]

    functions = {"rewards.functions[0]": resolve_reward("arithmetic"), "rewards.functions[1]": strict_format}
    with pytest.raises(ConfigError) as info:
        rewards.weights_with_defaults({}, functions)
    assert str(info.value) == (
        "rewards.functions[0] weighs component 'format' 0 by default and rewards.functions[1] weighs it 1: give "
        "rewards.weights.format the weight it should have"
    )
    assert rewards.weights_with_defaults({"format": 0.5}, functions) == {"format": 0.5}
    with pytest.raises(TypeError, match=r"default_weights\(format='0'\): a weight must be a finite number"):
        rewards.default_weights(format="0")
    with pytest.raises(TypeError, match=r"default_weights\(format=nan\): a weight must be a finite number"):
        rewards.default_weights(format=float("nan"))


@rewards.gives("helpful", "harmless")
def rated(inputs: list[RewardInput], *, helpful: float = 1.0) -> list[dict[str, float]]:
    return [{"helpful": helpful, "harmless": 1.0} for _ in inputs]


def test_declared_components_are_known_before_scoring_and_belong_to_one_function():
    register_reward("rated", rated)
    bound = resolve_reward({"name": "rated", "kwargs": {"helpful": 0.5}})  # kept when kwargs are bound
    assert rewards.declared_components(bound) == {"helpful", "harmless"}
    assert rewards.declared_components(resolve_reward("arithmetic")) == {"correct", "format"}
    assert rewards.declared_components(brevity) is None
    functions = {"rewards.functions[0]": resolve_reward("arithmetic"), "rewards.functions[1]": bound}
    assert rewards.components_of(functions) == {
        "correct": "rewards.functions[0]",
        "format": "rewards.functions[0]",
        "helpful": "rewards.functions[1]",
        "harmless": "rewards.functions[1]",
    }
    assert rewards.components_of({**functions, "rewards.functions[2]": brevity}) is None  # brevity's are unknown
    with pytest.raises(ConfigError) as info:
        rewards.components_of(
            {"rewards.functions[0]": resolve_reward("math"), "rewards.functions[1]": functions["rewards.functions[0]"]}
        )
    assert str(info.value) == (
        "rewards.functions[0] and rewards.functions[1] both give component 'correct': a component comes from one "
        "function (wrap one of them to rename it)"
    )
    with pytest.raises(ConfigError) as info:
        rewards.check_names_given(["helpfull", "harmless"], {"helpful", "harmless"}, "--correct", "reward 'rated'")
    assert str(info.value) == (
        "--correct names 'helpfull' (did you mean 'helpful'?): reward 'rated' gives only harmless, helpful"
    )
    rewards.check_names_given(["helpful"], {"helpful", "harmless"}, "--correct", "reward 'rated'")  # no error
    with pytest.raises(TypeError, match=r"gives\(\): name one or more components"):
        rewards.gives()


def test_a_reward_spec_that_names_nothing_says_why(tmp_path, monkeypatch):
    with pytest.raises(RewardNotFoundError) as info:
        resolve_reward("arithmetc", "rewards.functions[0]")
    assert str(info.value).startswith(
        "rewards.functions[0] = 'arithmetc' is not valid (did you mean 'arithmetic'?): not a registered reward ("
    )
    with pytest.raises(RewardNotFoundError) as info:
        resolve_reward("no_such_module_here:score", "rewards.functions[0]")
    assert str(info.value) == (
        "rewards.functions[0] = 'no_such_module_here:score' is not valid: no module 'no_such_module_here' in the "
        "current directory or on the Python path"
    )
    with pytest.raises(RewardNotFoundError) as info:
        resolve_reward("json:no_such_function", "rewards.functions[0]")
    assert str(info.value) == (
        "rewards.functions[0] = 'json:no_such_function' is not valid: module 'json' has no function 'no_such_function'"
    )
    (tmp_path / "broken_rewards_module.py").write_text("x = 1\nraise RuntimeError('no scoring today')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        resolve_reward("broken_rewards_module:score", "rewards.functions[0]")
    assert str(info.value) == (
        "rewards.functions[0] = 'broken_rewards_module:score': importing 'broken_rewards_module' raised "
        "RuntimeError: no scoring today (at broken_rewards_module.py:2)"
    )


def test_rewards_list_shows_what_each_function_gives_and_takes(tmp_path, monkeypatch, capsys):
    from rlfabric.cli import main

    (tmp_path / "my_graders.py").write_text(
        "import rlfabric.rewards as rewards\n\n\n"
        "@rewards.default_weights(style=0.5)\n"
        "@rewards.gives('correct', 'style')\n"
        "def graded(inputs, *, strict=True):\n"
        "    return [{'correct': 1.0, 'style': 0.0} for _ in inputs]\n\n\n"
        "rewards.register_reward('graded', graded)\n"
        "rewards.register_reward('heavy', 'heavy_impl:score')\n"  # imported when first resolved
    )
    (tmp_path / "heavy_impl.py").write_text("raise RuntimeError('needs a GPU library')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["rewards", "list", "--import", "my_graders"]) == 0
    lines = capsys.readouterr().out.splitlines()
    described = {line.split()[0]: line.split(None, 1)[1] for line in lines if line.startswith("  ") and line[2] != " "}
    assert described["arithmetic"] == "gives correct, format (weighs 0); kwargs: answer_key='answer'; pointwise"
    assert described["length"] == "gives length_penalty; kwargs: max_tokens, cache_tokens, scale=1.0; pointwise"
    assert described["arithmetic_steps"] == "gives step_correct; kwargs: none; process reward; pointwise"
    assert described["reward_model"].startswith("components not declared (named once it scores); kwargs: path=''")
    assert described["graded"] == "gives correct, style (weighs 0.5); kwargs: strict=True"
    # one registration that cannot be imported is said, and the rest are listed
    assert described["heavy"] == "cannot be imported: RuntimeError: needs a GPU library"
    assert "registered (my_graders)" in lines[lines.index(next(x for x in lines if x.startswith("  graded "))) + 1]
