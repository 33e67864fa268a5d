"""`megatron-jreg prepare-chat`: chat JSONL checked and cleaned for Megatron-LM's SFTDataset, and a chat template.

Megatron-LM's `--sft` checks nothing: a bad record trains on nothing, fails deep in a data loader worker or breaks
`datasets`' schema. Here each is counted by reason (docs/sft.md) and skipped before training.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from megatron_jreg.data import chat
from megatron_jreg.data.checks import DataError, check_output_prefix, check_positive, describe_skips, skip_counts
from megatron_jreg.data.sources import InputFile, iter_units, jsonl_lines, resolve_inputs
from megatron_jreg.errors import run_command
from megatron_jreg.fileio import atomic_write
from megatron_jreg.usage import OneLineParser, example

PROG = "megatron-jreg prepare-chat"
EXAMPLES_PER_REASON = 3


@dataclass
class ChatSummary:
    """What prepare_chat did: counts, skipped records by reason (with a few file:line examples), outputs."""

    conversations: int = 0
    turns: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    output: str = ""
    tokenizer: str | None = None  # the folder to train with (the input's, or the copy written here)
    tokenizer_written: bool = False
    template: str | None = None  # "the tokenizer's own", "simple", or a file name
    tokens: list[int] = field(default_factory=list)  # per kept conversation, with a tokenizer
    target_tokens: int = 0  # assistant tokens (loss positions) over all kept conversations
    notes: list[str] = field(default_factory=list)

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < EXAMPLES_PER_REASON:
            shown.append(where)

    def describe(self) -> str:
        lines = [f"kept: {self.conversations:,} conversations ({self.turns:,} turns) -> {self.output}"]
        if self.tokens:
            total = sum(self.tokens)
            lines.append(f"tokens: {total:,} ({total / len(self.tokens):.1f} per conversation, longest "
                         f"{max(self.tokens):,}; {self.target_tokens:,} on assistant turns)")
        lines.append(describe_skips(self.skipped, self.examples))
        if self.tokenizer is not None:
            how = "written with" if self.tokenizer_written else "has"
            lines.append(f"tokenizer: {self.tokenizer} ({how} chat template: {self.template})")
            lines.append(f"train with: --sft --tokenizer-type SFTTokenizer --tokenizer-model {self.tokenizer} "
                         f"--sft-tokenizer-prompt-format default --data-path {self.output}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass(frozen=True)
class ChatConfig:
    """prepare-chat settings; `check` validates them before any work."""

    input: tuple[str, ...]
    output: str
    tokenizer: str | None = None
    chat_template: str | None = None  # NAME or FILE; None: the tokenizer's own, else "simple"
    tokenizer_output: str | None = None  # default: OUTPUT's name with "_tokenizer" beside it
    pad_token: str | None = None
    seq_length: int | None = None

    def tokenizer_folder(self) -> Path:
        if self.tokenizer_output is not None:
            return Path(self.tokenizer_output)
        out = Path(self.output)
        return out.with_name(out.name.split(".")[0] + "_tokenizer")

    def check(self) -> list[InputFile]:
        if self.tokenizer is None:
            for flag, value in (("--chat-template", self.chat_template), ("--tokenizer-output", self.tokenizer_output),
                                ("--pad-token", self.pad_token), ("--seq-length", self.seq_length)):
                if value is not None:
                    raise DataError(f"{flag} needs --tokenizer DIR (the Hugging Face tokenizer to train with)")
        check_positive("--seq-length", self.seq_length, minimum=2)
        check_output_prefix(self.output, "--output", "a file name", "chat.jsonl")
        files = resolve_inputs(list(self.input))
        for f in files:
            if f.kind != "jsonl":
                raise DataError(f"--input {f.path}: chat data is JSONL (.jsonl, .jsonl.gz, .jsonl.zst)")
            if Path(f.path) == Path(self.output).resolve():
                raise DataError(f"--output {self.output} is also an --input; write to another file")
        return files


def _setup_tokenizer(cfg: ChatConfig, summary: ChatSummary):  # noqa: ANN202 - a transformers tokenizer
    """The tokenizer to check records with: the given folder when it has the template to use, else a copy with it."""
    source = Path(cfg.tokenizer)
    tokenizer = chat.load_hf_tokenizer(source)
    own = chat.own_template(tokenizer)
    if cfg.chat_template is None and own is not None:
        template, name = own, "the tokenizer's own"
    else:
        template, name = chat.load_template("simple" if cfg.chat_template is None else cfg.chat_template)
    pad = cfg.pad_token
    if pad is None and (tokenizer.pad_token_id in (None, tokenizer.eos_token_id)):
        pad = chat.reserved_pad(tokenizer)
        if pad is not None:
            summary.notes.append(f"pad token: {pad}, reserved in the vocabulary (the tokenizer set none)")
    summary.template = name
    if template == own and pad is None:
        summary.tokenizer = str(source)
    else:
        vocabulary = len(tokenizer)
        folder = chat.write_tokenizer_with_template(source, cfg.tokenizer_folder(), tokenizer, template, pad)
        tokenizer = chat.load_hf_tokenizer(folder, "--tokenizer-output")
        if chat.own_template(tokenizer) != template:
            raise DataError(f"--tokenizer-output {folder}: transformers does not read the written chat template back")
        summary.tokenizer, summary.tokenizer_written = str(folder), True
        if len(tokenizer) != vocabulary:
            summary.notes.append(f"--pad-token {pad} is a new token: the vocabulary grows from {vocabulary} to "
                                 f"{len(tokenizer)} (the model's embedding needs a row for it)")
    chat.probe(tokenizer, f"--chat-template {cfg.chat_template}" if cfg.chat_template else f"--tokenizer {source}")
    if tokenizer.pad_token_id in (None, tokenizer.eos_token_id):
        summary.notes.append(
            "the tokenizer pads with its EOS: Megatron-LM's SFTDataset masks every target equal to the pad id, so "
            "the EOS that ends each answer gets no loss and the model does not learn to stop; give --pad-token "
            "TOKEN, a token that never occurs in the data")
    return tokenizer


def prepare_chat(cfg: ChatConfig) -> ChatSummary:
    """Check every record of `cfg.input`, write the good ones to `cfg.output` (atomically); see the module doc."""
    files = cfg.check()
    summary = ChatSummary(output=cfg.output)
    targets = None
    if cfg.tokenizer is not None:
        from megatron_jreg.data.chat_targets import IGNORE_INDEX, ChatTargets

        hf = _setup_tokenizer(cfg, summary)
        targets, specials = ChatTargets(hf), chat.special_texts(hf)
    lines = (line for unit in iter_units(files, ["messages"]) for line in jsonl_lines(unit))
    with atomic_write(cfg.output) as f:  # the mode the umask gives, as every output
        for where, record, reason in lines:  # a damaged .gz/.zst ends after its last complete line
            if reason is not None:
                summary.skip(reason, where)
                continue
            messages, reason, detail = chat.check_messages(record)
            if messages is None:
                summary.skip(reason, f"{where} ({detail})")
                continue
            if targets is not None:
                special = next((s for m in messages for s in specials if s in m["content"]), None)
                if special is not None:
                    summary.skip("special_token_text", f"{where} (contains {special!r})")
                    continue
                try:
                    tokens, target = targets.tokenize_conversation(messages, True, False)
                except Exception as e:  # noqa: BLE001 - jinja, the template's raise_exception, ChatTargets
                    summary.skip("template_error", f"{where} ({' '.join(str(e).split())[:160]})")
                    continue
                if cfg.seq_length is not None and len(tokens) > cfg.seq_length:
                    summary.skip("too_long", f"{where} ({len(tokens)} tokens > --seq-length {cfg.seq_length})")
                    continue
                summary.tokens.append(len(tokens))
                summary.target_tokens += int((target != IGNORE_INDEX).sum())
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
            summary.conversations += 1
            summary.turns += len(messages)
        if summary.conversations == 0:
            raise DataError(f"--input {' '.join(cfg.input)}: no usable conversation ({skip_counts(summary.skipped)}); "
                            "nothing written to --output")
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0],
                      **example("megatron-jreg prepare-chat --input tulu_v1.jsonl.gz --output data/tulu.jsonl "
                                "--tokenizer data/tok/hf --seq-length 2048"))
    p.add_argument("--input", nargs="+", required=True, help="chat JSONL(.gz/.zst) file(s), folders or globs")
    p.add_argument("--output", required=True, help="the clean chat JSONL for --sft --data-path")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="a local Hugging Face tokenizer folder: check each conversation with it (default: none, the "
                   "records' structure only)")
    p.add_argument("--chat-template", metavar="NAME|FILE",
                   help=f"template when the tokenizer has none ({', '.join(chat.TEMPLATES)} or a .jinja file; default "
                   "simple); given, it replaces the tokenizer's own in the copy")
    p.add_argument("--tokenizer-output", metavar="DIR",
                   help="where the tokenizer copy with the template goes (default: OUTPUT's name + _tokenizer)")
    p.add_argument("--pad-token", metavar="TOKEN",
                   help="the copy's pad token (Megatron-LM's SFTDataset masks pad targets; default: the "
                   "tokenizer's, else a reserved <|pad|> or <pad>, else its EOS)")
    p.add_argument("--seq-length", type=int, metavar="N",
                   help="with --tokenizer: skip conversations longer than N tokens (too_long) (default: no limit)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        print(prepare_chat(ChatConfig(**{**vars(args), "input": tuple(args.input)})).describe())
        return 0

    return run_command(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
