"""The ``rlfabric`` command: train (and train-rm: a reward model), resume, evaluate (best-of-N), submit as a Ray
job; ``envs``, ``tools`` and ``rewards`` (list and check environments, MCP tool servers and reward functions) live
in ``rlfabric.cli_inspect``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray.exceptions import RayError

from rlfabric.actor_slots import RunAbortedError, error_summary
from rlfabric.cli_inspect import cmd_envs_check, cmd_envs_list, cmd_rewards_list, cmd_tools_check, cmd_tools_list
from rlfabric.cli_support import (
    IMPORT_HELP,
    RESUME_COMMAND_ENV,
    default_run_dir,
    import_user_modules,
    record_imports,
    saved_algo,
)
from rlfabric.config import ConfigError, load_config
from rlfabric.run.log import CONFIG_FILE
from rlfabric.run.resume import trained_there
from rlfabric.submit import add_submit_parser, cmd_submit


def _print_summary(summary: dict) -> None:
    def fmt(v: object) -> str:
        return f"{v:,.2f}" if isinstance(v, float) else str(v)

    print("\n== rlfabric run summary ==")
    for key in (
        "env",
        "iterations",
        "env_steps",
        "episodes",
        "episode_return_mean",
        "eval_return_mean",
        "time_total_s",
        "env_steps_per_s",
        "dropped_fragments",
        "lost_fragments",
        "runner_restarts",
    ):
        if key == "eval_return_mean" and summary.get(key) is None:
            continue  # no greedy evaluation episodes (training.eval_episodes: 0)
        print(f"  {key:<20} {fmt(summary.get(key))}")
    for line in _game_summary_lines(summary):
        print(f"  {line}")
    print(f"  {'run dir':<20} {summary['run_dir']}")
    if summary.get("plot"):
        print(f"  {'learning curve':<20} {summary['plot']}")
    if summary.get("self_play_plot"):
        print(f"  {'self-play curve':<20} {summary['self_play_plot']}")


def _game_summary_lines(summary: dict) -> list[str]:
    """A game run's own figures: each policy's mean return, the final evaluation against each baseline, Elo."""
    lines = []
    if summary.get("return_mean_by_policy"):
        by_policy = ", ".join(f"{p} {r:.2f}" for p, r in summary["return_mean_by_policy"].items())
        lines.append(f"{'return by policy':<20} {by_policy}")
    for key in summary:
        if key.startswith("eval_win_rate_vs_"):
            baseline = key.removeprefix("eval_win_rate_vs_")
            rates = [summary.get(f"eval_{kind}_rate_vs_{baseline}") for kind in ("win", "draw", "loss")]
            won, drew, lost = (f"{100 * r:.1f}%" if r is not None else "?" for r in rates)
            games = summary.get("eval_games", "?")
            lines.append(f"{'vs ' + baseline:<20} win {won}, draw {drew}, loss {lost} ({games} games)")
    if summary.get("learner_elo") is not None:
        lines.append(f"{'learner Elo':<20} {summary['learner_elo']:.0f} (pool of {summary.get('opponent_pool_size')})")
    return lines


def _print_llm_summary(summary: dict) -> None:
    def pct(v: object) -> str:
        return "n/a" if v is None else f"{100 * float(v):.1f}%"

    print("\n== rlfabric run summary ==")
    print(f"  {'task':<26} {summary['task']}")
    print(f"  {'GRPO steps':<26} {summary['steps']}")

    def unscored(label: str) -> str:  # samples a reward failed: not counted as wrong, said beside the accuracy
        count = summary.get(f"eval_failed_{label}")
        return f" ({count} unscored)" if count else ""

    print(f"  {'held-out accuracy':<26} before {pct(summary['eval_accuracy_initial'])}{unscored('initial')}", end="")
    if summary.get("eval_accuracy_after_sft") is not None:
        print(f" | after SFT {pct(summary['eval_accuracy_after_sft'])}{unscored('after_sft')}", end="")
    print(f" | after GRPO {pct(summary['eval_accuracy_final'])}{unscored('final')}")
    print(f"  {'time':<26} {summary['time_total_s']:.0f}s ({summary['samples_per_s']:.1f} samples/s)")
    print(f"  {'failed / stale samples':<26} {summary['failed_samples']} / {summary['stale_samples']}")
    print(f"  {'final model (HF format)':<26} {summary['final_model']}")
    print(f"  {'run dir':<26} {summary['run_dir']}")
    if summary.get("plot"):
        print(f"  {'learning curve':<26} {summary['plot']}")
    if summary.get("sample_completions"):
        print("  sample completions (held-out, greedy):")
        for s in summary["sample_completions"]:
            mark = "ok " if s["components"].get("correct") else "err" if s["error"] else "-- "
            answer = s["metadata"].get("answer")  # a text env's task may have none: its env judges the episode
            expected = "" if answer is None else f"  (expected {answer!r})"
            print(f"    [{mark}] {s['prompt']!r} -> {s['completion']!r}{expected}")


def cmd_train_llm(args: argparse.Namespace, cfg: object | None, imports: list[str]) -> int:
    """A GRPO run: a new one from ``cfg``, or (``--resume DIR``, cfg None) the run in DIR continued; ``imports``:
    the user modules it runs with, recorded in its folder."""
    from rlfabric.llm_driver import GRPOTrainer
    from rlfabric.llm_run_state import latest_checkpoint

    if args.resume:
        trainer = GRPOTrainer.from_run_dir(args.resume, args.overrides, quiet=args.quiet)
        where = f"resuming from {trainer.resume_from.name}"  # type: ignore[union-attr]
    else:
        run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
        trainer = GRPOTrainer(cfg, run_dir, quiet=args.quiet)  # type: ignore[arg-type]
        where = "new run"
    print(f"rlfabric: GRPO on {trainer.cfg.data.train} -> {trainer.run_dir} ({where})", file=sys.stderr)

    summary = train_or_exit_code(trainer, latest_checkpoint, imports)
    if isinstance(summary, int):
        return summary
    summary["run_dir"] = str(trainer.run_dir)
    _print_llm_summary(summary)
    return 0


def train_or_exit_code(
    trainer: Any, newest_checkpoint: Callable[[Path], Path | None], imports: list[str] | None = None
) -> dict[str, Any] | int:
    """The trainer's summary, or the exit code of a run that stopped (1: an actor died for good or retries ran
    out; 130: Ctrl-C) after one line saying so and whether a checkpoint is left to resume from. The user modules
    it runs with (``imports``) are recorded in its folder once setup has made it, so that ``--resume`` and
    ``eval --run-dir`` import them again."""

    def what_is_left() -> str:
        if newest_checkpoint(trainer.run_dir) is None:
            if not trained_there(trainer.run_dir):
                return f"nothing was trained; a new run may use --run-dir {trainer.run_dir} again"
            every = getattr(trainer.cfg.training, "checkpoint_every", None)
            if not every:
                return "no checkpoint was saved (training.checkpoint_every = 0 saves one only at the end)"
            return f"no checkpoint was saved yet (the first comes at training.checkpoint_every = {every})"
        resume = os.environ.get(RESUME_COMMAND_ENV) or f"--resume {trainer.run_dir}"  # in a job: its submit's
        return f"the latest checkpoint is kept (continue with {resume})"

    try:
        trainer.setup()  # the run's folder and actors (a config error found on the way leaves no new folder)
        if imports is not None:
            record_imports(trainer.run_dir, imports)
        return trainer.train()
    except (RayError, RunAbortedError) as exc:
        reason = error_summary(exc) if isinstance(exc, RayError) else str(exc)
        print(f"rlfabric: run stopped: {reason}; {what_is_left()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nrlfabric: interrupted; {what_is_left()}", file=sys.stderr)
        return 130
    finally:
        trainer.close()


def cmd_train(args: argparse.Namespace) -> int:
    from rlfabric.driver import latest_checkpoint as ppo_latest_checkpoint
    from rlfabric.game_driver import ppo_trainer, ppo_trainer_from_run_dir

    # with --resume, the modules the run was started with too (recorded in its folder)
    imports = import_user_modules(args.import_modules, Path(args.resume) if args.resume else None)
    if not args.resume:
        cfg = load_config(args.config, args.overrides)
        if cfg.algo == "grpo":
            return cmd_train_llm(args, cfg, imports)
    if args.resume:
        if args.config:
            raise ConfigError("--resume DIR uses the run's saved config; pass only key=value overrides, not a file")
        if args.run_dir:
            raise ConfigError("--resume DIR continues the run in DIR; --run-dir is for new runs, drop it")
        if saved_algo(Path(args.resume)) == "grpo":
            return cmd_train_llm(args, None, imports)
        trainer = ppo_trainer_from_run_dir(args.resume, args.overrides, quiet=args.quiet)
    else:
        run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
        trainer = ppo_trainer(cfg, run_dir, quiet=args.quiet)
    where = ""
    if args.resume:
        where = f" (resuming from {ppo_latest_checkpoint(trainer.run_dir).name})"  # type: ignore[union-attr]
    print(f"rlfabric: training {trainer.cfg.env.id} -> {trainer.run_dir}{where}", file=sys.stderr)
    summary = train_or_exit_code(trainer, ppo_latest_checkpoint, imports)
    if isinstance(summary, int):
        return summary
    summary["run_dir"] = str(trainer.run_dir)
    summary["plot"] = str(summary["plot"]) if summary.get("plot") else None
    _print_summary(summary)
    return 0


def cmd_train_rm(args: argparse.Namespace) -> int:
    from rlfabric.reward_model_stage import (
        REWARD_MODEL_DIR,
        RUN_MODEL_SPECS,
        check_reward_model_run,
        train_reward_model_run,
    )

    import_user_modules(args.import_modules)
    cfg = load_config(args.config, args.overrides)
    if cfg.algo != "grpo":
        raise ConfigError(f"algo = {cfg.algo!r}: train-rm reads the reward_model section of a GRPO config")
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / f"reward_model-{time.strftime('%Y%m%d-%H%M%S')}"
    check_reward_model_run(cfg, run_dir)  # before the line that names what it trains on
    what = "a judge" if cfg.reward_model.kind == "judge" else "a reward model"
    print(f"rlfabric: training {what} on {cfg.reward_model.pairs} -> {run_dir}", file=sys.stderr)
    summary = train_reward_model_run(cfg, run_dir, quiet=args.quiet)
    print("\n== rlfabric reward model ==")
    for key, value in summary.items():
        print(f"  {key:<34} {f'{value:.3f}' if isinstance(value, float) else value}")
    name, key = RUN_MODEL_SPECS[cfg.reward_model.kind]
    print(f"  use it: rewards.functions: [{{name: {name}, kwargs: {{{key}: {run_dir / REWARD_MODEL_DIR}}}}}]")
    return 0


def ppo_checkpoint_asked(args: argparse.Namespace) -> bool:
    """Whether ``rlfabric eval`` names a PPO policy: a checkpoint file (GRPO's are folders), or a run directory
    whose saved config is not GRPO's."""
    if args.checkpoint:
        return Path(args.checkpoint).is_file()
    if args.run_dir:
        run = Path(args.run_dir)
        return (run / CONFIG_FILE).is_file() and saved_algo(run) != "grpo"
    return False


def cmd_eval_ppo(args: argparse.Namespace) -> int:
    """N episodes with a PPO checkpoint's policy on its run's env; the report printed and written
    (``rlfabric.ppo_eval``)."""
    from rlfabric.ppo_eval import checkpoint_file, evaluate, format_report, run_dir_of

    if args.config or args.overrides:
        given = args.config or args.overrides[0]
        raise ConfigError(
            f"{given!r}: eval of a PPO run plays the env its checkpoint was trained on; drop the config and overrides"
        )
    file = checkpoint_file(args.run_dir, args.checkpoint)
    field = f"--run-dir {args.run_dir!r}" if args.run_dir else f"--checkpoint {args.checkpoint!r}"
    import_user_modules(args.import_modules, run_dir_of(file), field)  # the run's env modules (imports.txt)
    report, path = evaluate(
        file, args.episodes, args.seed, deterministic=not args.sample, out=Path(args.out) if args.out else None
    )
    print(format_report(report))
    print(f"  {'report':<16} {path}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """A PPO run: episodes with its checkpoint's policy (``cmd_eval_ppo``). GRPO: best-of-N accuracy per selector
    and reward by response length for a run's newest model, a model folder, or the config's initial model
    (``rlfabric.evaluation``)."""
    from rlfabric.eval_report import format_report
    from rlfabric.eval_selectors import TRAIN_SELECTOR, parse_selector
    from rlfabric.evaluation import BestOfNEval, eval_config, find_policy, parse_n_list

    if args.config and "=" in args.config and not os.path.exists(args.config):  # an override, not a file
        args.overrides, args.config = [args.config, *args.overrides], None
    if ppo_checkpoint_asked(args):
        return cmd_eval_ppo(args)
    n = parse_n_list(args.n)
    selectors = [parse_selector(text) for text in args.selector or [TRAIN_SELECTOR]]
    policy = find_policy(args.run_dir, args.checkpoint)
    # the modules the policy's run was started with too (recorded in its folder), before its rewards are named
    field = f"--run-dir {args.run_dir!r}" if args.run_dir else f"--checkpoint {args.checkpoint!r}"
    import_user_modules(args.import_modules, policy.run_dir, field)
    cfg, config_source = eval_config(args.config, args.overrides, policy)
    if args.out:
        out = Path(args.out)
    elif policy.run_dir is not None:
        out = policy.run_dir / "eval" / (Path(args.checkpoint).name if args.checkpoint else "")
    else:
        out = Path("runs") / f"eval-{time.strftime('%Y%m%d-%H%M%S')}"
    evaluation = BestOfNEval(
        cfg,
        policy,
        out,
        n=n,
        selectors=selectors,
        num_prompts=args.num_prompts,
        samples=args.samples,
        correct=args.correct,
        seed=args.seed,
        config_source=config_source,
        progress=None if not args.quiet else lambda line: None,
    )
    try:
        report = evaluation.run()
    except (RayError, RunAbortedError) as exc:
        reason = error_summary(exc) if isinstance(exc, RayError) else str(exc)
        print(f"rlfabric: eval failed: {reason}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nrlfabric: eval interrupted; nothing was written", file=sys.stderr)
        return 130
    finally:
        evaluation.close()
    if evaluation.earlier_report is not None:
        print(f"rlfabric eval: the earlier report in {out} was moved to {evaluation.earlier_report}", file=sys.stderr)
    print(format_report(report))
    print(f"  {'report':<16} {out / 'eval.json'}")
    for name, path in report["files"].items():
        print(f"  {name:<16} {path}")
    return 0


class _AnyOrderParser(argparse.ArgumentParser):
    """Options and positionals in any order (``train a=1 --import m b=2``): a parser without subcommands parses
    intermixed (``parse_known_intermixed_args``), which a plain parser does not (its ``b=2`` would be unknown)."""

    _intermixing = False

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._subparsers is not None or self._intermixing:  # older Pythons re-enter here from the intermixed parse
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def build_parser() -> argparse.ArgumentParser:
    """The ``rlfabric`` command line; under every subcommand, options and positionals may come in any order."""
    parser = _AnyOrderParser(prog="rlfabric", description="Distributed RL on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="train (no config: GRPO post-training of a small LM on arithmetic, on a local Ray)",
        description="Train from a YAML config (first of the positionals) and key=value overrides; options may come "
        "anywhere among them.",
    )
    train.add_argument("config", nargs="?", help="YAML config file (defaults apply to anything missing)")
    train.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. grpo.lr=1e-3 training.total_steps=50 (PPO: ppo.lr=3e-4)"
    )
    train.add_argument("--run-dir", help="where outputs go (default: runs/<env or task>-<time>)")
    train.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint")
    train.add_argument("--quiet", action="store_true", help="no progress line")
    train.add_argument(
        "--import",
        dest="import_modules",
        action="append",
        help=IMPORT_HELP + " (one that calls register_env or register_reward)",
    )
    train.set_defaults(func=cmd_train)

    add_submit_parser(sub, cmd_submit)

    train_rm = sub.add_parser(
        "train-rm", help="train a reward model from preference pairs (the reward_model section of a GRPO config)"
    )
    train_rm.add_argument("config", nargs="?", help="YAML config file (its reward_model section)")
    train_rm.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reward_model.steps=300")
    train_rm.add_argument("--run-dir", help="where outputs go (default: runs/reward_model-<time>)")
    train_rm.add_argument("--quiet", action="store_true", help="no progress line")
    train_rm.add_argument("--import", dest="import_modules", action="append", help=IMPORT_HELP)
    train_rm.set_defaults(func=cmd_train_rm)

    evaluate = sub.add_parser(
        "eval",
        help="a PPO run: N episodes with a checkpoint's policy (returns and lengths); GRPO: best-of-N accuracy with "
        "reward services as selectors, and reward vs response length, for a trained policy (a run's newest model, "
        "a model folder, or the config's initial model)",
    )
    evaluate.add_argument("config", nargs="?", help="YAML config (default: the run's saved config, else the defaults)")
    evaluate.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sampling.temperature=0.8")
    where = evaluate.add_mutually_exclusive_group()
    where.add_argument(
        "--run-dir",
        help="a run directory: evaluate its newest model (GRPO: final_model/ or checkpoint; PPO: checkpoint)",
    )
    where.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="a model folder to evaluate (GRPO, e.g. a run's checkpoint), or a PPO checkpoint file (iter_N.pt)",
    )
    evaluate.add_argument("--episodes", type=int, default=10, help="PPO: episodes to play (default 10)")
    evaluate.add_argument(
        "--sample", action="store_true", help="PPO: sample actions (default: deterministic, the mean or argmax)"
    )
    evaluate.add_argument("--n", default="1,2,4,8,16", help="comma-separated N of best-of-N (default 1,2,4,8,16)")
    evaluate.add_argument(
        "--selector",
        action="append",
        help="a reward that picks the best of N: 'train' (the config's training reward, the default), a reward "
        "name, or YAML '{name: reward_model, kwargs: {path: DIR}, weights: {...}, label: rm}' (a process reward also "
        "takes aggregate: min|mean|last|sum and split: newline|...); repeat for more",
    )
    evaluate.add_argument("--num-prompts", type=int, help="held-out prompts to use (default data.num_eval)")
    evaluate.add_argument("--samples", type=int, help="completions per prompt, M (default: the largest N)")
    evaluate.add_argument("--correct", default="correct", help="verifier component > 0 marks a correct completion")
    evaluate.add_argument(
        "--seed", type=int, help="sampling seed (default training.seed); PPO: episode i resets with seed + i"
    )
    evaluate.add_argument("--out", help="output folder (default RUN_DIR/eval, else runs/eval-<time>)")
    evaluate.add_argument("--quiet", action="store_true", help="no progress lines")
    evaluate.add_argument("--import", dest="import_modules", action="append", help=IMPORT_HELP)
    evaluate.set_defaults(func=cmd_eval)

    envs = sub.add_parser("envs", help="list or check environments").add_subparsers(
        dest="envs_command", required=True, metavar="{list,check}"
    )
    env_list = envs.add_parser("list", help="show registered, entry-point and Gymnasium environments")
    env_list.add_argument("--all", action="store_true", help="list every Gymnasium id")
    env_list.add_argument("--import", dest="import_modules", action="append", help=IMPORT_HELP)
    env_list.set_defaults(func=cmd_envs_list)
    check = envs.add_parser(
        "check",
        help="run Gymnasium's env checker on an env spec, PettingZoo's API tests on a multi-agent one (and say what "
        "rlfabric does with its spaces), or one turn of a text env on --task with --action",
    )
    check.add_argument(
        "name",
        help="a registered name, gym:<id>, pettingzoo:<family>.<name>, entry-point name, package.module:factory "
        "or a PettingZoo package:module",
    )
    check.add_argument("--kwargs", help="JSON object of factory keyword arguments")
    check.add_argument(
        "--cycles", type=int, default=100, help="PettingZoo envs: cycles each API test plays (default 100)"
    )
    check.add_argument("--task", help="text envs: the JSON task row to reset on (default {})")
    check.add_argument("--action", default="", help="text envs: the text of the one step sent (default: empty)")
    check.add_argument("--import", dest="import_modules", action="append", help=IMPORT_HELP)
    check.set_defaults(func=cmd_envs_check)

    reward_commands = sub.add_parser("rewards", help="list reward functions").add_subparsers(
        dest="rewards_command", required=True, metavar="{list}"
    )
    reward_list = reward_commands.add_parser(
        "list", help="show the reward functions a config can name, the components each gives and its kwargs"
    )
    reward_list.add_argument("--import", dest="import_modules", action="append", help=IMPORT_HELP)
    reward_list.set_defaults(func=cmd_rewards_list)

    tools = sub.add_parser("tools", help="MCP tool servers").add_subparsers(
        dest="tools_command", required=True, metavar="{list,check}"
    )
    tool_list = tools.add_parser("list", help="show an MCP server's tools and their arguments")
    tool_list.add_argument(
        "server",
        help="a command line (stdio), e.g. 'python -m rlfabric.envs.notes_server', an HTTP URL, or a task server name",
    )
    tool_list.add_argument("--timeout", type=float, default=30.0, help="seconds to start and answer (default 30)")
    tool_list.set_defaults(func=cmd_tools_list)
    tool_check = tools.add_parser(
        "check", help="play a shipped task server's tasks with the scripted solver and verify the final states"
    )
    tool_check.add_argument("server", help="a task server's name (rlfabric envs list shows them)")
    tool_check.add_argument("--tasks", type=int, default=4, help="tasks per difficulty (default 4)")
    tool_check.add_argument("--seed", type=int, default=0, help="seed of the task draws (default 0)")
    tool_check.add_argument("--url", help="a running HTTP server of it to use instead of one process per episode")
    tool_check.set_defaults(func=cmd_tools_check)
    return parser


def _split_config_arg(args: argparse.Namespace) -> None:
    # `rlfabric train key=value` (no config file): the first positional is an override.
    if (
        args.command in ("train", "train-rm", "submit")
        and args.config
        and "=" in args.config
        and not os.path.exists(args.config)
    ):
        args.overrides = [args.config, *args.overrides]
        args.config = None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _split_config_arg(args)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"rlfabric: config error: {exc}", file=sys.stderr)
        return 2
    except RunAbortedError as exc:  # train reports its own (train_or_exit_code); this is another command's
        print(f"rlfabric: run stopped: {exc}", file=sys.stderr)
        return 1
    except RayError as exc:
        print(f"rlfabric: run failed: {error_summary(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # output piped into `head` and friends
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:  # before a run started (a run says what it leaves), or in another command
        print("\nrlfabric: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
