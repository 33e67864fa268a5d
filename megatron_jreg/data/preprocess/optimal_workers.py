"""Megatron-LM's `--find-optimal-num-workers`: time the run with each of `--workers-to-check` worker counts.

Each count tokenizes the first `--max-documents` documents (default 100,000, as Megatron-LM) into a
temporary folder beside the output,
removed afterwards; documents per second rank the counts, fastest first, and the best is reported.
Megatron-LM also leaves the last trial's output at the output prefix; here nothing is written there, so a
measured run never passes for the real one: run again with the best `--workers`.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

from megatron_jreg.data.checks import check_output_prefix
from megatron_jreg.data.preprocess.config import TRIAL_DOCUMENTS, PreprocessConfig


def find_optimal_num_workers(cfg: PreprocessConfig) -> dict:
    """`{"trials": [{"workers", "docs_per_s", "documents"}, ...] fastest first, "best_workers": n}`."""
    from megatron_jreg.data.preprocess.driver import preprocess

    folder = check_output_prefix(cfg.output_prefix)
    limit = cfg.max_documents or TRIAL_DOCUMENTS
    trials = []
    with tempfile.TemporaryDirectory(prefix=".find-optimal-num-workers-", dir=folder) as tmp:
        for workers in dict.fromkeys(cfg.workers_to_check):
            print(f"Processing data with {workers} workers.", file=sys.stderr)
            trial = dataclasses.replace(
                cfg,
                output_prefix=str(Path(tmp) / f"workers{workers}"),
                workers=workers,
                max_documents=limit,
                output_shards=1,
                shard_ids=None,
                find_optimal_num_workers=False,
            )
            summary = preprocess(trial)
            trials.append({"workers": workers, "docs_per_s": summary["docs_per_s"], "documents": summary["documents"]})
    trials.sort(key=lambda t: -t["docs_per_s"])
    return {"trials": trials, "best_workers": trials[0]["workers"]}


def describe(result: dict) -> list[str]:
    """Megatron-LM's report: the ranking, then the best count."""
    lines = ["Performance results (fastest -> slowest):"]
    lines += [
        f"{i}. {t['workers']} workers -> avg. docs/s: {t['docs_per_s']:.4f} ({t['documents']:,} documents)"
        for i, t in enumerate(result["trials"], 1)
    ]
    best = result["trials"][0]
    lines.append(
        f"The most optimal num of workers is {best['workers']} with avg. preprocessed docs/s: "
        f"{best['docs_per_s']:.4f}."
    )
    return lines
