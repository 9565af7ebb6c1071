"""``rlfabric envs``, ``rlfabric tools`` and ``rlfabric rewards``: list and check environments (Gymnasium,
PettingZoo, text envs) and MCP tool servers, each check one line of verdict before anything trains, and list reward
functions with the components they give."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from rlfabric.cli_support import import_user_modules
from rlfabric.config import ConfigError

_ANSI_COLOR = re.compile(r"\x1b\[[0-9;]*m")  # warnings print their own colours: not in a one-line report


def cmd_envs_list(args: argparse.Namespace) -> int:
    import gymnasium as gym

    from rlfabric import registry

    import_user_modules(args.import_modules)
    print("rlfabric environments (registered and from the 'rlfabric.envs' entry-point group):")
    for name, source in sorted(registry.list_envs().items()):
        print(f"  {name:<32} {source}")
    ids = sorted(gym.registry)
    if args.all:
        print(f"Gymnasium environments ({len(ids)}), use as gym:<id>:")
        for env_id in ids:
            print(f"  gym:{env_id}")
    else:
        print(f"Gymnasium environments: {len(ids)} ids usable as gym:<id> (list them with --all), e.g.")
        for env_id in ("CartPole-v1", "Pendulum-v1", "HalfCheetah-v5", "Hopper-v5", "Ant-v5"):
            if env_id in gym.registry:
                print(f"  gym:{env_id}")
    print("Any importable callable returning a gymnasium.Env works as package.module:factory.")
    print(
        "PettingZoo envs (multi_agent configs): pettingzoo:<family>.<name> (e.g. pettingzoo:classic.tictactoe_v3), "
        "package:module for a module with parallel_env/env (e.g. mpe2:simple_spread_v3), or a factory returning one."
    )
    from rlfabric.envs.task_library import TASK_SERVERS

    print(
        "MCP task servers (env.id: rlfabric/McpTasks-v0, data.train: task:mcp?servers=NAME,...; "
        "check one: rlfabric tools check NAME):"
    )
    for name, spec in TASK_SERVERS.items():
        print(f"  {name:<10} {spec.min_calls}-{spec.max_calls} calls  {spec.description}")
    return 0


def cmd_rewards_list(args: argparse.Namespace) -> int:
    """Every reward function a config can name, with what it gives and takes and where it comes from."""
    from rlfabric import rewards

    import_user_modules(args.import_modules)
    print(
        "rlfabric reward functions (rewards.functions: [{name: NAME, kwargs: {...}}]; a component weighs 1 unless "
        "rewards.weights or its function says otherwise):"
    )
    for name, source in sorted(rewards.list_rewards().items()):
        try:
            described = rewards.describe_reward(name)
        except Exception as exc:  # noqa: BLE001 - a registration whose module cannot be imported: say so, go on
            described = f"cannot be imported: {_one_line(exc)}"
        print(f"  {name:<20} {described}\n  {'':<20} {source}")
    print("Any importable function works as package.module:function (a module in the current directory too).")
    return 0


def cmd_envs_check(args: argparse.Namespace) -> int:
    import warnings

    from gymnasium.utils.env_checker import check_env

    from rlfabric import registry
    from rlfabric.models.numpy_policy import check_ppo_spaces

    import_user_modules(args.import_modules)
    from rlfabric.envs.task_library import TASK_SERVERS

    if args.name in TASK_SERVERS:  # an MCP task server: its tasks against its verifier
        return cmd_tools_check(argparse.Namespace(server=args.name, tasks=4, seed=0, url=None))
    kwargs = _json_object("--kwargs", args.kwargs, '{"size": 7}')
    factory = registry.resolve(args.name, field="envs check NAME")
    try:
        env = factory(**kwargs)
    except Exception as exc:  # the factory's own error is the report
        print(f"FAIL {args.name}: building the env raised {exc.__class__.__name__}: {exc}")
        return 1
    if registry.is_pettingzoo_env(env):
        return _check_pettingzoo_env(args.name, lambda: factory(**kwargs), env, args.cycles)
    if not hasattr(env, "unwrapped") and callable(getattr(env, "step", None)):
        return _check_text_env(args, env)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            check_env(env.unwrapped, skip_render_check=True)
            # what Gymnasium's checker only warns about (an observation off its space) fails on the runners: the
            # driver's pre-start check, one reset and one step of the env as the runners build it
            problem = registry.gym_api_problem(env, seed=0)
        except Exception as exc:  # the checker's assertion names the problem
            print(f"FAIL {args.name}: {exc.__class__.__name__}: {exc}")
            return 1
        finally:
            env.close()
    if problem is not None:
        print(f"FAIL {args.name}: {problem}")
        return 1
    for w in caught:
        print("  warning:", _ANSI_COLOR.sub("", str(w.message)))
    try:  # Gymnasium's checker passes spaces PPO's policy cannot use (Dict, Text, MultiDiscrete)
        check_ppo_spaces(env.observation_space, env.action_space)
    except ValueError as exc:
        print(f"FAIL {args.name}: PPO cannot train it: {exc}")
        return 1
    print(f"OK {args.name}: observation {env.observation_space}, action {env.action_space}")
    return 0


def _check_pettingzoo_env(name: str, make: Any, env: Any, cycles: int) -> int:
    """``envs check`` on a PettingZoo env: PettingZoo's API and seed tests (``cycles`` cycles each, on fresh envs
    from ``make``), then what rlfabric does with each agent's spaces (``rlfabric.multiagent.spaces``) and whether
    ``env`` has a global state for a centralized critic. Exit 1 when a test fails or an agent's spaces are refused."""
    import warnings

    from pettingzoo import ParallelEnv

    with warnings.catch_warnings():  # pettingzoo.test imports an env module PettingZoo itself deprecates
        warnings.simplefilter("ignore", DeprecationWarning)
        from pettingzoo.test import api_test, parallel_api_test, parallel_seed_test, seed_test

    parallel = isinstance(env, ParallelEnv)
    title = env.metadata.get("name") or type(env.unwrapped).__name__
    print(f"{name}: PettingZoo {'Parallel' if parallel else 'AEC'} env {title}, {len(env.possible_agents)} agents")
    if parallel:
        tests = {
            "parallel_api_test": lambda: parallel_api_test(make(), num_cycles=cycles),
            "parallel_seed_test": lambda: parallel_seed_test(make, num_cycles=cycles),
        }
    else:
        tests = {
            "api_test": lambda: api_test(make(), num_cycles=cycles),
            "seed_test": lambda: seed_test(make, num_cycles=cycles),
        }
    failures = []
    for test, run in tests.items():
        error, messages = _run_quietly(run)
        print(f"{'PASS' if error is None else 'FAIL'} {test} ({cycles} cycles){'' if error is None else ': ' + error}")
        for message in messages:
            print("  warning:", message)
        if error is not None:
            failures.append(test)
    try:
        failures += _print_agent_spaces(env)
        print(_global_state_line(env))
    finally:
        env.close()
    print(f"FAIL {name}: {', '.join(failures)}" if failures else f"OK {name}")
    return 1 if failures else 0


