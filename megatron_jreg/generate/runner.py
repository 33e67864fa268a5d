"""The generate run: a model and its Hugging Face chat tokenizer (so a conversation is tokenized as `--sft` trained
on it), every question answered turn by turn as FastChat's gen_model_answer.py does."""

from __future__ import annotations

import hashlib
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_jreg.dtypes import torch_dtype
from megatron_jreg.errors import UsageError
from megatron_jreg.evaluate.decoding import Sampling, complete
from megatron_jreg.evaluate.models import check_model_flags
from megatron_jreg.fileio import check_output_folder
from megatron_jreg.generate.questions import Question, answer_record, read_answers, read_questions, write_answers
from megatron_jreg.progress import progress_bar, show_progress

_HF_TOKENIZER_TYPES = ("HuggingFaceTokenizer", "SFTTokenizer")


@dataclass(frozen=True)
class GenerateConfig:
    """What to answer, with which model, how: a field per flag of generate/cli.py."""

    prompts: Path
    output: Path | str  # a str keeps a trailing "/" (a folder meant), which Path drops
    hf: Path | None = None
    load: Path | None = None
    iteration: int | None = None
    tokenizer: Path | None = None  # --load: a Hugging Face tokenizer folder instead of the run's own
    chat_template: str | None = None
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 8
    model_id: str | None = None  # default: the model folder's name (its parent's for ".../checkpoints")
    device: str | None = None
    dtype: str = "auto"
    progress: bool | None = None  # None: when stderr is a terminal

    def __post_init__(self) -> None:
        check_model_flags(self.hf, self.load, self.iteration)
        if self.tokenizer is not None:
            if self.load is None:
                raise UsageError("--tokenizer replaces a checkpoint's tokenizer: use it with --load (an --hf folder "
                                  "has its own)")
            if not Path(self.tokenizer).is_dir():
                raise UsageError(f"--tokenizer {self.tokenizer}: no such folder (a Hugging Face tokenizer folder)")
        if not Path(self.prompts).is_file():
            what = "is a folder" if Path(self.prompts).is_dir() else "no such file"
            raise UsageError(f"--prompts {self.prompts}: {what}; give a question JSONL file (FastChat's MT-bench "
                              "format, e.g. examples/sft/data/wikitext_questions.jsonl)")
        for flag, value, least in (("--max-new-tokens", self.max_new_tokens, 1), ("--batch-size", self.batch_size, 1),
                                   ("--seed", self.seed, 0), ("--iteration", self.iteration, 0)):
            if value is not None and value < least:
                raise UsageError(f"{flag} must be >= {least}, got {value}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise UsageError(f"--temperature must be a finite number >= 0 (0: greedy), got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.model_id is not None and not self.model_id.strip():
            raise UsageError("--model-id must not be empty (FastChat's judge names the model by it)")
        out = Path(self.output)
        if str(self.output).endswith(("/", os.sep)) or out.is_dir():
            raise UsageError(f"--output {self.output} is a folder; give the answer file, e.g. {out / 'model.jsonl'}")
        if out.resolve() == Path(self.prompts).resolve():
            raise UsageError(f"--output {self.output} is the --prompts file; write the answers to another file")
        check_output_folder(out.parent, f"--output {self.output}", create=True)  # created, and proven writable

    @property
    def name(self) -> str:
        if self.model_id is not None:
            return self.model_id
        folder = Path(self.hf or self.load).resolve()
        return folder.parent.name if folder.name in ("checkpoints", "checkpoint", "ckpt") else folder.name


@dataclass
class ChatModel:
    """A CausalLM with the Hugging Face tokenizer that renders its chats."""

    lm: object  # megatron_jreg.evaluate.models.CausalLM
    tokenizer: object  # transformers tokenizer
    template: str | None  # None: the tokenizer's own
    template_name: str
    stop_ids: set[int]
    stop_texts: tuple[str, ...] = ()

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, chat_template=self.template, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(i) for i in ids]

    def answer_text(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((text.find(s) for s in self.stop_texts if s in text), default=len(text))
        return text[:cut].strip()

    def stopped(self, _row: int, ids: list[int]) -> bool:
        if not self.stop_texts:
            return False
        tail = self.tokenizer.decode(ids[-16:], skip_special_tokens=False)
        return any(s in tail for s in self.stop_texts)


def _template(cfg: GenerateConfig, tokenizer) -> tuple[str | None, str, tuple[str, ...]]:  # noqa: ANN001
    from megatron_jreg.data.chat import SIMPLE_STOP_TEXTS, SIMPLE_TEMPLATE, load_template, own_template

    if cfg.chat_template is not None:
        text, name = load_template(cfg.chat_template)
    elif own_template(tokenizer) is not None:
        text, name = None, "the tokenizer's own"
    else:
        text, name = SIMPLE_TEMPLATE, "simple (the tokenizer has none)"
    rendered = text or own_template(tokenizer)
    return text, name, SIMPLE_STOP_TEXTS if rendered == SIMPLE_TEMPLATE else ()


def load_chat_model(cfg: GenerateConfig) -> ChatModel:
    from megatron_jreg.data.chat import load_hf_tokenizer

    if cfg.hf is not None:
        from megatron_jreg.evaluate.models import load_hf_lm

        lm = load_hf_lm(cfg.hf, cfg.device, cfg.dtype)
        tokenizer = lm.tokenizer
        eos = lm.model.generation_config.eos_token_id  # generation_config.json's too (e.g. Llama-3's <|eot_id|>)
        stop = {lm.eod, *(eos if isinstance(eos, list) else [] if eos is None else [eos])}
    else:
        from megatron_jreg.checkpoints import load_megatron_model
        from megatron_jreg.data.tokenizers import build_tokenizer
        from megatron_jreg.evaluate.models import MegatronCausalLM

        dtype = torch_dtype("float32" if cfg.dtype == "auto" else cfg.dtype)
        loaded = load_megatron_model(cfg.load, cfg.iteration, dtype=dtype, load_tokenizer=False)
        kind, folder = getattr(loaded.args, "tokenizer_type", None), getattr(loaded.args, "tokenizer_model", None)
        if cfg.tokenizer is not None:
            folder = str(cfg.tokenizer)
        elif kind not in _HF_TOKENIZER_TYPES or not folder:
            raise UsageError(f"--load {cfg.load}: the run's tokenizer is {kind}; generate renders chats with a "
                              "Hugging Face tokenizer: pass --tokenizer DIR (a Hugging Face folder, same vocabulary)")
        elif not Path(folder).is_dir():
            raise UsageError(f"--load {cfg.load}: the run's tokenizer folder {folder} is gone; pass its current path "
                              "with --tokenizer DIR")
        tokenizer = load_hf_tokenizer(folder, "--tokenizer")
        loaded.tokenizer = build_tokenizer("HuggingFaceTokenizer", folder)  # the vocabulary MegatronCausalLM reads
        padded = int(getattr(loaded.args, "padded_vocab_size", 0) or 0)
        if padded and len(tokenizer) > padded:
            raise UsageError(f"--tokenizer {folder}: {len(tokenizer)} tokens, more than the model's {padded} "
                              "embedding rows; give the tokenizer the checkpoint was trained with")
        lm = MegatronCausalLM(loaded)
        stop = {lm.eod}
    if tokenizer.eos_token_id is not None:
        stop.add(int(tokenizer.eos_token_id))
    template, name, stop_texts = _template(cfg, tokenizer)
    for text in stop_texts:  # a turn marker reserved as one token: stop on its id too
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            stop.add(int(ids[0]))
    return ChatModel(lm, tokenizer, template, name, stop, stop_texts)


@dataclass
class GenerateSummary:
    answered: int = 0
    resumed: int = 0
    turns: int = 0
    finish: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "window": 0})
    truncated_prompts: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    template: str = ""
    output: str = ""

    def describe(self) -> str:
        rate = self.new_tokens / self.seconds if self.seconds else 0.0
        line = (f"wrote {self.output}: {self.answered} new answers ({self.resumed} already there), {self.turns} turns, "
                f"{self.new_tokens} tokens in {self.seconds:.1f}s ({rate:.1f} tokens/s); ends: "
                f"{self.finish['stop']} at a stop token, {self.finish['length']} at --max-new-tokens, "
                f"{self.finish['window']} at the context window; chat template: {self.template}")
        if self.truncated_prompts:
            line += f"; {self.truncated_prompts} prompts cut on the left to fit the context window"
        return line


