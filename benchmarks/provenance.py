"""The line every CPU benchmark table starts with, and how a table is written out."""

from __future__ import annotations

import datetime
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stamp() -> str:
    """`commit C, CPU model, N CPUs, date UTC, load average L`."""
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "?"
    return (f"commit {commit}, {fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load average {os.getloadavg()[0]:.1f}")


def emit(lines: list[str], append: str | None) -> None:
    """Print the table; with `append`, also add it to that markdown file."""
    print("\n".join(lines))
    if append:
        with open(append, "a") as f:
            f.write("\n".join(lines) + "\n")
