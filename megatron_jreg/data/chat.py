"""The chat format --sft trains on, one place for `prepare-chat` and `generate`: record checks, chat templates
and a tokenizer copy carrying one (the default template, `simple`, is plain text: no new embedding rows).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from megatron_jreg.data.checks import DataError
from megatron_jreg.fileio import atomic_folder, check_output_folder

ROLES = ("system", "user", "assistant")
PAD_NAMES = ("<|pad|>", "<pad>")  # reserved pad tokens picked up when the tokenizer sets none
MARKER = "prepare_chat.json"  # in a tokenizer folder written here (so a rerun may replace it)

# `<|system|>\n{system}\n<|user|>\n{user}\n<|assistant|>\n{answer}<EOS>...`: every turn ends at a newline or
# the EOS, so the whole conversation tokenizes as its prefixes do (assistant-only targets rely on it); answers
# sit in `{% generation %}` tags, so transformers' `return_assistant_tokens_mask` marks the same tokens.
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
    if (i := next((i for i in range(1, len(roles)) if roles[i] == roles[i - 1]), 0)):
        return None, "consecutive_roles", f"turns {i - 1} and {i} are both {roles[i]}"
    if "assistant" not in roles:
        return None, "no_assistant_turn", "no assistant turn to train on"
    return clean, "", ""


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
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template  # transformers' own environment

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateError as e:
        raise DataError(f"--chat-template {spec}: not a valid jinja chat template ({e})") from None
    return text, path.name


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
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template or None


def tokenizer_files(folder: Path, tokenizer) -> list[str]:  # noqa: ANN001 - a transformers tokenizer
    """The files of `folder` that make up `tokenizer`, by the names its class reads and `save_pretrained`
    writes: never the model's weights or config, nor chat templates (the copy gets its own)."""
    from transformers import tokenization_utils_base as base

    names = {base.ADDED_TOKENS_FILE, base.FULL_TOKENIZER_FILE, base.SPECIAL_TOKENS_MAP_FILE, base.TOKENIZER_CONFIG_FILE}
    names |= {v for v in getattr(tokenizer, "vocab_files_names", {}).values() if isinstance(v, str)}
    return sorted(name for name in names if (folder / name).is_file())


def write_tokenizer_with_template(source: Path, output: Path, tokenizer, template: str,  # noqa: ANN001
                                  pad_token: str | None = None) -> Path:
    """A copy of `tokenizer` (loaded from `source`) at `output` with `template` as its one chat template (and
    `pad_token`, when given), written whole or not at all; the source's other templates are left out."""
    from transformers.utils.hub import CHAT_TEMPLATE_FILE

    if output.exists() and not (output / MARKER).is_file():
        raise DataError(f"--tokenizer-output {output}: exists and was not written by prepare-chat; remove it or "
                        "choose another folder")
    check_output_folder(output.parent, f"--tokenizer-output {output}", create=True)
    with atomic_folder(output) as tmp:  # plain mkdir and copies: the modes the umask gives
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
    return output


PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"},
         {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye."}]


def probe(tokenizer, what: str) -> None:  # noqa: ANN001
    """A DataError naming `what` unless the chat template renders a plain conversation with its content."""
    try:
        text = tokenizer.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja errors, the template's raise_exception
        why = " ".join(str(e).split())[:200]
        raise DataError(f"{what}: the chat template fails on a plain conversation ({why})") from None
    if not isinstance(text, str) or "Hello?" not in text or "Hi." not in text:
        raise DataError(f"{what}: the chat template leaves out the turns' content; check the template")


def special_texts(tokenizer) -> list[str]:  # noqa: ANN001
    """Text of every special token (BOS/EOS/pad and added ones such as reserved chat markers): inside a turn it
    would become that token, e.g. end the answer early or fake a turn."""
    texts = {tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token}
    texts |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return sorted(t for t in texts if isinstance(t, str) and t)


def reserved_pad(tokenizer) -> str | None:  # noqa: ANN001
    """A pad token reserved in the vocabulary (`<|pad|>` or `<pad>`, special) but not set as the pad token."""
    names = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return next((name for name in PAD_NAMES if name in names), None)