def question_generator(seed: int, question_id: int | str) -> torch.Generator:
    """A generator seeded by (seed, question id) only: the same draws in any batch and after a resume."""
    digest = hashlib.sha256(f"{seed}\0{question_id!r}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def answer_batch(
    model: ChatModel, batch: list[Question], cfg: GenerateConfig, summary: GenerateSummary
) -> list[list[str]]:
    sampling = Sampling(cfg.temperature, cfg.top_p)
    generators = [None if sampling.greedy else question_generator(cfg.seed, q.question_id) for q in batch]
    history: list[list[dict]] = [[] for _ in batch]
    answers: list[list[str]] = [[] for _ in batch]
    window = int(model.lm.max_length)
    for turn in range(max(len(q.turns) for q in batch)):
        rows = [i for i, q in enumerate(batch) if turn < len(q.turns)]
        prompts = []
        for i in rows:
            history[i].append({"role": "user", "content": batch[i].turns[turn]})
            ids = model.prompt_ids(history[i])
            if len(ids) >= window:  # keep the end: the question just asked and the assistant header
                ids = ids[len(ids) - window + 1:]
                summary.truncated_prompts += 1
            prompts.append(ids)
        done = complete(model.lm.decoder, prompts, max_new_tokens=cfg.max_new_tokens, window=window,
                        vocab_size=int(model.lm.vocab_size), stop_ids=model.stop_ids, sampling=sampling,
                        generators=[generators[i] for i in rows], stopped=model.stopped, pad_id=int(model.lm.eod))
        for i, result in zip(rows, done):
            text = model.answer_text(result.ids)
            answers[i].append(text)
            history[i].append({"role": "assistant", "content": text})
            summary.finish[result.finish] += 1
            summary.new_tokens += len(result.ids)
            summary.turns += 1
    return answers