def _run_quietly(run: Any) -> tuple[str | None, list[str]]:
    """Run a PettingZoo test with its prints silenced: (None or the failure in one line, its distinct warnings)."""
    import contextlib
    import io
    import warnings

    error = None
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("always")
        try:
            run()
        except Exception as exc:  # the test's assertion is the report
            error = _one_line(exc)
    return error, list(dict.fromkeys(_ANSI_COLOR.sub("", str(w.message)).strip() for w in caught))


def _one_line(exc: BaseException) -> str:
    """``Type: first line of the message``; an assertion without a message (or with only pytest's rewritten
    ``assert ...``) is named by the line that failed."""
    import traceback

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    bare = not text or (isinstance(exc, AssertionError) and text.startswith("assert "))
    if bare and exc.__traceback__ is not None:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        text = f"at {Path(frame.filename).name}:{frame.lineno}: {frame.line}"
    return f"{exc.__class__.__name__}: {text}"


def _print_agent_spaces(env: Any) -> list[str]:
    """One block per group of agents with identical spaces: the spaces, then what rlfabric does with them (or why
    it cannot). Returns a failure label per refused group."""
    from rlfabric.multiagent.spaces import UnsupportedSpaceError, agent_spaces

    groups: list[tuple[Any, Any, list[str]]] = []
    for agent in env.possible_agents:
        obs, act = env.observation_space(agent), env.action_space(agent)
        group = next((g for g in groups if g[0] == obs and g[1] == act), None)
        if group is None:
            groups.append((obs, act, [agent]))
        else:
            group[2].append(agent)
    refused = []
    for obs, act, agents in groups:
        names = ", ".join(map(str, agents)) if len(agents) <= 4 else f"{agents[0]} ... {agents[-1]} ({len(agents)})"
        print(f"{'agents' if len(agents) > 1 else 'agent'} {names}: observation {obs}, action {act}")
        try:
            notes = agent_spaces(obs, act, str(agents[0])).notes
        except UnsupportedSpaceError as exc:
            print(f"  refused: {exc}")
            refused.append(f"the spaces of {names} are refused")
            continue
        for note in notes:
            print(f"  {note}")
    return refused


