"""`megatron-jreg prepare-chat`: chat JSONL checked and cleaned for Megatron-LM's SFTDataset, and a chat template.

Megatron-LM's `--sft` reads JSONL lines `{"messages": [{"role", "content"}, ...]}` and renders each conversation
with the Hugging Face tokenizer's own `chat_template`, checking nothing: a record without an assistant turn trains
on nothing, an unknown role or a non-string content fails deep in a data loader worker, a `system` turn in the
middle starts a new conversation there (SFTDataset splits packs at system turns), and a field that differs in type
between lines breaks `datasets`' schema. `prepare_chat` checks every record and writes the good ones as
`{"messages": [...]}` only, in input order; bad ones are counted by reason and skipped, as `preprocess` does (the
reasons: docs/sft.md). With `--tokenizer DIR` each conversation is also tokenized exactly as `--sft` does
(`chat_targets.ChatTargets`), and a tokenizer without a chat template gets a copy with one.

`simple`, the default template, is plain text and adds no token (the checkpoint's embedding stays as it is):

    <|system|>\\n{system}\\n<|user|>\\n{user}\\n<|assistant|>\\n{answer}<EOS><|user|>\\n ...

Every turn ends at a newline or at the EOS, so tokenizing the whole conversation equals tokenizing its prefixes one
after another (what assistant-only targets rely on); the answers sit in `{% generation %}` tags, so transformers'
`return_assistant_tokens_mask` marks the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_jreg.data.checks import (
    DataError,
    check_output_folder,
    check_positive,
    describe_skips,
    skip_counts,
)
from megatron_jreg.data.sources import InputFile, iter_units, jsonl_lines, resolve_inputs
from megatron_jreg.errors import run_command
from megatron_jreg.usage import OneLineParser, example

PROG = "megatron-jreg prepare-chat"
ROLES = ("system", "user", "assistant")
EXAMPLES_PER_REASON = 3
PAD_NAMES = ("<|pad|>", "<pad>")  # reserved pad tokens picked up when the tokenizer sets none
MARKER = "prepare_chat.json"  # in a tokenizer folder written here (so a rerun may replace it)

SIMPLE_TEMPLATE = (
    "{{- bos_token if bos_token else '' -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- '<|system|>\\n' + (message['content'] | trim) + '\\n' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '<|user|>\\n' + (message['content'] | trim) + '\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- '<|assistant|>\\n' -}}"
    "{%- generation -%}{{- (message['content'] | trim) + eos_token -}}{%- endgeneration -%}"
    "{%- else -%}{{- raise_exception('unknown role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)
TEMPLATES = {"simple": SIMPLE_TEMPLATE}
# Text that opens a turn under `simple`: a model answering past its EOS starts one of these; generate stops there.
SIMPLE_STOP_TEXTS = ("<|user|>", "<|system|>", "<|assistant|>")


# ---------------------------------------------------------------------------------------------- records
def check_messages(record: Any) -> tuple[list[dict[str, str]] | None, str, str]:
    """(clean messages, "", "") for a good record, else (None, reason, detail); the reasons: docs/sft.md."""
    if not isinstance(record, dict):
        return None, "malformed_json", f"a JSON {type(record).__name__}, not an object"
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if messages == [] else "missing" if messages is None else type(messages).__name__
        return None, "missing_messages", f"'messages' is {what}; keys: {sorted(record)[:8]}"
    clean: list[dict[str, str]] = []
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            return None, "not_a_message", f"turn {i} is not an object with 'role' and 'content'"
        role, content = turn["role"], turn["content"]
        if role not in ROLES:
            return None, "unknown_role", f"turn {i} has role {role!r}; use one of {', '.join(ROLES)}"
        if not isinstance(content, str):
            return None, "not_a_string", f"turn {i} ({role}) has a {type(content).__name__} content"
        if not content.strip():
            return None, "empty_content", f"turn {i} ({role}) is empty"
        clean.append({"role": role, "content": content})
    roles = [m["role"] for m in clean]
    if roles[0] == "assistant":
        return None, "bad_first_role", "the conversation starts with an assistant turn"
    if "system" in roles[1:]:
        return None, "misplaced_system", f"a system turn at turn {roles.index('system', 1)} (only the first may be)"
    for i in range(1, len(roles)):
        if roles[i] == roles[i - 1]:
            return None, "consecutive_roles", f"turns {i - 1} and {i} are both {roles[i]}"
    if "assistant" not in roles:
        return None, "no_assistant_turn", "no assistant turn to train on"
    return clean, "", ""


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


def iter_records(files: list[InputFile], summary: ChatSummary) -> Iterator[tuple[Any, str]]:
    """(parsed JSON, "file:line") of every line of the files, in order; unreadable lines are counted in
    `summary` and skipped. A damaged .gz/.zst ends its file after the last complete line before the damage."""
    for unit in iter_units(files, ["messages"]):
        for where, record, reason in jsonl_lines(unit):
            if reason is None:
                yield record, where
            else:
                summary.skip(reason, where)


# -------------------------------------------------------------------------------------------- templates
def load_template(spec: str) -> tuple[str, str]:
    """(template text, its name) for `--chat-template NAME|FILE`; a DataError names the flag otherwise."""
    if spec in TEMPLATES:
        return TEMPLATES[spec], spec
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"--chat-template {spec}: neither a named template ({', '.join(TEMPLATES)}) nor a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--chat-template {spec}: cannot read it as UTF-8 text ({e})") from None
    _compile(text, f"--chat-template {spec}")
    return text, path.name


def _compile(template: str, what: str) -> None:
    """A jinja syntax error in a template becomes one DataError line (transformers' own environment)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except jinja2.TemplateError as e:
        raise DataError(f"{what}: not a valid jinja chat template ({e})") from None


def load_hf_tokenizer(folder: str | Path, flag: str = "--tokenizer"):  # noqa: ANN201 - a transformers tokenizer
    """A local Hugging Face tokenizer folder through AutoTokenizer, never touching the network."""
    from megatron_jreg.hub import force_offline

    force_offline()
    from transformers import AutoTokenizer

    path = Path(folder)
    if not path.is_dir():
        raise DataError(f"{flag} {folder}: no such folder (a Hugging Face tokenizer folder, e.g. with tokenizer.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise DataError(f"{flag} {folder}: transformers cannot load a tokenizer from it ({first}); the folder needs "
                        "tokenizer.json or the files save_pretrained writes") from None
    if tokenizer.eos_token is None:
        raise DataError(f"{flag} {folder}: the tokenizer has no eos_token (what ends an answer); set one in its "
                        "tokenizer_config.json")
    return tokenizer


def own_template(tokenizer) -> str | None:  # noqa: ANN001
    """The tokenizer's default chat template text, or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template or None


def _partial(path: Path) -> Path:
    """A fresh temporary name beside `path`, renamed to it once complete."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.partial")


