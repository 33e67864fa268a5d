"""`megatron-jreg train --help`: seconds and stderr lines of the first call (the parser's layout is built from
Megatron-LM's parser, importing megatron.training) against the calls after it (the kept layout, formatted for
the terminal), at the width that filled the cache and at another, side by side in one run.

    python benchmarks/train_help.py                 # 3 rounds of: cold (an empty cache folder), warm, warm at 137

Each call is a fresh process with its own XDG_CACHE_HOME; "cold" starts from an empty one at 80 columns (as
`make venv` fills it), "warm" reuses the folder the cold call filled, at 80 and at 137 columns (the kept copy was
the text at one width until the layout was kept instead: 137 columns then built it again). Last line: cold_s=…
warm_s=… warm_137_s=… warm_vs_cold=… stderr_lines=… (medians; stderr lines over every call).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def call(cache: Path, columns: int) -> tuple[float, int, int]:
    """(seconds, stdout lines, stderr lines) of one `python -m megatron_jreg.cli train --help`."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "COLUMNS": str(columns)}
    env.pop("PYTHONWARNINGS", None)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "megatron_jreg.cli", "train", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True)
    return time.perf_counter() - start, len(proc.stdout.splitlines()), len(proc.stderr.splitlines())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    times: dict[str, list[float]] = {"cold": [], "warm": [], "warm 137": []}
    stderr = 0
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            for kind, columns in (("cold", 80), ("warm", 80), ("warm 137", 137)):
                seconds, out_lines, err_lines = call(Path(tmp), columns)
                times[kind].append(seconds)
                stderr += err_lines
                print(f"round {r} {kind + ':':9} {seconds:6.2f} s, {columns} columns, {out_lines} help lines, "
                      f"{err_lines} stderr lines", flush=True)
    c, w, w137 = (statistics.median(times[kind]) for kind in ("cold", "warm", "warm 137"))
    print(f"cold_s={c:.2f} warm_s={w:.2f} warm_137_s={w137:.2f} warm_vs_cold={w / c:.3f} stderr_lines={stderr}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
