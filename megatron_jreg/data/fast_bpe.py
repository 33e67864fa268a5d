"""Megatron-LM's token ids, faster: exact engines (tiktoken over ranks converted from the tokenizer, else the
`tokenizers` library's batch encoding) for the tokenizers people bring to preprocess, each checked against
megatron-core's own ids on a probe text when built (docs/results/preprocess_throughput.txt)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PROBE_TEXT = (
    "Hello world! It's 3.14159 o'clock; they'll  say \"naïve café\" — 東京 😀\n\n\tTabs   and"
    " spaces  \n x=y+1; don't I'VE 1234567 ｆｕｌｌ <tag> ... ?!"
)
# GPT-2's pre-tokenizer regex, as the `tokenizers` ByteLevel pre-tokenizer applies it with use_regex=True.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
SPACE = "▁"  # SentencePiece's whitespace; a SentencePiece plan's ranks write it as a space (sentencepiece_plan)


class NoConversion(Exception):
    """Why a tokenizer has no exact tiktoken conversion (the message ends the backend's description)."""


@dataclass
class Plan:
    """A tokenizer on tiktoken: `ranks`/`specials` for `tiktoken.Encoding`, `table[tiktoken id]` the tokenizer's id
    where they differ, the post-processor's `prefix`/`suffix`; text matching `uncovered` goes to the library's own
    encoder, runs matching `cut` (characters the model lacks, never merged) get `cut_ids`; `spelled[tiktoken id]`
    are the byte pieces of a partial character left alone (table -1: SentencePiece's byte fallback)."""

    pattern: str
    ranks: dict[bytes, int]
    specials: dict[str, int]
    table: np.ndarray | None = None
    prefix: list[int] = field(default_factory=list)
    suffix: list[int] = field(default_factory=list)
    uncovered: re.Pattern | None = None
    cut: re.Pattern | None = None
    cut_ids: Callable[[str], list[int]] | None = None
    spelled: dict[int, np.ndarray] | None = None


class TiktokenBPE:
    """tiktoken's engine over a `Plan`; `prepare` turns the text into what the ranks are of (SentencePiece's
    normalizer), `fallback` tokenizes a document the plan does not cover, from the original text."""

    name = "tiktoken"

    def __init__(self, plan: Plan, fallback: Callable[[str], list[int]],
                 prepare: Callable[[str], str] | None = None) -> None:
        import tiktoken

        self.encoding = tiktoken.Encoding("megatron-jreg", pat_str=plan.pattern, mergeable_ranks=plan.ranks,
                                          special_tokens=plan.specials)
        self._specials = set(plan.specials)
        self.plan, self.fallback, self.prepare = plan, fallback, prepare

    def _covered(self, text: str) -> bool:
        try:
            return self.plan.uncovered.search(text.encode("utf-8")) is None
        except UnicodeEncodeError:  # a lone surrogate: the library decides
            return False

    def _bpe(self, text: str) -> list[int] | np.ndarray:
        """tiktoken's ids; an array where the table maps them (no Python int made per token: ~20% less CPU).
        tiktoken's array encode wants a special token (without one it looks for one at every position)."""
        if not self._specials:
            return self.encoding.encode_ordinary(text)
        if self.plan.table is not None:
            return self.encoding.encode_to_numpy(text, allowed_special=self._specials, disallowed_special=())
        return self.encoding.encode(text, allowed_special=self._specials, disallowed_special=())

    def _pieces(self, text: str) -> np.ndarray:
        """BPE between the cut-out runs, the runs' own ids in place."""
        parts, at = [], 0
        for run in self.plan.cut.finditer(text):
            if run.group() in self._specials:  # a special token: tiktoken's to match
                continue
            parts += [self._bpe(text[at : run.start()]), self.plan.cut_ids(run.group())]
            at = run.end()
        return np.concatenate([*parts, self._bpe(text[at:])])

    def ids(self, text: str) -> list[int] | np.ndarray:
        """The ids of `text`: a list, or an int64 array where the plan maps tiktoken's ids (no copy back)."""
        plan = self.plan
        if plan.uncovered is not None and not self._covered(text):
            return list(self.fallback(text))
        prepared = self.prepare(text) if self.prepare else text
        ranks = self._pieces(prepared) if plan.cut is not None and plan.cut.search(prepared) else self._bpe(prepared)
        if plan.table is None:
            return plan.prefix + ranks + plan.suffix if plan.prefix or plan.suffix else ranks
        ranks = np.array(ranks, dtype=np.int64)
        ids = plan.table[ranks]
        if ids.size and ids.min() < 0:  # a partial character: a lacking one's bytes, else a bug never written
            at = np.flatnonzero(ids < 0)
            if plan.spelled is None or any(int(r) not in plan.spelled for r in ranks[at]):
                raise RuntimeError(f"tiktoken conversion: a partial character in {text[:60]!r}")
            parts = np.split(ids, at)  # each part after the first starts at a partial character
            ids = np.concatenate([parts[0], *(x for k, part in zip(at, parts[1:])
                                              for x in (plan.spelled[int(ranks[k])], part[1:]))])
        return np.concatenate([plan.prefix, ids, plan.suffix]) if plan.prefix or plan.suffix else ids

    def encode(self, text: str) -> list[int]:
        ids = self.ids(text)
        return ids.tolist() if isinstance(ids, np.ndarray) else ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def ids_batch(self, texts: list[str]) -> list[list[int] | np.ndarray]:
        return [self.ids(t) for t in texts]


class TokenizersBatch:
    """The `tokenizers` backend transformers calls for `tokenizer(text).input_ids`, once per batch (without
    transformers' Python per call); `canon` maps an id to its token string's id, as megatron-core's ids with
    --tokenizer-hf-no-include-special-tokens (`convert_tokens_to_ids(tokenize(text))`)."""

    name = "tokenizers"

    def __init__(self, hf: Any, with_specials: bool, canon: np.ndarray | None) -> None:
        self.backend = hf.backend_tokenizer
        self.backend.no_truncation()
        self.backend.no_padding()
        self.backend.encode_special_tokens = bool(getattr(hf, "split_special_tokens", False))
        self.with_specials, self.canon = with_specials, canon

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encodings = self.backend.encode_batch_fast(texts, add_special_tokens=self.with_specials)
        if self.canon is None:
            return [e.ids for e in encodings]
        return [self.canon[np.array(e.ids, dtype=np.int64)].tolist() for e in encodings]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    ids_batch = encode_batch


Engine = TiktokenBPE | TokenizersBatch


# ---------------------------------------------------------------------------------------------------------------
# Byte-level BPE (tokenizer.json) on tiktoken.


def _pattern(pre: dict | None) -> str:
    """tiktoken's pattern for a byte-level pre-tokenizer, or NoConversion."""
    pre = pre or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"]:
        (byte_level,) = steps
        if byte_level.get("add_prefix_space"):
            raise NoConversion("a ByteLevel pre-tokenizer with add_prefix_space")
        return GPT2_PATTERN if byte_level.get("use_regex", True) else r"(?s:.+)"
    if kinds == ["Split", "ByteLevel"]:
        split, byte_level = steps
        regex = (split.get("pattern") or {}).get("Regex")
        if (split.get("behavior") != "Isolated" or split.get("invert") or regex is None
                or byte_level.get("use_regex", True) or byte_level.get("add_prefix_space")):
            raise NoConversion("a Split/ByteLevel pre-tokenizer other than Llama-3's (Isolated regex, no prefix space)")
        # `tokenizers` keeps the text between matches as pieces too; tiktoken encodes matches only.
        return rf"(?:{regex})|(?:(?!(?:{regex}))(?s:.))+"
    raise NoConversion(f"pre-tokenizer {'+'.join(map(str, kinds)) or None}")


def _template_ids(processor: dict | None) -> tuple[list[int], list[int]]:
    """Ids a post-processor puts before/after a single sequence, or NoConversion."""
    kind = (processor or {}).get("type")
    if kind in (None, "ByteLevel"):
        return [], []
    if kind == "Sequence":
        parts = [_template_ids(sub) for sub in processor["processors"]]
        return [i for before, _ in parts for i in before], [i for _, after in reversed(parts) for i in after]
    if kind in ("RobertaProcessing", "BertProcessing"):
        return [processor["cls"][1]], [processor["sep"][1]]
    if kind != "TemplateProcessing":
        raise NoConversion(f"post-processor {kind}")
    ids: tuple[list[int], list[int]] = ([], [])
    after = 0
    for piece in processor["single"]:
        if "Sequence" in piece:
            after = 1
        else:
            ids[after].extend(processor["special_tokens"][piece["SpecialToken"]["id"]]["ids"])
    return ids


def _overlap(a: str, b: str) -> bool:
    """Whether occurrences of `a` and `b` can overlap in a text (one inside the other, or a suffix of one
    starting the other)."""
    return a in b or b in a or any(a.endswith(b[:k]) or b.endswith(a[:k]) for k in range(1, min(len(a), len(b))))


def _added_tokens(added: list[dict], split_special: bool) -> dict[str, int]:
    """The added tokens `tokenizers` matches in the text (all but the special ones under split_special_tokens),
    or NoConversion where its matching is not tiktoken's leftmost-longest split before BPE."""
    matched = [t for t in added if t.get("content") and not (split_special and t.get("special"))]
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in matched):
        raise NoConversion("added tokens with lstrip/rstrip/single_word")
    # `tokenizers` splits the non-normalized ones out first, then the normalized ones: one pass where none overlap.
    raw = [t["content"] for t in matched if not t.get("normalized")]
    normalized = [t["content"] for t in matched if t.get("normalized")]
    if any(_overlap(a, b) for a in raw for b in normalized):
        raise NoConversion("normalized and non-normalized added tokens that overlap")
    # Longest first: tiktoken matches special tokens leftmost-first, `tokenizers` leftmost-longest.
    return {t["content"]: t["id"] for t in sorted(matched, key=lambda t: -len(t["content"]))}