def tokenizer_files(folder: Path, tokenizer) -> list[str]:  # noqa: ANN001 - a transformers tokenizer
    """The files of `folder` that make up `tokenizer` (loaded from it), by the names its class reads and
    `save_pretrained` writes: tokenizer.json, tokenizer_config.json, special_tokens_map.json, added_tokens.json
    and the class's own vocabulary files (tokenizer.model, vocab.json, merges.txt, ...), never the model's
    weights or config. Chat templates are left out (the copy gets its own)."""
    from transformers.tokenization_utils_base import (
        ADDED_TOKENS_FILE,
        FULL_TOKENIZER_FILE,
        SPECIAL_TOKENS_MAP_FILE,
        TOKENIZER_CONFIG_FILE,
    )

    names = {ADDED_TOKENS_FILE, FULL_TOKENIZER_FILE, SPECIAL_TOKENS_MAP_FILE, TOKENIZER_CONFIG_FILE}
    names |= {v for v in getattr(tokenizer, "vocab_files_names", {}).values() if isinstance(v, str)}
    return sorted(name for name in names if (folder / name).is_file())


def write_tokenizer_with_template(source: Path, output: Path, tokenizer, template: str,  # noqa: ANN001
                                  pad_token: str | None = None) -> Path:
    """A copy of the tokenizer `tokenizer` (loaded from the folder `source`: only its files, `tokenizer_files`) at
    `output` whose chat template is `template` (and pad token `pad_token`, when given), written under a
    temporary name and renamed. Other templates of the source (`additional_chat_templates/`, a `chat_template`
    entry in tokenizer_config.json) are left out, so the copy has one."""
    from transformers.utils.hub import CHAT_TEMPLATE_FILE

    if output.exists():
        if not (output / MARKER).is_file():
            raise DataError(f"--tokenizer-output {output}: exists and was not written by prepare-chat; remove it or "
                            "choose another folder")
    check_output_folder(output.parent, f"--tokenizer-output {output}")
    tmp = _partial(output)
    tmp.mkdir()  # a plain mkdir and copies: the modes the umask gives (mkdtemp's folder would be owner-only)
    try:
        for name in tokenizer_files(source, tokenizer):
            shutil.copyfile(source / name, tmp / name)
        config_path = tmp / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        config.pop("chat_template", None)
        if pad_token is not None:
            config["pad_token"] = pad_token
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        (tmp / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
        (tmp / MARKER).write_text(json.dumps({"source": str(source.resolve()), "pad_token": pad_token}, indent=2)
                                  + "\n", encoding="utf-8")
        if output.exists():
            shutil.rmtree(output)
        os.replace(tmp, output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return output


PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"},
         {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye."}]


def _probe(tokenizer, what: str) -> None:  # noqa: ANN001
    """The chat template renders a system/user/assistant/user conversation with a generation prompt."""
    try:
        text = tokenizer.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja errors, the template's raise_exception
        why = " ".join(str(e).split())[:200]
        raise DataError(f"{what}: the chat template fails on a plain conversation ({why})") from None
    if not isinstance(text, str) or "Hello?" not in text or "Hi." not in text:
        raise DataError(f"{what}: the chat template leaves out the turns' content; check the template")


def _special_texts(tokenizer) -> list[str]:  # noqa: ANN001
    """Text of every special token (BOS/EOS/pad and added ones such as reserved chat markers): inside a turn it
    would become that token, e.g. end the answer early or fake a turn."""
    texts = {tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token}
    texts |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return sorted(t for t in texts if isinstance(t, str) and t)


def reserved_pad(tokenizer) -> str | None:  # noqa: ANN001
    """A pad token reserved in the vocabulary (`<|pad|>` or `<pad>`, special) but not set as the pad token."""
    names = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return next((name for name in PAD_NAMES if name in names), None)


# -------------------------------------------------------------------------------------------- the command
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
        out = Path(self.output)
        if not self.output or self.output.endswith(("/", os.sep)) or out.is_dir():
            raise DataError(f"--output {self.output!r} is a folder; give a file name, e.g. {out / 'chat.jsonl'}")
        check_output_folder(out.parent, f"--output {self.output}")
        files = resolve_inputs(list(self.input))
        for f in files:
            if f.kind != "jsonl":
                raise DataError(f"--input {f.path}: chat data is JSONL (.jsonl, .jsonl.gz, .jsonl.zst)")
            if Path(f.path) == out.resolve():
                raise DataError(f"--output {self.output} is also an --input; write to another file")
        return files


def _setup_tokenizer(cfg: ChatConfig, summary: ChatSummary):  # noqa: ANN202 - a transformers tokenizer
    """The tokenizer to check records with: the given folder when it has the chat template to use, else a
    copy written with it (`write_tokenizer_with_template`)."""
    source = Path(cfg.tokenizer)
    tokenizer = load_hf_tokenizer(source)
    own = own_template(tokenizer)
    if cfg.chat_template is not None:
        template, name = load_template(cfg.chat_template)
    elif own is not None:
        template, name = own, "the tokenizer's own"
    else:
        template, name = SIMPLE_TEMPLATE, "simple"
    pad = cfg.pad_token
    if pad is None and (tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id):
        pad = reserved_pad(tokenizer)
        if pad is not None:
            summary.notes.append(f"pad token: {pad}, reserved in the vocabulary (the tokenizer set none)")
    summary.template = name
    if template == own and pad is None:
        summary.tokenizer = str(source)
    else:
        vocabulary = len(tokenizer)
        folder = write_tokenizer_with_template(source, cfg.tokenizer_folder(), tokenizer, template, pad)
        tokenizer = load_hf_tokenizer(folder, "--tokenizer-output")
        if own_template(tokenizer) != template:
            raise DataError(f"--tokenizer-output {folder}: transformers does not read the written chat template back")
        summary.tokenizer, summary.tokenizer_written = str(folder), True
        if len(tokenizer) != vocabulary:
            summary.notes.append(f"--pad-token {pad} is a new token: the vocabulary grows from {vocabulary} to "
                                 f"{len(tokenizer)} (the model's embedding needs a row for it)")
    _probe(tokenizer, f"--chat-template {cfg.chat_template}" if cfg.chat_template else f"--tokenizer {source}")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
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
        targets, specials = ChatTargets(hf), _special_texts(hf)
    out = Path(cfg.output)
    tmp = _partial(out)
    try:
        with open(tmp, "x", encoding="utf-8") as f:  # a plain open: the mode the umask gives, as every output
            for record, where in iter_records(files, summary):
                messages, reason, detail = check_messages(record)
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
            f.flush()
            os.fsync(f.fileno())
        if summary.conversations == 0:
            raise DataError(f"--input {' '.join(cfg.input)}: no usable conversation ({skip_counts(summary.skipped)}); "
                            "nothing written to --output")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
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
                   help=f"template when the tokenizer has none ({', '.join(TEMPLATES)} or a .jinja file; default "
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
        cfg = ChatConfig(tuple(args.input), args.output, args.tokenizer, args.chat_template, args.tokenizer_output,
                         args.pad_token, args.seq_length)
        print(prepare_chat(cfg).describe())
        return 0

    return run_command(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