def generate(cfg: GenerateConfig) -> GenerateSummary:
    """Answer every question not yet in cfg.output, the file rewritten after each batch."""
    questions = read_questions(Path(cfg.prompts))
    model_id = cfg.name
    done = read_answers(Path(cfg.output), model_id)
    todo = [q for q in questions if q.question_id not in done]
    summary = GenerateSummary(resumed=len(done), output=str(cfg.output))
    model = load_chat_model(cfg) if todo else None
    summary.template = model.template_name if model else "-"
    order = {q.question_id: k for k, q in enumerate(questions)}

    def ordered() -> list[dict]:  # the question file's order; answers to other ids (kept) at the end
        return sorted(done.values(), key=lambda r: (order.get(r["question_id"], len(order)), str(r["question_id"])))

    start = time.perf_counter()
    with progress_bar(len(todo), "generate", "question", show_progress(cfg.progress)) as bar:
        for b in range(0, len(todo), cfg.batch_size):
            batch = todo[b: b + cfg.batch_size]
            for question, turns in zip(batch, answer_batch(model, batch, cfg, summary)):
                done[question.question_id] = answer_record(question, model_id, turns, uuid.uuid4().hex, time.time())
                summary.answered += 1
            write_answers(Path(cfg.output), ordered())
            bar.update(len(batch))
    summary.seconds = time.perf_counter() - start
    return summary