def _merge_pairs(merges: list) -> list[tuple[str, str]]:
    """tokenizer.json's merges ("a b" strings, or [a, b] lists since tokenizers 0.20) as pairs."""
    pairs = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    bad = next((m for m in pairs if len(m) != 2), None)
    if bad is not None:
        raise NoConversion(f"a merge that is not a pair ({bad!r})")
    return pairs


def _check_merges_make_their_pieces(model: dict, merges: list[tuple[str, str]], pieces: list[str]) -> None:
    """NoConversion unless `tokenizers`' merges, applied to each piece's characters alone, make that piece (why:
    DEVELOPERS.md, "fast_bpe.py"). A trained tokenizer has this property; a merge list edited by hand may not."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    vocab = model["vocab"]
    alone = Backend(BPE(vocab, merges, unk_token=model.get("unk_token"),
                        fuse_unk=bool(model.get("fuse_unk")), byte_fallback=bool(model.get("byte_fallback"))))
    made = alone.encode_batch_fast(pieces, add_special_tokens=False)
    wrong = next((p for p, e in zip(pieces, made) if e.ids != [vocab[p]]), None)
    if wrong is not None:
        raise NoConversion(f"merges that do not make the piece {wrong!r} from its characters")


def byte_level_plan(spec: dict, split_special: bool = False) -> Plan:
    """A byte-level BPE tokenizer.json (as a dict) on tiktoken, or NoConversion naming what has none."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise NoConversion(f"model type {model.get('type')}")
    if model.get("dropout") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise NoConversion("BPE dropout or subword prefix/suffix")
    if spec.get("normalizer") is not None:
        raise NoConversion("a normalizer")
    pattern = _pattern(spec.get("pre_tokenizer"))
    prefix, suffix = _template_ids(spec.get("post_processor"))
    specials = _added_tokens(spec.get("added_tokens") or [], split_special)
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte -> printable character map

    to_char = bytes_to_unicode()
    alphabet = {ord(c): b for b, c in to_char.items()}
    latin = {**dict.fromkeys(range(256), 0xFFFF), **alphabet}  # a raw character below 256 is outside the alphabet

    def as_bytes(piece: str) -> bytes | None:  # None: a piece no byte-level text can reach
        try:
            return piece.translate(latin).encode("latin-1")
        except UnicodeEncodeError:
            return None

    vocab: dict[str, int] = model.get("vocab") or {}
    merges = _merge_pairs(model.get("merges") or [])
    order = {pair: i for i, pair in enumerate(merges)}  # as `tokenizers` builds its merge map: a repeated pair
    # keeps its last index
    made: dict[str, int] = {}  # merged piece (byte-level characters) -> its id, in merge order
    for a, b in merges if len(order) == len(merges) else sorted(order, key=order.__getitem__):
        piece = a + b
        if piece in made:
            raise NoConversion(f"a piece made by two merges ({piece!r})")
        if piece not in vocab:
            raise NoConversion(f"a merge whose piece is not in the vocabulary ({piece!r})")
        made[piece] = vocab[piece]
    singles = {b: vocab[c] for b, c in to_char.items() if c in vocab}
    present = {c for c in to_char.values() if c in vocab}
    if len(present) < 256:  # a piece holding a lacking byte is unreachable
        made = {p: i for p, i in made.items() if set(p) <= present}
    _check_merges_make_their_pieces(model, merges, [p for p in made if len(p) > 2])  # two: made by their merge
    if model.get("ignore_merges"):  # a whole pre-token found in the vocabulary is one token, merges or not
        matched = {s.encode("utf-8") for s in specials}
        unmade = [p for p in vocab if len(p) > 1 and p not in made and set(p) <= present
                  and as_bytes(p) not in matched]
        if unmade:
            raise NoConversion(f"ignore_merges with vocabulary pieces no merge makes ({unmade[0]!r})")
    # tiktoken's ranks are its output ids: the vocabulary's ids where they rise with the merge index.
    # as_bytes of each piece, in one pass (they hold alphabet characters only)
    merged = "\x00".join(made).translate({**latin, 0: 0}).encode("latin-1").split(b"\x00") if made else []
    merged_ids = list(made.values())
    ids = [*singles.values(), *merged_ids]
    in_order = all(a < b for a, b in zip(merged_ids, merged_ids[1:])) and len(set(ids)) == len(ids)
    table = None
    if in_order:
        ranks = {bytes([b]): i for b, i in singles.items()}
        ranks.update(zip(merged, merged_ids))
    else:
        ranks = {bytes([b]): r for r, b in enumerate(singles)}
        ranks.update({p: len(singles) + r for r, p in enumerate(merged)})
        table = np.array([*singles.values(), *merged_ids, *specials.values()], dtype=np.int64)
        specials = {s: len(ranks) + k for k, s in enumerate(specials)}
    missing = [b for b in range(256) if b not in singles]
    uncovered = re.compile(b"[" + b"".join(re.escape(bytes([b])) for b in missing) + b"]") if missing else None
    return Plan(pattern, ranks, specials, table, prefix, suffix, uncovered)


