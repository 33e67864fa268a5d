"""Build the vendored chat data of examples/sft/data/ from the bundled WikiText-2 (see README.md there).

    python examples/sft/data/build_wikitext_chat.py   # rewrites wikitext_chat.jsonl and wikitext_questions.jsonl

Instructions are written here from a few fixed phrasings; every assistant answer is text of WikiText-2
itself (a sentence of an article, or its title), never generated. Training conversations come from the
validation split (the text `make demo` pretrains on), the questions for `megatron-jreg generate` from the
test split (held out from training). Deterministic: the same files on every run.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
WIKITEXT = HERE.parents[1] / "data" / "wikitext-2"
SEED = 20260118
MAX_SENTENCE = 220  # characters; keeps a conversation near 100 tokens with the demo's 4,096-token BPE
MIN_SENTENCE = 30
SYSTEM = "You are an encyclopedia. Answer with one sentence."

_TITLE = re.compile(r"^ = ([^=].*) = $")
_SECTION = re.compile(r"^ = = ([^=].*) = = $")
_SENTENCE_END = re.compile(r"(?<= \.) (?=[A-Z\"])")  # WikiText writes "end . Next"


def articles(path: Path) -> list[dict]:
    """[{"title", "sections": [{"name", "sentences": [...]}]}]; the lead paragraphs are the section ""."""
    out: list[dict] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if m := _TITLE.match(line):
            out.append({"title": m.group(1).strip(), "sections": [{"name": "", "sentences": []}]})
        elif not out or not line.strip() or line.lstrip().startswith("= ="):
            if out and (m := _SECTION.match(line)):
                out[-1]["sections"].append({"name": m.group(1).strip(), "sentences": []})
            continue
        else:
            sentences = [s.strip() for s in _SENTENCE_END.split(line.strip())]
            out[-1]["sections"][-1]["sentences"] += sentences
    return out


def usable(sentence: str) -> bool:
    """A sentence of a reasonable length without WikiText's `<unk>` (rare words replaced)."""
    return MIN_SENTENCE <= len(sentence) <= MAX_SENTENCE and "<unk>" not in sentence


def conversations(arts: list[dict], rng: random.Random) -> list[list[dict]]:
    """Five kinds of task, answers taken from the text; some with a system turn, some two turns long."""
    out: list[list[dict]] = []

    def chat(*turns: str, system: bool = False) -> None:
        roles = ["user", "assistant"] * (len(turns) // 2)
        messages = [{"role": r, "content": t} for r, t in zip(roles, turns)]
        out.append(([{"role": "system", "content": SYSTEM}] if system else []) + messages)

    for art in arts:
        title, sections = art["title"], art["sections"]
        if "<unk>" in title:
            continue
        lead = sections[0]["sentences"]
        if lead and usable(lead[0]):
            first = rng.choice(["Write the first sentence of an encyclopedia article about {}.",
                                "How would an encyclopedia article about {} begin?",
                                "Begin an article about {}."]).format(title)
            if len(lead) > 1 and usable(lead[1]):
                chat(first, lead[0], "Continue.", lead[1], system=rng.random() < 0.3)
            chat(first, lead[0], system=rng.random() < 0.3)
        for section in sections:
            sentences = section["sentences"]
            if section["name"] and "<unk>" not in section["name"] and sentences and usable(sentences[0]):
                ask = rng.choice(["In an article about {}, what does the section \"{}\" begin with?",
                                  "Write the opening sentence of the section \"{1}\" of an article about {0}."])
                chat(ask.format(title, section["name"]), sentences[0], system=rng.random() < 0.2)
            for a, b, c in zip(sentences, sentences[1:], [*sentences[2:], ""]):
                if usable(a) and usable(b):
                    ask = rng.choice(["Continue this text: {}", "What comes next? {}", "Continue: {}"]).format(a)
                    if usable(c) and rng.random() < 0.3:
                        chat(ask, b, "Continue.", c, system=rng.random() < 0.2)
                    else:
                        chat(ask, b, system=rng.random() < 0.2)
                if usable(a) and rng.random() < 0.3:
                    ask = rng.choice(["What is this sentence about? {}", "Which topic is this from? {}"])
                    chat(ask.format(a), f"It is from an article about {title}.", system=rng.random() < 0.2)
    rng.shuffle(out)
    return out


def questions(arts: list[dict], rng: random.Random) -> list[dict]:
    """Questions in FastChat's MT-bench format, two turns each (held-out text), plus general questions."""
    picked: list[tuple[str, list[str]]] = []
    for art in arts:
        lead = art["sections"][0]["sentences"]
        if lead and usable(lead[0]) and "<unk>" not in art["title"]:
            picked.append(("writing", [f"Write the first sentence of an encyclopedia article about {art['title']}.",
                                       "Continue."]))
    rng.shuffle(picked)
    picked = picked[:16]
    continuations = []
    for art in arts:
        for section in art["sections"]:
            continuations += [s for s in section["sentences"] if usable(s)]
    for sentence in rng.sample(continuations, 16):
        picked.append(("extraction", [f"Continue this text: {sentence}", "What is this text about?"]))
    general = [
        ("humanities", ["Describe the history of a city you know in three sentences.", "Now summarize it in one."]),
        ("humanities", ["Why do historians read old newspapers?", "Give an example."]),
        ("humanities", ["Write a short paragraph about a famous battle.", "Who won it?"]),
        ("stem", ["What is a species?", "How are new species named?"]),
        ("stem", ["Explain how a hurricane forms.", "Why do hurricanes weaken over land?"]),
        ("stem", ["What does a lobster eat?", "Where does it live?"]),
        ("writing", ["Write the opening sentence of a biography of a football player.", "Continue."]),
        ("writing", ["Write a sentence about a song that reached number one.", "Add a second sentence."]),
        ("roleplay", ["You are a museum guide. Welcome the visitors.", "A child asks what the oldest object is."]),
        ("roleplay", ["Pretend to be a ship's captain in a storm. Give an order.", "Now explain the order."]),
    ]
    picked += general
    return [{"question_id": i + 1, "category": cat, "turns": turns} for i, (cat, turns) in enumerate(picked)]


def main() -> None:
    rng = random.Random(SEED)
    train = conversations(articles(WIKITEXT / "valid.txt"), rng)
    with open(HERE / "wikitext_chat.jsonl", "w", encoding="utf-8") as f:
        for messages in train:
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    held_out = questions(articles(WIKITEXT / "test.txt"), random.Random(SEED + 1))
    with open(HERE / "wikitext_questions.jsonl", "w", encoding="utf-8") as f:
        for q in held_out:
            f.write(json.dumps(q, ensure_ascii=False) + "\n")
    print(f"{len(train)} conversations, {len(held_out)} questions")


if __name__ == "__main__":
    main()
