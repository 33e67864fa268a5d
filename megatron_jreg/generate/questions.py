"""Question files in, answer files out: FastChat's MT-bench formats (docs/sft.md), read strictly and rewritten whole
after every batch, so an interrupted run leaves complete lines and a rerun resumes by question id."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_jreg.errors import UsageError
from megatron_jreg.fileio import JsonlError, atomic_write, read_jsonl


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]


def _valid_id(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, str) and value != "")


def read_questions(path: Path, flag: str = "--prompts") -> list[Question]:
    questions: list[Question] = []
    seen: dict[int | str, int] = {}
    fix = 'one UTF-8 {"question_id": 1, "category": "writing", "turns": ["..."]} a line'
    try:
        for lineno, record in read_jsonl(path):
            where = f"{flag} {path}: line {lineno}"
            qid = record.get("question_id")
            if not _valid_id(qid):
                raise UsageError(f"{where}: 'question_id' must be an integer or a non-empty string, got {qid!r}")
            if qid in seen:
                raise UsageError(f"{where}: question_id {qid!r} again (first at line {seen[qid]}); ids must "
                                      "differ")
            seen[qid] = lineno
            turns = record.get("turns")
            if not isinstance(turns, list) or not turns:
                raise UsageError(f"{where}: 'turns' must be a non-empty list of user turns (question {qid!r})")
            for k, turn in enumerate(turns):
                if not isinstance(turn, str) or not turn.strip():
                    raise UsageError(f"{where}: turn {k} of question {qid!r} is empty or not a string")
            category = record.get("category", "")
            questions.append(Question(qid, category if isinstance(category, str) else str(category), tuple(turns)))
    except JsonlError as e:
        raise UsageError(f"{flag} {e}; write {fix}") from None
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read it ({e.strerror}); give a question JSONL file") from None
    if not questions:
        raise UsageError(f"{flag} {path}: no questions in it; write {fix}")
    return questions


def read_answers(path: Path, model_id: str, flag: str = "--output") -> dict[int | str, dict]:
    """Answers of an earlier run by question id; another model's file or a non-answer file is refused: a resumed run
    must not mix models or overwrite something else."""
    if not path.exists():
        return {}
    answers: dict[int | str, dict] = {}
    fix = "delete it or choose another --output"
    try:
        for lineno, record in read_jsonl(path):
            if not (_valid_id(record.get("question_id")) and isinstance(record.get("choices"), list)):
                raise UsageError(f"{flag} {path}: line {lineno}: exists and is not a FastChat answer file; {fix}")
            if record.get("model_id") != model_id:
                raise UsageError(f"{flag} {path}: holds answers of model {record.get('model_id')!r}, not "
                                      f"{model_id!r}; give --model-id {record.get('model_id')} to resume it, or {fix}")
            answers[record["question_id"]] = record
    except JsonlError as e:
        raise UsageError(f"{flag} {e}: it exists and is not a FastChat answer file; {fix}") from None
    except OSError as e:
        raise UsageError(f"{flag} {path}: exists and cannot be read as an answer file ({e}); {fix}") from None
    return answers


def answer_record(question: Question, model_id: str, turns: list[str], answer_id: str, tstamp: float) -> dict:
    """One answer line, as FastChat's gen_model_answer.py writes it."""
    return {"question_id": question.question_id, "answer_id": answer_id, "model_id": model_id,
            "choices": [{"index": 0, "turns": turns}], "tstamp": tstamp}


def write_answers(path: Path, records: list[dict]) -> None:
    with atomic_write(path) as f:
        f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