# ---------------------------------------------------------------------------------------------------------------
# SentencePiece BPE on tiktoken.

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_BPE = 2  # TrainerSpec.model_type


def _char_class(chars: list[str]) -> str:
    """A regex character class of `chars`, as code point ranges."""
    points = sorted(map(ord, chars))
    spans: list[list[int]] = []
    for p in points:
        if spans and p == spans[-1][1] + 1:
            spans[-1][1] = p
        else:
            spans.append([p, p])
    return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in spans)


def _check_merges_make_their_pieces_sp(rank: dict[str, int]) -> None:
    """NoConversion unless sentencepiece's merges (the adjacent pair whose concatenation ranks first), applied
    to each piece's characters alone, make that piece (as `_check_merges_make_their_pieces`)."""
    never = len(rank)
    for piece in rank:
        parts = list(piece)
        pairs = [rank.get(a + b, never) for a, b in zip(parts, parts[1:])]  # rank of the pair at k, k + 1
        while pairs:
            best = min(pairs)
            if best == never:
                raise NoConversion(f"merges that do not make the piece {piece!r} from its characters")
            k = pairs.index(best)
            parts[k : k + 2] = [parts[k] + parts[k + 1]]
            del pairs[k]
            if k > 0:
                pairs[k - 1] = rank.get(parts[k - 1] + parts[k], never)
            if k < len(pairs):
                pairs[k] = rank.get(parts[k] + parts[k + 1], never)