def _global_state_line(env: Any) -> str:
    """Whether the env has a global ``state()`` (a centralized critic's input) and its size, after a reset."""
    try:
        env.reset(seed=0)
        state = env.state()
    except NotImplementedError:
        return "global state: none (state() is not implemented)"
    except Exception as exc:  # a broken state() is reported, not fatal: nothing else needs it
        return f"global state: none (state() raised {_one_line(exc)})"
    import numpy as np

    try:
        space = f" from state_space {env.state_space}"
    except Exception:  # no state_space attribute (wrappers raise their own errors for it)
        space = ""
    return f"global state: state() gives {int(np.asarray(state).size)} values{space} (a centralized critic's input)"


def not_a_server(server: str, task_servers: list[str]) -> str | None:
    """Why ``server`` (a ``tools list`` argument that is no task server's name) names nothing: a single word that
    is no command on the PATH, with the task server it resembles; None when it may name a server."""
    import difflib
    import shutil

    if " " in server.strip() or "://" in server or shutil.which(server) is not None:
        return None
    close = difflib.get_close_matches(server, task_servers, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"{server!r} is not a task server{hint} nor a command on the PATH: give a task server's name "
        f"({', '.join(task_servers)}), a server's command line, or an http(s) URL"
    )


def cmd_tools_list(args: argparse.Namespace) -> int:
    """List an MCP server's tools with their arguments: one started from its command line (then stopped), or
    one running at a URL."""
    import asyncio

    from rlfabric.envs.task_library import TASK_SERVERS
    from rlfabric.mcp_tools import McpSession, McpStartError

    server = TASK_SERVERS[args.server].command if args.server in TASK_SERVERS else args.server
    unknown = not_a_server(server, list(TASK_SERVERS))
    if unknown:
        print(f"rlfabric: tools list: {unknown}", file=sys.stderr)
        return 1

    async def listed() -> list:
        session = await McpSession.open(server, args.timeout)
        try:
            return session.tools()
        finally:
            await session.close()

    try:
        tools = asyncio.run(listed())
    except (McpStartError, ValueError) as exc:
        print(f"rlfabric: tools list: {exc}", file=sys.stderr)
        return 1
    print(f"{len(tools)} tools from MCP server {args.server!r} (? marks an optional argument):")
    for tool in tools:
        required = set(tool.parameters.get("required", []))
        arguments = ", ".join(
            f"{name}{'' if name in required else '?'}: {schema.get('type', 'any')}"
            for name, schema in tool.parameters.get("properties", {}).items()
        )
        print(f"  {tool.name}({arguments})  {tool.description}")
    return 0


def cmd_tools_check(args: argparse.Namespace) -> int:
    """Run a shipped task server's tasks, each difficulty, against its verifier with the scripted solver."""
    import asyncio

    from rlfabric.envs.mcp_tasks import check_task_server
    from rlfabric.envs.task_library import TASK_SERVERS

    if args.server not in TASK_SERVERS:
        print(
            f"rlfabric: tools check: {args.server!r} is not a task server: {', '.join(TASK_SERVERS)}", file=sys.stderr
        )
        return 1
    print(f"{args.server}: {args.tasks} tasks per difficulty, played by the scripted solver over MCP, verified:")
    try:
        report = asyncio.run(check_task_server(args.server, args.tasks, args.seed, args.url))
    except Exception as exc:  # a server that does not start, a generator that fails: the report
        print(f"FAIL {args.server}: {type(exc).__name__}: {exc}")
        return 1
    for level in report:
        line = f"  {level['calls']} calls: {level['solved']}/{level['tasks']} solved"
        print(line + (f"; first failure: {level['failure']}" if level["failure"] else ""))
    ok = all(level["solved"] == level["tasks"] for level in report)
    print(f"{'OK' if ok else 'FAIL'} {args.server}")
    return 0 if ok else 1


def _json_object(option: str, text: str | None, example: str) -> dict[str, Any]:
    """An option's JSON object ({} when not given), or one ConfigError naming the option."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(f"{option} {text!r} is not valid: expected a JSON object, e.g. '{example}'")
    return value


def _check_text_env(args: argparse.Namespace, env: Any) -> int:
    """``envs check`` on a text env: one turn on ``--task``, sending ``--action``."""
    from rlfabric.text_env import check_text_env

    task = _json_object("--task", args.task, '{"secret": 3}')
    try:
        report = check_text_env(env, task, args.action)
    except Exception as exc:  # the env's own error, or the contract check's, is the report
        # an env whose reset reads its task row fails on the default {}: say how to give it one
        hint = "" if args.task else " (reset got the task {}: give it one of its task rows with --task '{...}')"
        print(f"FAIL {args.name} (text env): {exc.__class__.__name__}: {exc}{hint}")
        return 1
    print(f"OK {args.name} (text env): {report}")
    return 0
