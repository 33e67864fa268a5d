"""`megatron-jreg generate`: answers to a question file, in the answer format FastChat's MT-bench judge reads."""

# ruff: noqa: E402 - the imports after sleep_while_waiting() load torch, and must come after it
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_jreg.process_env import sleep_while_waiting

sleep_while_waiting()  # before torch loads libgomp, which reads its wait policy once (megatron_jreg/process_env.py)
from megatron_jreg.evaluate.models import DTYPES
from megatron_jreg.hub import force_offline
from megatron_jreg.usage import example


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-jreg generate", description=__doc__.split("\n")[0],
                                **example("megatron-jreg generate --load runs/sft-jreg --prompts "
                                          "examples/sft/data/wikitext_questions.jsonl --output answers/sft-jreg.jsonl"))
    model = p.add_mutually_exclusive_group()
    model.add_argument("--hf", type=Path, metavar="DIR", help="a Hugging Face model folder")
    model.add_argument("--load", type=Path, metavar="CKPT", help="a Megatron-LM or megatron-jreg checkpoint")
    p.add_argument("--iteration", type=int, help="checkpoint iteration for --load (default: the latest)")
    p.add_argument("--tokenizer", type=Path, metavar="DIR",
                   help="--load: a Hugging Face tokenizer folder instead of the run's --tokenizer-model (default: the "
                   "run's)")
    p.add_argument("--prompts", type=Path, required=True, metavar="FILE",
                   help='questions, FastChat MT-bench format: {"question_id", "category", "turns": [...]} a line')
    p.add_argument("--output", required=True, metavar="FILE",
                   help="answer JSONL (FastChat's model_answer/<model-id>.jsonl); an existing one is resumed")
    p.add_argument("--max-new-tokens", type=int, default=512, metavar="N",
                   help="longest answer per turn, in tokens (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sampling: nucleus mass (default: %(default)s, the whole distribution)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling: draws depend on the seed and the question id only (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N",
                   help="questions answered together (default: %(default)s)")
    p.add_argument("--model-id", help="model name in the answers (default: the model folder's name)")
    p.add_argument("--chat-template", metavar="NAME|FILE",
                   help="replace the tokenizer's chat template (simple, or a .jinja file); default: the tokenizer's "
                   "own, else simple")
    p.add_argument("--device", help="torch device for --hf (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights dtype; auto = float32 on CPU (default: %(default)s)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    return p


def main(argv: list[str] | None = None) -> int:
    force_offline()  # before anything imports a Hugging Face library
    from megatron_jreg.errors import run_command

    args = build_parser().parse_args(argv)
    return run_command("megatron-jreg generate", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    from megatron_jreg.generate.runner import GenerateConfig, generate

    cfg = GenerateConfig(**vars(args))  # one config field per flag
    if cfg.chat_template is not None:  # before the model loads, as generate reads the question and answer files
        from megatron_jreg.data.chat import load_template

        load_template(cfg.chat_template)
    print(generate(cfg).describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
