"""Settings the entry points make before torch loads (megatron_jreg/process_env.py), checked in fresh processes:
torch reads them once, so a test process that has imported torch could not see them take effect."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_jreg.process_env import gpu_signs

REPO = Path(__file__).resolve().parent.parent
GPU_KEYS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
            "NNODES", "THP_MEM_ALLOC_ENABLE")
# As the train entry does it, then torch imported (which reads the variable at its first CPU allocation).
CHILD = """
import os
from megatron_jreg.process_env import huge_pages_for_cpu_training
set_here = huge_pages_for_cpu_training()
import torch
torch.empty(4 << 20, dtype=torch.uint8).fill_(1)
print(set_here, os.environ.get("THP_MEM_ALLOC_ENABLE"))
"""


def _child(**env: str) -> tuple[str, str]:
    clean = {k: v for k, v in os.environ.items() if k not in GPU_KEYS and not k.startswith("SLURM_")}
    done = subprocess.run([sys.executable, "-c", CHILD], env={**clean, **env}, cwd=REPO, capture_output=True,
                          text=True, check=True)
    set_here, value = done.stdout.split()
    return set_here, value


def test_cpu_training_asks_torch_for_huge_pages():
    """THP_MEM_ALLOC_ENABLE=1 on a machine with no sign of a GPU (its effect on the JREG op, side by side with
    it off: docs/results/jreg_op.txt and jreg_op_no_thp.txt)."""
    if gpu_signs({}):
        pytest.skip("this machine has NVIDIA device nodes: the default applies to CPU-only machines")
    assert _child() == ("True", "1")


def test_the_users_setting_and_a_gpu_machine_are_left_alone():
    assert _child(THP_MEM_ALLOC_ENABLE="0") == ("False", "0")
    assert _child(CUDA_VISIBLE_DEVICES="0") == ("False", "None")


def test_the_design_notes_quote_no_figure_their_results_files_do_not_hold():
    """The design notes on process settings (DEVELOPERS.md, where process_env's docstring points) cite the
    measurement behind the huge-page default (the THP numbers once quoted were of the JREG op before 8d42bea);
    every millisecond or MiB figure they name must be a line's figure in a results file they cite."""
    import re

    from megatron_jreg import process_env

    assert "DEVELOPERS.md" in (process_env.__doc__ or "")
    notes = (REPO / "DEVELOPERS.md").read_text(encoding="utf-8")

    def section(heading: str) -> str:  # from the heading to the next heading of its level or above
        level = heading.split(" ")[0]
        rest = notes[notes.index(heading) + len(heading):]
        ends = [m.start() for m in re.finditer(rf"^#{{1,{len(level)}}} ", rest, re.M)]
        return rest[: ends[0] if ends else len(rest)]

    doc = section("## megatron-core on CPU") + section("### Settings made before torch loads")
    cited = re.findall(r"docs/results/[\w.\-]+\.txt", doc)
    assert "docs/results/jreg_op_no_thp.txt" in cited, "the huge-page reason cites its measurement"
    recorded = "".join((REPO / path).read_text(encoding="utf-8") for path in cited)
    for figure in re.findall(r"\d+(?:\.\d+)? (?:ms|MiB|MB/s)", doc):
        assert figure in recorded, f"DEVELOPERS.md quotes {figure!r}, in none of {cited}"
