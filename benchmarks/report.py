"""The JSON report a benchmark writes next to its figures: what ran, when, where, with which settings."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import date
from pathlib import Path
from typing import Any


def write_report(out: Path, benchmark: str, args: argparse.Namespace, **results: Any) -> None:
    """Write ``results`` to ``out`` with the benchmark's name, the date, the machine (platform, CPUs, Python, and
    torch's version when it ran) and the command's settings (``args`` less ``out``); print where."""
    machine: dict[str, Any] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    if "torch" in sys.modules:
        machine["torch"] = sys.modules["torch"].__version__
    report = {
        "benchmark": benchmark,
        "date": date.today().isoformat(),
        "machine": machine,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        **results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out}")
