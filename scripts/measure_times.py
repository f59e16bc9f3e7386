"""Measure what the docs quote as times, and write docs/times.md from the measurements.

    python scripts/measure_times.py                       # docs/times.md from what is recorded
    python scripts/measure_times.py --suite               # time `make test` from a clean shell first
    python scripts/measure_times.py --commands [TEXT ...] # time the README's quick-start commands
                                                          # (those containing TEXT)

Measurements go to ``results/benchmarks/times.json`` with the commit, the machine and the date;
the page adds the CPU grid's run counts (``reproduce_cpu.sh --list``) and the records' training
times (``analysis.times``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import project_env  # noqa: F401  (first: the project's Python, whatever `python` ran this)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # analysis/ from a plain checkout

from analysis import times  # noqa: E402

CLEAN_ENV = {key: os.environ[key] for key in ("HOME", "LANG") if key in os.environ} | {
    "PATH": "/usr/local/bin:/usr/bin:/bin"}


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"model name\s*:\s*(.*)", cpuinfo)
    return f"{model.group(1).strip() if model else 'unknown CPU'}, {os.cpu_count()} cores"


def stamp(seconds: float, **extra) -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.strip()
    return {"seconds": round(seconds, 1), "commit": commit + ("+changes" if dirty else ""),
            "machine": machine(), "date": datetime.date.today().isoformat(),
            "load_before": round(os.getloadavg()[0], 2), **extra}


def timed(command: list[str], env: dict | None = None) -> tuple[float, str]:
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed (exit {done.returncode}); nothing recorded:\n"
                 + done.stdout[-3000:] + done.stderr[-3000:])
    return seconds, done.stdout


def quick_start_commands() -> list[str]:
    """The README's quick-start commands that run as written (no placeholder, no cluster)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^\|[^|]*\| `(python scripts/[^`]*)` \|", section, re.M)
    return [c for c in commands if "<" not in c and "..." not in c]


def grid_counts() -> dict[str, int]:
    listing = subprocess.run(["bash", "scripts/reproduce_cpu.sh", "--list"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    counts: dict[str, int] = {}
    for line in listing.splitlines():
        group = line.split("/", 1)[0]
        counts[group] = counts.get(group, 0) + 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", action="store_true", help="time `make test` from a clean shell")
    parser.add_argument("--commands", nargs="*", metavar="TEXT",
                        help="time the README's quick-start commands (those containing TEXT)")
    args = parser.parse_args()
    measured = json.loads(times.MEASURED.read_text()) if times.MEASURED.exists() else {}
    if args.suite:
        seconds, out = timed(["make", "test"], CLEAN_ENV)
        summary = re.findall(r"(\d+ passed[^\n]*?) in [\d.]+s", out)
        measured["suite"] = stamp(seconds, command="make test",
                                  summary=summary[-1] if summary else "the suite")
    if args.commands is not None:
        commands = [c for c in quick_start_commands()
                    if not args.commands or any(text in c for text in args.commands)]
        if not commands:
            sys.exit(f"no quick-start command contains {args.commands}; the commands: "
                     f"{quick_start_commands()}")
        for command in commands:
            python = str(ROOT / ".venv" / "bin" / "python")
            seconds, _ = timed([python] + command.split()[1:])
            measured.setdefault("commands", {})[command] = stamp(seconds)
            print(f"{command}: {seconds:.0f} s")
    times.MEASURED.write_text(json.dumps(measured, indent=2) + "\n")
    times.PAGE.write_text(times.render(measured, grid_counts(), ROOT / "results" / "runs" / "cpu"))
    print(f"-> {times.PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
