"""The MCP example end to end, shortened: examples/agent_mcp_grpo.yaml trains through supervised HTTP task servers
(every episode its own MCP session), raises held-out success from nothing, and goes on when one of its servers is
killed during GRPO: the supervisor restarts it and the later steps and the final evaluation run on the new one."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml
from processes import own_processes

from rlfabric.config import config_from_dict
from rlfabric.llm_driver import train_llm
from rlfabric.run.log import read_metrics

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "agent_mcp_grpo.yaml"


def server_pids(name: str) -> list[int]:
    return own_processes(f"rlfabric.envs.{name}_server --http")


def kill_once_grpo_starts(run_dir: Path, name: str, killed: list[int], stop: threading.Event) -> None:
    """Kill the server ``name`` once the run has logged its first GRPO step."""
    metrics = run_dir / "metrics.jsonl"
    while not stop.is_set():
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if any('"phase": "grpo"' in line for line in lines):  # a line may be half written: no JSON parsing
            for pid in server_pids(name):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            return
        time.sleep(0.2)


@pytest.mark.slow
def test_the_mcp_example_learns_through_supervised_servers_and_survives_a_killed_one(local_ray, tmp_path):
    config = yaml.safe_load(EXAMPLE.read_text())
    # Shortened: the perfect solver, fewer warm-up steps and tasks, four GRPO steps. The solver is deterministic
    # and each task's server resets to its seed, so one episode per train row, played once, is every batch's
    # source (sft.demonstrations), as fresh play would be.
    config["data"].update(num_train=300, num_eval=20)
    config["sft"].update(steps=200, demonstrations=300, player="rlfabric.envs.mcp_tasks:solution_player")
    config["grpo"].update(prompts_per_step=4)
    config["training"].update(total_steps=4, eval_every=0, show_samples=0)
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=kill_once_grpo_starts, args=(tmp_path, "notes", killed, stop), daemon=True)
    killer.start()
    try:
        summary = train_llm(config_from_dict(config), tmp_path, quiet=True)
    finally:
        stop.set()
        killer.join()
    assert len(killed) == 1  # the one notes server the run started, killed during GRPO
    rows = read_metrics(tmp_path)
    evals = {r["label"]: r for r in rows if r.get("phase") == "eval"}
    assert evals["initial"]["eval_accuracy"] == 0.0  # the untrained model cannot spell a call
    assert evals["after_sft"]["eval_accuracy"] >= 0.3, evals
    grpo = [r for r in rows if r.get("phase") == "grpo"]
    assert len(grpo) == 4 and summary["eval_accuracy_final"] >= 0.3, summary
    assert summary["tool_server_restarts"] == 1
    assert evals["final"]["eval_failed"] == 0  # the final evaluation ran on the restarted server
    # The policy's own sampled episodes call the tools. A step whose every episode was cut off by the kill (its
    # rollouts were in flight on the killed server) has nothing scored: its accuracy is None.
    played = [r for r in grpo if r["accuracy"] is not None]
    assert len(played) >= 3 and all(r["tool_calls"] > 0 for r in played), grpo
    assert server_pids("notes") == []  # the run stopped its servers
