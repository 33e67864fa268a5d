"""Run a measuring command and save its console output as a results file the docs can cite.

    python benchmarks/record.py docs/results/<name>.txt -- python benchmarks/preset_params.py

The file starts with the provenance the docs promise (tests/test_docs.py checks it):

    # command: python benchmarks/preset_params.py
    # commit: <sha of HEAD at the start> (+ local changes to FILES, when the work tree differs)
    # date: <UTC>
    # machine: <cores> CPU cores (<model>), load average <start> → <end>; torch <v>, megatron-core <v>
    # wall: <seconds> s; CPU <core-seconds> core-s (the command and its children: on a shared machine the
    #   wall time depends on the load, the CPU time much less)

then the command's stdout (stderr goes to the console). The command runs from the repository root with
OMP_NUM_THREADS=1 (unless set), this checkout first on PYTHONPATH and this interpreter's folder first on
PATH, so `python` and `megatron-jreg` in it (also inside `bash -c '...'`) are this venv's.
Nothing is written when it fails.
"""

from __future__ import annotations

import datetime
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "HEAD", "--name-only"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    if not dirty:
        return head
    return f"{head} (+ local changes to {', '.join(dirty[:8])}{' …' if len(dirty) > 8 else ''})"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python benchmarks/record.py OUTPUT.txt -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    out, command = Path(argv[0]), argv[2:]
    run = [sys.executable if command[0] == "python" else command[0], *command[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
           "PATH": os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))}
    load0, commit = os.getloadavg()[0], _commit()  # the code that ran: HEAD when it started
    t0, usage0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(run, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    wall, usage = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime - usage0.ru_utime - usage0.ru_stime
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout)
        print(f"record.py: error: {shlex.join(command)} exited {proc.returncode}; {out} not written", file=sys.stderr)
        return 1
    header = [
        f"# command: {shlex.join(command)}",
        f"# commit: {commit}" + ("" if _commit() == commit else f" (HEAD at the end: {_commit()})"),
        f"# date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"# machine: {os.cpu_count()} CPU cores ({_cpu_model()}), shared; load average {load0:.1f} → "
        f"{os.getloadavg()[0]:.1f}; OMP_NUM_THREADS={env['OMP_NUM_THREADS']}; torch {_version('torch')}, "
        f"megatron-core {_version('megatron-core')}",
        f"# wall: {wall:.0f} s; CPU {cpu:.0f} core-s",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(header) + "\n" + proc.stdout, encoding="utf-8")
    sys.stdout.write(proc.stdout)
    print(f"record.py: wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
