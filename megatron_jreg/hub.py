"""Hugging Face models on this machine, offline: hub ids resolved by huggingface_hub from the local cache, never a
download, plus what the library lacks (DEVELOPERS.md, "The offline hub cache"); `load_causal_lm` refuses
partial loads."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megatron_jreg.errors import IncompleteWeightsError, ModelFileError
from megatron_jreg.model_files import inspect_model_folder

_HASH = re.compile(r"^[0-9a-f]{40}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
SHOWN_KEYS = 3  # keys named in an error line before "... and N more"


class HubError(ModelFileError):
    """A model that is neither a local path nor in the Hugging Face cache; the message says where we looked."""


def hub_cache() -> Path:
    """huggingface_hub's cache folder ($HF_HUB_CACHE, else $HF_HOME/hub, ..., as it read them at import)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _repo_folder(repo_id: str) -> str:
    from huggingface_hub.file_download import repo_folder_name

    return repo_folder_name(repo_id=repo_id, repo_type="model")


def _looks_like_id(spec: str) -> bool:
    """`org/name[@rev][/path...]` or `name`: no absolute, home or dot-relative paths, no empty parts."""
    if not spec or spec.startswith(("/", "~", ".")) or "\\" in spec:
        return False
    head, _, _ = spec.partition("@")
    return all(_NAME.match(part) for part in head.split("/")) and "//" not in spec


def _split(spec: str) -> list[tuple[str, str | None, str]]:
    """Candidate (repo id, revision, path inside the snapshot) readings of `spec`: `org/name/file.gguf` as a file of
    repo org/name first (as the Hub's own ids are), then as more path of a one-part legacy id."""
    out = []
    parts = spec.split("/")
    for n in (2, 1) if len(parts) > 1 else (1,):
        repo, rest = "/".join(parts[:n]), "/".join(parts[n:])
        if "@" in rest and "@" not in repo:
            continue  # a revision belongs right after the repo id
        repo, at, revision = repo.partition("@")
        out.append((repo, revision if at else None, rest))
    return out