def sentencepiece_plan(model_proto: bytes) -> Plan:
    """A SentencePiece BPE model (its serialized ModelProto) on tiktoken, or NoConversion."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as e:  # protobuf missing
        raise NoConversion(f"the model cannot be read ({e})") from None
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(model_proto)
    if model.trainer_spec.model_type != _BPE:
        raise NoConversion("a SentencePiece model that is not BPE (unigram: no merges to convert)")
    if model.trainer_spec.treat_whitespace_as_suffix:
        raise NoConversion("treat_whitespace_as_suffix")
    pieces = list(model.pieces)
    if any(p.type == _UNUSED for p in pieces):
        raise NoConversion("unused pieces")
    normal = [(i, p) for i, p in enumerate(pieces) if p.type == _NORMAL]
    chars = {p.piece: i for i, p in normal if len(p.piece) == 1}
    merged = sorted(((p.score, i, p.piece) for i, p in normal if len(p.piece) > 1), key=lambda s: (-s[0], s[1]))
    if any(a[0] == b[0] for a, b in zip(merged, merged[1:])):
        raise NoConversion("pieces of equal score (sentencepiece breaks such ties by position, tiktoken cannot)")
    if any(SPACE in piece[1:] for _, _, piece in merged):
        raise NoConversion(f"pieces with {SPACE} past their first character")
    if SPACE not in chars:
        raise NoConversion(f"no {SPACE} piece")
    if any(not set(piece) <= chars.keys() for _, _, piece in merged):
        raise NoConversion("pieces holding a character that is not a piece itself")
    user = {p.piece: i for i, p in enumerate(pieces) if p.type == _USER_DEFINED}
    if any(not s or SPACE in s or any(c.isspace() for c in s) for s in user):
        raise NoConversion("user-defined symbols with whitespace")
    if not model.normalizer_spec.escape_whitespaces or " " in chars:
        raise NoConversion("whitespace that is not escaped as ▁")
    _check_merges_make_their_pieces_sp({piece: r for r, (_, _, piece) in enumerate(merged)})
    # The normalized text has no space (every one is ▁, three bytes in UTF-8): ▁ is written as a space, one byte,
    # so that tiktoken need not assemble it in every word.
    chars = {c.replace(SPACE, " "): i for c, i in chars.items()}
    merged = [(score, i, piece.replace(SPACE, " ")) for score, i, piece in merged]
    # A multi-byte character is assembled from its bytes before any merge: its byte prefixes and the character
    # itself take the lowest ranks (output id -1 for a prefix, never emitted: every character is complete).
    assembly: dict[bytes, int] = {}
    for c, i in chars.items():
        encoded = c.encode("utf-8")
        for k in range(2, len(encoded)):
            assembly.setdefault(encoded[:k], -1)
        assembly[encoded] = i
    ranks = {piece: r for r, piece in enumerate(assembly)}
    ranks.update({piece.encode("utf-8"): len(assembly) + r for r, (_, _, piece) in enumerate(merged)})
    # ▁ a special token too, never matched (the prepared text has spaces instead): TiktokenBPE._bpe wants one
    symbols = sorted(user, key=len, reverse=True)
    specials = {s: len(ranks) + k for k, s in enumerate([*symbols, SPACE])}
    # A character that is not a piece stays alone: its UTF-8 bytes as byte pieces (byte fallback), else one
    # unknown piece for a run of them (sentencepiece merges adjacent unknown pieces).
    base = len(ranks) + len(specials)
    by_piece = {p.piece: i for i, p in enumerate(pieces)}
    if model.trainer_spec.byte_fallback:
        lacking = [by_piece.get(f"<0x{b:02X}>", -1) for b in range(256)]
        if min(lacking) < 0:
            raise NoConversion("byte fallback without all 256 byte pieces")
        # Each byte is a piece of its own (tiktoken id base + b, its byte piece), so a lacking character stays
        # bytes, or a prefix it shares with a character the model has plus bytes: `spelled` writes that out.
        ranks.update({bytes([b]): base + b for b in range(256) if bytes([b]) not in ranks})
    else:
        unknown = [i for i, p in enumerate(pieces) if p.type == _UNKNOWN]
        if len(unknown) != 1:
            raise NoConversion("no single unknown piece")
        lacking = unknown
    table = np.array([*assembly.values(), *(i for _, i, _ in merged), *(user.get(s, -1) for s in specials),
                      *lacking], dtype=np.int64)
    if model.trainer_spec.byte_fallback:
        spelled = {ranks[p]: table[[base + b for b in p]] for p, i in assembly.items() if i < 0}
        return Plan(r" [^ ]*|[^ ]+", ranks, specials, table, spelled=spelled)
    lacking_run = f"[^{_char_class(list(chars))}]"
    if symbols:  # a user-defined symbol is matched before anything is cut: the regex steps over it whole
        either = "|".join(map(re.escape, symbols))
        lacking_run = f"(?:{either})|(?:(?!(?:{either})){lacking_run})"
    return Plan(r" [^ ]*|[^ ]+", ranks, specials, table, cut=re.compile(lacking_run + "+"), cut_ids=lambda _: [base])


# ---------------------------------------------------------------------------------------------------------------
# Choosing the engine.


def _canon(hf: Any) -> np.ndarray | None:
    """id -> the id of its token string (megatron-core's ids without special tokens go through the strings),
    or None where every id maps to itself."""
    backend = hf.backend_tokenizer
    size = backend.get_vocab_size(with_added_tokens=True)
    unk = hf.unk_token_id if hf.unk_token_id is not None else -1
    canon = np.arange(size, dtype=np.int64)
    for i in range(size):
        token = backend.id_to_token(i)
        found = backend.token_to_id(token) if token is not None else None
        canon[i] = unk if found is None else found
    return None if (canon == np.arange(size)).all() else canon


def _checked(engine: Engine, reference: Callable[[str], Any], specials: list[str]) -> str | None:
    """None when `engine` gives `reference`'s ids on the probes, else the first text where it does not. Probes: the
    probe text whole and word by word (so that a covered word is checked where the whole text falls back), and each
    added token inside and beside words."""
    probes = [PROBE_TEXT, *PROBE_TEXT.split(" "), *(f" a{t}b {t}" for t in specials), "".join(specials)]
    got = engine.encode_batch(probes)
    return next((p for p, ids in zip(probes, got) if ids != list(reference(p))), None)


def engine_for(kind: str, library: Any, reference: Callable[[str], Any]) -> tuple[Engine | None, str]:
    """The fastest exact engine for megatron-core's tokenizer library object `library` of type `kind` (its
    `tokenize` is `reference`), or None, and the backend's description (what preprocess prints: why not faster;
    TikTokenizer's and NullTokenizer's are fast already)."""
    if kind in ("HuggingFaceTokenizer", "GPT2BPETokenizer"):
        return _hf_engine(library, reference)
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        return _sp_engine(library, reference)
    return None, "megatron-core (tiktoken)" if kind == "TikTokenizer" else "megatron-core (ids in the text)"


def _hf_engine(library: Any, reference: Callable[[str], Any]) -> tuple[Engine | None, str]:
    hf, with_specials = library.tokenizer, library.include_special_tokens
    if not hasattr(hf, "backend_tokenizer"):
        return None, "megatron-core (no fast path: a slow transformers tokenizer)"
    spec = json.loads(hf.backend_tokenizer.to_str())
    added = [t["content"] for t in spec.get("added_tokens") or [] if t.get("content")]
    canon = None if with_specials else _canon(hf)
    batch = TokenizersBatch(hf, with_specials, canon)
    try:
        plan = byte_level_plan(spec, bool(getattr(hf, "split_special_tokens", False)))
    except NoConversion as e:
        why = f"no exact tiktoken conversion: {e}"
    else:
        if not with_specials:
            plan.prefix = plan.suffix = []
        if canon is not None:  # compose: tiktoken id -> vocabulary id -> id of its token string
            top = max([*plan.ranks.values(), *plan.specials.values()], default=0)
            plan.table = canon[plan.table if plan.table is not None else np.arange(top + 1)]
        engine = TiktokenBPE(plan, batch.encode)
        bad = _checked(engine, reference, added)
        if bad is None:
            return engine, "tiktoken"
        why = f"the tiktoken conversion disagreed on the probe text {bad[:40]!r}"
    bad = _checked(batch, reference, added)
    if bad is None:
        return batch, f"tokenizers ({why})"
    return None, f"megatron-core (no fast path: {why}; tokenizers' batch encoding disagreed on {bad[:40]!r})"


def _sp_engine(library: Any, reference: Callable[[str], Any]) -> tuple[Engine | None, str]:
    processor = library.tokenizer
    if library.legacy or (library.removed_extra_spaces and not library.ignore_extra_whitespaces):
        return None, ("megatron-core (no fast path: --tokenizer-sentencepiece-legacy or "
                      "--no-tokenizer-sentencepiece-ignore-extra-whitespaces reshape the text in Python)")
    try:
        plan = sentencepiece_plan(processor.serialized_model_proto())
    except NoConversion as e:
        return None, f"megatron-core (no fast path: no exact tiktoken conversion: {e})"
    normalize = processor.normalize
    engine = TiktokenBPE(plan, processor.encode_as_ids, prepare=lambda text: normalize(text).replace(SPACE, " "))
    bad = _checked(engine, reference, [])
    if bad is not None:
        return None, f"megatron-core (no fast path: the tiktoken conversion disagreed on the probe text {bad[:40]!r})"
    return engine, "tiktoken"
