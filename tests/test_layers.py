"""The import graph of rlfabric/, envs/ and actors/: no cycles, and lower layers never import upper ones.

Every ``import`` and ``from ... import`` of an rlfabric module counts, at the top of a file or inside a function
(a function-level import is still a dependency; it only hides a cycle until the function runs). Layers, bottom to
top, as docs/architecture.md draws them; a module with no layer here fails ``test_every_module_has_a_layer``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Source folders and the package names they install as (pyproject's package-dir).
SOURCES = {"rlfabric": ROOT / "rlfabric", "rlfabric.envs": ROOT / "envs", "rlfabric.actors": ROOT / "actors"}

# Bottom to top. A module takes the layer of its own name or, failing that, of its nearest listed package
# ("rlfabric.rewards.builtin" -> "rlfabric.rewards"); the bare package "rlfabric" matches only itself.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "config, registries, data types",
        (
            "rlfabric.config_aliases",  # TRL and CleanRL names, for the unknown-key error
            "rlfabric.config_base",
            "rlfabric.ppo_config",
            "rlfabric.grpo_config",
            "rlfabric.reward_config",  # the rewards and reward_model sections of a GRPO config
            "rlfabric.config",
            "rlfabric.registry",
            "rlfabric.rewards.registry",
            "rlfabric.objectives",  # the GRPO family's part names; functions resolved by path where they run
            "rlfabric.compact",  # named numbers as float32 buffers: what the driver receives every step
            "rlfabric.tasks",
            "rlfabric.data",
            "rlfabric.trajectory",
            "rlfabric.normalization",
            "rlfabric.reward_shaping",
            "rlfabric.shipping",
            "rlfabric.multiagent.config",  # the multi_agent section of a PPO config
            "rlfabric.allocator",  # the compute actors' malloc settings
        ),
    ),
    (
        "algorithms, models, engines, envs, rewards",
        (
            "rlfabric.algorithms",
            "rlfabric.models",
            "rlfabric.engines",
            "rlfabric.envs",
            "rlfabric.rewards",
            "rlfabric.rewards.verl_compat",  # verl's compute_score functions, wrapped into the reward contract
            "rlfabric.vector",
            "rlfabric.text_env",  # the text env contract (multi-turn envs)
            "rlfabric.agent_loop",  # multi-turn episodes of text envs, built token by token
            "rlfabric.episode_rewards",  # reward functions on a text env's episodes: inputs, scores on the turns
            "rlfabric.reward_names",  # the component names a reward config uses, against those its rewards give
            "rlfabric.tools",  # tools with JSON schemas, tool-call parsers, checked calls under a deadline
            "rlfabric.mcp_tools",  # tools served by MCP servers, one client session per episode
            "rlfabric.mcp_server_process",  # one HTTP MCP server process: started, pinged, stopped
            "rlfabric.mcp_stdio_gateway",  # a stdio MCP server behind HTTP: one child process per session
            "rlfabric.tool_env",  # a text env whose agent calls tools before answering
            "rlfabric.agent_trace",  # an outside agent's chat calls as exact token segments
            "rlfabric.openai_endpoint",  # the OpenAI-compatible endpoint in front of a rollout worker's policy
            "rlfabric.agents",  # agent functions run(task, client): registered, played under a deadline
            "rlfabric.agent_rollout",  # a run's agent episodes through one endpoint, their traces as trajectories
            "rlfabric.openenv_env",  # an OpenEnv environment as a text env, through its host actor
            "rlfabric.policies",  # the policy interface, scripted and neural-net policies, batching episodes' calls
            "rlfabric.multiagent",  # games: per-agent spaces, env copies stepped per agent, self-play pool, baselines
        ),
    ),
    # The pools start, supervise and replace actors of a role; the driver and actors that call other actors (a
    # rollout worker scoring on its reward services) both use them.
    (
        "actors and their pools",
        (
            "rlfabric.actors",
            "rlfabric.runner_pool",
            "rlfabric.actor_slots",
            "rlfabric.reward_pool",
            "rlfabric.policies.served",  # the LLM policy: calls generator actors
            "rlfabric.policies.game_llm",  # a language model playing an agent of a game, through generator actors
            "rlfabric.game_llm_servers",  # the generators of a game's language-model policies, supervised
            "rlfabric.judge",  # the LLM-judge reward: calls its own generator actors
        ),
    ),
    (
        "driver, CLI",
        (
            "rlfabric",  # the package's face: re-exports config and registry, and the driver on demand
            "rlfabric.placement",  # whether a run's actors fit the cluster, checked by the drivers before setup
            "rlfabric.ppo_placement",  # what a PPO run's actors ask Ray for, and their reservations
            "rlfabric.ray_connect",  # the cluster a run joins (its token sent) or the local Ray instance it starts
            "rlfabric.driver",
            "rlfabric.game_driver",  # PPO on multi-agent games: a learner per trainable policy, self-play
            "rlfabric.llm_driver",
            "rlfabric.llm_setup",  # what a GRPO run does once before its first step: model, data, Ray, actors
            "rlfabric.llm_run_state",  # a GRPO run's checkpoint state, counters, KL reference entry, resume point
            "rlfabric.grpo_report",  # a GRPO step's metrics row, an evaluation's row, the run's summary
            "rlfabric.llm_resources",  # CPUs, torch threads, OpenMP wait policy, setup deadline
            "rlfabric.llm_actors",  # starting the run's actors from its config, and stopping them
            "rlfabric.likelihood_scorers",  # the likelihood scorer of a run: started, replaced, checked
            "rlfabric.llm_text_env",  # a run on a text env: its checks before actors start
            "rlfabric.llm_verifiers",  # a run on a verifiers environment: its host actor, rows and agent
            "rlfabric.llm_openenv",  # a run on an OpenEnv server: its host actor and text env
            "rlfabric.llm_episode_sources",  # where a run's episodes come from: text env, agent, verifiers, OpenEnv
            "rlfabric.llm_sft",  # the supervised warm-up's batches
            "rlfabric.reward_model_training",  # a Bradley-Terry reward model from preference pairs
            "rlfabric.judge_training",  # a generative judge from preference pairs, on the judge service's prompts
            "rlfabric.reward_model_stage",  # train-rm, and a run's first stage: its reward model or judge
            "rlfabric.eval_selectors",  # rlfabric eval's selectors: parsed from --selector, checked before actors
            "rlfabric.evaluation",  # rlfabric eval: best-of-N with any reward as the selector, reward by length
            "rlfabric.eval_report",  # the eval's table and plots
            "rlfabric.ppo_eval",  # rlfabric eval on a PPO run: episodes with a checkpoint's policy; load_policy
            "rlfabric.ppo_init",  # a new PPO run from another run's checkpoint: its weights and normalizer statistics
            "rlfabric.rollout_scheduler",  # which prompts go out, which groups come back to train on
            "rlfabric.reward_watch",  # rewards failing on every sample, misspelt or never-given component names
            "rlfabric.weight_publisher",  # learner 0's weights to the generators
            "rlfabric.run",  # the run skeleton: outputs, checkpoints, resume, progress, plots, Ctrl-C
            "rlfabric.cli_support",  # what the subcommands share: user modules, default run directories
            "rlfabric.submit",  # rlfabric submit: a run as a Ray job on a running cluster
            "rlfabric.cli_inspect",  # rlfabric envs and tools: list and check envs and MCP tool servers
            "rlfabric.cli",
        ),
    ),
]


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    where: str  # path:line of the import statement

    def __str__(self) -> str:
        return f"{self.where}: {self.source} imports {self.target}"


def find_modules(sources: dict[str, Path] = SOURCES) -> dict[str, Path]:
    """Module name -> file, for every .py file under the source folders."""
    modules = {}
    for package, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` itself when it is one of ``modules``, else its nearest enclosing module (an attribute's owner)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(name: str, path: Path, source: str, modules: dict[str, Path]) -> list[Edge]:
    """The rlfabric modules ``source`` (module ``name`` at ``path``) imports, wherever the import statement is."""
    is_package = path.name == "__init__.py"
    edges = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            # "from pkg import mod" imports the module pkg.mod; "from mod import name" imports mod
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{getattr(node, 'lineno', 0)}"
        for target in targets:
            if target != "rlfabric" and not target.startswith("rlfabric."):
                continue
            known = _known(target, modules)
            if known is not None and known != name and Edge(name, known, where) not in edges:
                edges.append(Edge(name, known, where))
    return edges


def import_graph(modules: dict[str, Path]) -> list[Edge]:
    return [edge for name, path in modules.items() for edge in imports_of(name, path, path.read_text(), modules)]


def layer_of(name: str) -> int | None:
    candidate = name
    while candidate:
        if candidate == "rlfabric" and name != "rlfabric":
            return None  # the package's face is not a catch-all
        for index, (_, members) in enumerate(LAYERS):
            if candidate in members:
                return index
        candidate = candidate.rpartition(".")[0]
    return None


def find_cycle(edges: list[Edge]) -> list[Edge] | None:
    """One import cycle as its edges (a -> b -> ... -> a), or None."""
    out: dict[str, list[Edge]] = {}
    for edge in edges:
        out.setdefault(edge.source, []).append(edge)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[Edge] = []

    def visit(node: str) -> list[Edge] | None:
        state[node] = 1
        for edge in out.get(node, []):
            if state.get(edge.target) == 1:
                start = next((i for i, e in enumerate(path) if e.source == edge.target), len(path))
                return [*path[start:], edge]
            if edge.target not in state:
                path.append(edge)
                found = visit(edge.target)
                if found:
                    return found
                path.pop()
        state[node] = 2
        return None

    for node in sorted(out):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


# -- the tests --------------------------------------------------------------------------------------------------


def test_the_checker_sees_function_level_and_from_package_imports(tmp_path):
    modules = {name: tmp_path / f"{name}.py" for name in ("rlfabric.low", "rlfabric.high", "rlfabric.pkg.mod")}
    source = "import os\nfrom rlfabric.pkg import mod\n\ndef f():\n    from rlfabric.high import thing\n"
    edges = imports_of("rlfabric.low", modules["rlfabric.low"], source, modules)
    assert [(e.source, e.target) for e in edges] == [
        ("rlfabric.low", "rlfabric.pkg.mod"),
        ("rlfabric.low", "rlfabric.high"),
    ]
    assert edges[1].where.endswith("rlfabric.low.py:5")  # the function-level one, with its line
    assert find_cycle(edges) is None
    cycle = find_cycle([*edges, Edge("rlfabric.high", "rlfabric.low", "x.py:1")])
    assert cycle is not None and {e.source for e in cycle} == {"rlfabric.low", "rlfabric.high"}
    assert all(a.target == b.source for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True))  # a closed loop


def test_every_module_has_a_layer():
    modules = find_modules()
    assert {"rlfabric.config", "rlfabric.driver", "rlfabric.envs.text_tasks", "rlfabric.actors.learner"} <= set(modules)
    missing = [f"{name} ({path.relative_to(ROOT)})" for name, path in modules.items() if layer_of(name) is None]
    assert not missing, "modules with no layer in tests/test_layers.py's LAYERS: " + ", ".join(missing)


def find_cycles(edges: list[Edge], limit: int = 20) -> list[list[Edge]]:
    """Import cycles, each as its edges; after each one found, its closing edge is set aside to look for more."""
    remaining, cycles = list(edges), []
    while len(cycles) < limit and (cycle := find_cycle(remaining)) is not None:
        cycles.append(cycle)
        closing = cycle[-1]
        remaining = [e for e in remaining if (e.source, e.target) != (closing.source, closing.target)]
    return cycles


def test_no_import_cycles():
    cycles = find_cycles(import_graph(find_modules()))
    assert not cycles, "import cycles:\n" + "\n".join("  " + "\n    -> ".join(map(str, c)) for c in cycles)


def test_lower_layers_never_import_upper_ones():
    upward = []
    for edge in import_graph(find_modules()):
        low, high = layer_of(edge.source), layer_of(edge.target)
        if low is not None and high is not None and high > low:
            upward.append(f"{edge} (layer '{LAYERS[low][0]}' imports layer '{LAYERS[high][0]}')")
    assert not upward, "imports from a lower layer into a higher one:\n  " + "\n  ".join(upward)


def test_every_package_is_installed():
    """pyproject lists its packages one by one (envs/ and actors/ install under rlfabric.): a package missing
    there works in an editable checkout and is absent from a wheel."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {
        prefix + ("." + ".".join(init.parent.relative_to(root).parts) if init.parent != root else "")
        for prefix, root in SOURCES.items()
        for init in root.rglob("__init__.py")
    }
    assert packages <= set(setuptools["packages"]), sorted(packages - set(setuptools["packages"]))
    for package in packages:
        assert package in setuptools["package-dir"], package