def _snapshot(cache: Path, repo_id: str, revision: str | None, flag: str) -> Path:
    """The cached snapshot of `revision` (a branch, tag, commit or its prefix), by huggingface_hub; else why not."""
    from huggingface_hub import snapshot_download as cached_snapshot
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_dir = cache / _repo_folder(repo_id)
    snapshots = repo_dir / "snapshots"
    available = sorted(p.name for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    commit = named = revision or "main"
    if not (repo_dir / "refs" / named).is_file():  # what huggingface_hub does not resolve itself
        matches = [h for h in available if h.startswith(revision)] if revision else available
        commit = matches[0] if len(matches) == 1 else named  # a hash prefix; a copy without refs/
    try:
        return Path(cached_snapshot(repo_id, revision=commit, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError) as e:  # ValueError: an id huggingface_hub does not accept
        reason = " ".join(str(e).split())
    shown = ", ".join(h[:12] for h in available)
    if not available:
        why = f"{repo_dir} holds no snapshot (an interrupted download)"
    elif "incomplete" in reason:
        why = reason.split(". ")[0]  # huggingface_hub's cached file listing names the missing files
    elif (repo_dir / "refs" / named).is_file():
        target = (repo_dir / "refs" / named).read_text(encoding="utf-8").strip()
        why = f"refs/{named} points to commit {target[:12]}, which is not in {snapshots}"
    elif revision is not None:
        why = f"no such branch, tag or commit in {repo_dir} (snapshots: {shown})"
    else:
        why = f"{repo_dir} has no refs/main and {len(available)} snapshots; choose one with {repo_id}@COMMIT ({shown})"
    raise HubError(f"{flag} {repo_id}{f'@{revision}' if revision else ''}: {why}; run `hf download {repo_id}"
                   f"{f' --revision {revision}' if revision else ''}` on a machine with internet and copy "
                   f"{repo_dir} here, or pass {repo_id}@COMMIT of a snapshot that is there") from None


def _check_links(folder: Path, flag: str, repo_id: str) -> None:
    """Snapshot files are symlinks into blobs/; a dangling one is a file whose download never finished."""
    for path in sorted(folder.rglob("*")):
        if path.is_symlink() and not path.exists():
            raise HubError(f"{flag} {repo_id}: {path.relative_to(folder)} in {folder} points to a blob that is not "
                           f"there (an incomplete download); run `hf download {repo_id}` again and copy the cache here")


def resolve(spec: str | Path, flag: str = "--model", cache: Path | None = None) -> Path:
    """A local path for `spec`: the path itself when it exists, else its snapshot in the hub cache."""
    text = str(spec)
    local = Path(text).expanduser()
    if local.exists() or not _looks_like_id(text):
        return local
    cache = cache or hub_cache()
    readings = _split(text)
    for repo_id, revision, rest in readings:
        if not (cache / _repo_folder(repo_id)).is_dir():
            continue
        folder = _snapshot(cache, repo_id, revision, flag)
        _check_links(folder, flag, repo_id)
        target = folder / rest if rest else folder
        if not target.exists():
            raise HubError(f"{flag} {text}: the cached snapshot {folder} of {repo_id} has no {rest}; "
                           f"list it with `ls {folder}` and name a file that is there")
        return target
    repo_id = readings[0][0] if readings else text
    raise HubError(f"{flag} {text}: no such file or folder, and no {_repo_folder(repo_id)} in the Hugging Face cache "
                   f"{cache} (HF_HUB_CACHE); on a machine with internet run `hf download {repo_id}` and copy the cache "
                   "here, or pass a local folder")


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face hub (its ENDPOINT, through the HTTPS proxy when set) cannot be reached, in one try of
    `timeout` seconds where huggingface_hub retries for a minute; None when a TCP connection opens."""
    import socket
    import threading
    import urllib.parse
    import urllib.request

    from huggingface_hub import constants

    endpoint = urllib.parse.urlsplit(constants.ENDPOINT)
    proxy = urllib.request.getproxies().get(endpoint.scheme)
    target = urllib.parse.urlsplit(proxy if "://" in (proxy or "://") else f"http://{proxy}") if proxy else endpoint
    host, port = target.hostname or "", target.port or (443 if target.scheme == "https" else 80)
    answer: list[str | None] = []

    def connect() -> None:  # in a thread: name resolution has no timeout of its own
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            answer.append(None)
        except OSError as e:
            answer.append(f"{host}: {e.strerror or e}")

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return answer[0] if answer else f"{host}: no answer within {timeout:g} s"


def describe(path: Path) -> str | None:
    """`org/name@<commit>` for a path inside a hub-cache snapshot, else None (for result records)."""
    parts = Path(path).resolve().parts
    for i in range(len(parts) - 2):
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots" and _HASH.match(parts[i + 2]):
            return parts[i][len("models--") :].replace("--", "/") + "@" + parts[i + 2]
    return None


# Loading a folder, refusing one whose weights do not all load.
def named_keys(keys: Iterable[str]) -> str:
    """The first SHOWN_KEYS of `keys`, sorted, then "and N more": how an error line names many weights."""
    keys = sorted(keys)
    shown = ", ".join(keys[:SHOWN_KEYS])
    return shown + (f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else "")


def check_loading_info(info: dict[str, Any], model_class: str, where: str, ignore: Iterable[str] = ()) -> None:
    """IncompleteWeightsError when a loading report has missing, unexpected or misshaped keys (but `ignore`d ones)."""
    skip = tuple(ignore)
    problems = []
    for field, what in (("missing_keys", "missing from the files (they would be random)"),
                        ("unexpected_keys", "in the files but not in the model"),
                        ("mismatched_keys", "of the wrong shape")):
        keys = [k if isinstance(k, str) else str(k[0]) for k in info.get(field) or ()]
        keys = [k for k in keys if not (skip and k.startswith(skip))]
        if keys:
            problems.append(f"{len(keys)} weight(s) {what}: {named_keys(keys)}")
    if problems:
        raise IncompleteWeightsError(f"{where}: the weights do not match {model_class}: {'; '.join(problems)}. The "
                                     "files are incomplete or for another architecture: download or convert the model "
                                     "again")


def load_causal_lm(folder: Path, *, where: str, ignore: Iterable[str] = (), allow_pickle: bool = False,
                   checked: bool = False, **kwargs: Any) -> Any:
    """`AutoModelForCausalLM.from_pretrained` (local files, no remote code) after `inspect_model_folder` (unless
    `checked`), refusing missing, unused or misshaped weights in one line starting with `where`, in place of
    transformers' own report (ignore_mismatched_sizes: shapes are reported here, not raised as a RuntimeError)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if kwargs.get("gguf_file") is None:
        if not checked:
            inspect_model_folder(folder, where.partition(" ")[0], allow_pickle=allow_pickle)
        if not allow_pickle:
            kwargs["use_safetensors"] = True  # transformers never unpickles a .bin beside them
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if not sys.stderr.isatty():  # its "Loading weights" bar, redrawn into a log file, is only noise there
        hf_logging.disable_progress_bar()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=False, output_loading_info=True,
            ignore_mismatched_sizes=True, **kwargs,
        )  # fmt: skip
    except SafetensorError as e:
        raise ModelFileError(f"{where}: a safetensors file cannot be read ({e}); download the model again") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    check_loading_info(info, type(model).__name__, where, ignore)
    return model


def force_offline() -> None:
    """Keep every Hugging Face library on local files for the rest of the process. The libraries read their
    offline switches at import, so the flags of modules already imported are set too."""
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if (hub := sys.modules.get("huggingface_hub.constants")) is not None:
        hub.HF_HUB_OFFLINE = True
    if (datasets_config := sys.modules.get("datasets.config")) is not None:
        datasets_config.HF_HUB_OFFLINE = True
        datasets_config.HF_DATASETS_OFFLINE = True
