"""`megatron-jreg train --sft`: Megatron-LM's SFTDataset with the loss on assistant tokens only, Ψ on the
real tokens of a pack (the same as each conversation alone), the local spec taking packed sequences, and
an SFT run that resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._train_runs import records, train
from tests.distributed import run_ranks

pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO / "examples" / "data" / "wikitext-2" / "valid.txt"
TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


def chat_tokenizer(folder: Path) -> str:
    """A small byte-level BPE trained on WikiText-2 with a chat template and its own pad token."""
    from megatron_jreg.data.train_tokenizer import train_tokenizer

    (folder / "text.txt").write_text(WIKITEXT.read_text(encoding="utf-8")[:60000], encoding="utf-8")
    tok = Path(train_tokenizer([str(folder / "text.txt")], str(folder / "tok"), 512, kind="hf-bpe"))
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tok / "tokenizer.json"))
    hf.add_special_tokens(["<|pad|>"])
    hf.save(str(tok / "tokenizer.json"))
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config.update(chat_template=TEMPLATE, pad_token="<|pad|>")
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    return str(tok)


def conversations(n: int) -> list[list[dict]]:
    words = WIKITEXT.read_text(encoding="utf-8").split()[:5000]
    out = []
    for i in range(n):
        chunk = words[i * 37:(i + 1) * 37]
        conv = [{"role": "user", "content": "Continue: " + " ".join(chunk[:8 + i % 5])},
                {"role": "assistant", "content": " ".join(chunk[8 + i % 5:20 + i % 9])}]
        if i % 3 == 0:
            conv = [{"role": "system", "content": "Be brief."}, *conv,
                    {"role": "user", "content": "More."}, {"role": "assistant", "content": " ".join(chunk[25:31])}]
        out.append(conv)
    return out


SFT = ("--model-preset tiny --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --seq-length 64 "
       "--max-position-embeddings 64 --transformer-impl local --sft --tokenizer-type SFTTokenizer "
       "--sft-tokenizer-prompt-format default --no-create-attention-mask-in-dataloader --micro-batch-size 2 "
       "--global-batch-size 4 --train-iters 4 --lr 1e-3 --log-interval 1 --eval-interval 4 --eval-iters 1 "
       "--jreg-lambda 1 --split 90,10,0 --num-workers 0 --init-mode layout-independent --no-progress").split()


def sft_suite(rank: int, world: int, tmp_dir: str) -> dict:
    tmp = Path(tmp_dir)
    tok = chat_tokenizer(tmp)
    data = tmp / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations(60)))
    base = SFT + ["--tokenizer-model", tok, "--data-path", str(data)]
    out: dict = {"targets": _targets(tok), "psi": _pack_invariance(tok)}
    out["full"] = train(base + ["--metrics-file", str(tmp / "full.jsonl")])[0]
    ckpt = ["--save", str(tmp / "ckpt"), "--save-interval", "2", "--metrics-file", str(tmp / "resumed.jsonl")]
    out["exit"] = train(base + ckpt + ["--exit-interval", "2"])[0]
    out["resume"] = train(base + ckpt + ["--load", str(tmp / "ckpt")])[0]
    # fine-tuning as on a preemptible cluster: start from --pretrained-checkpoint, save to and resume from --load
    pre = ["--pretrained-checkpoint", str(tmp / "ckpt")]
    out["ft_full"] = train(base + pre + ["--load", str(tmp / "ft-full"),
                                         "--metrics-file", str(tmp / "ft-full.jsonl")])[0]
    ft = pre + ["--load", str(tmp / "ft"), "--save", str(tmp / "ft"), "--save-interval", "2",
                "--metrics-file", str(tmp / "ft.jsonl")]
    out["ft_exit"] = train(base + ft + ["--exit-interval", "2"])[0]
    out["ft_resume"] = train(base + ft)[0]
    out["masking"] = _loss_ignores_user_targets(base)
    out["bad"] = {name: train(SFT + ["--tokenizer-model", tok, "--data-path", str(path)])
                  for name, path in _bad_chat_files(tmp).items()}
    return out


def _bad_chat_files(tmp: Path) -> dict[str, Path]:
    """Chat JSONL that Megatron-LM's SFTDataset fails on (a traceback, or a KeyError iterations later) or trains
    nothing from (every conversation longer than --seq-length 64: the assistant turns are cut off)."""
    good = json.dumps({"messages": conversations(1)[0]}) + "\n"
    long_user = " ".join(WIKITEXT.read_text(encoding="utf-8").split()[:300])
    files = {
        "invalid-json": good + '{"messages": [{"role": "user", "content": "hi"}\n',
        "no-role": json.dumps({"messages": [{"content": "hi"}, {"role": "assistant", "content": "yes"}]}) + "\n",
        "too-long": "".join(json.dumps({"messages": [{"role": "user", "content": long_user[i:]},
                                                     {"role": "assistant", "content": "Yes."}]}) + "\n"
                            for i in range(3)),
    }
    out = {}
    for name, text in files.items():
        out[name] = tmp / f"{name}.jsonl"
        out[name].write_text(text, encoding="utf-8")
    return out


@pytest.mark.parametrize("name,needle", [
    ("invalid-json", "invalid-json.jsonl: line 2: not JSON ("),
    ("no-role", "no-role.jsonl: line 1: turn 0 is not an object with `role` and `content`"),
    ("too-long", "too-long.jsonl: no conversation gives a token to train on within --seq-length 64"),
])
def test_chat_data_megatron_lm_cannot_train_on_is_one_line(suite, name, needle):
    rc, out, err = suite["bad"][name]
    lines = [line for line in err.splitlines() if line.startswith("megatron-jreg train: error:")]
    assert rc == 2 and len(lines) == 1 and needle in lines[0], (out + err)[-2000:]
    assert "Traceback" not in err and "prepare-chat" in lines[0]


def _targets(tok: str) -> dict:
    """Targets of one conversation through Megatron-LM's SFTTokenizer wrapped by megatron-jreg."""
    from megatron.core.tokenizers.text.libraries.sft_tokenizer import SFTTokenizer

    from megatron_jreg.data.chat_targets import IGNORE_INDEX, ChatTargets

    inner = SFTTokenizer(tok, "default")
    conv = conversations(1)[0]
    tokens, megatron_targets = inner.tokenize_conversation(conv, return_target=True, add_generation_prompt=False)
    tokens2, targets = ChatTargets(inner).tokenize_conversation(conv, return_target=True, add_generation_prompt=False)
    hf = inner._tokenizer
    kept = hf.decode([t for t, g in zip(tokens2, targets) if g != IGNORE_INDEX])
    return {"same_tokens": tokens.tolist() == tokens2.tolist(), "megatron_all": bool((megatron_targets >= 0).all()),
            "kept": kept, "assistant": [m["content"] for m in conv if m["role"] == "assistant"],
            "user": [m["content"] for m in conv if m["role"] != "assistant"]}


def _pack_invariance(tok: str) -> dict:
    """Ψ sums of conversations packed into one sequence (block-diagonal mask, positions restarting, end
    padding masked) equal the sums of each conversation run alone."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_jreg.plugin import JregConfig, JregPlugin
    from megatron_jreg.training.sft import packed_attention_mask, real_token_mask
    from tests._layouts import build_chunks, transformer_config

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(3)
    (model,) = build_chunks(transformer_config())
    model.eval()
    g = torch.Generator().manual_seed(0)
    lengths, pad, total = [5, 9, 3], 127, 24
    convs = [torch.randint(0, 120, (n,), generator=g) for n in lengths]
    plugin = JregPlugin([model], JregConfig(lam=0.0))

    def sums(tokens, positions, mask, real):
        plugin.start_step(1, record=True)
        plugin.set_token_mask(real)
        with torch.no_grad():
            model(tokens, positions, mask)
        stats = plugin.finish_step()
        return torch.tensor(stats.psi) * float(real.sum())

    alone = sum(sums(c[None], torch.arange(len(c))[None], None, torch.ones(1, len(c), dtype=torch.bool))
                for c in convs)
    packed = torch.full((1, total), pad)
    positions = torch.zeros(1, total, dtype=torch.long)
    cu = [0]
    for c in convs:
        packed[0, cu[-1]:cu[-1] + len(c)] = c
        positions[0, cu[-1]:cu[-1] + len(c)] = torch.arange(len(c))
        cu.append(cu[-1] + len(c))
    positions[0, cu[-1]:] = torch.arange(total - cu[-1])
    real = real_token_mask(packed, pad)
    together = sums(packed, positions, packed_attention_mask(torch.tensor(cu), total), real)
    plugin.remove_hooks()
    parallel_state.destroy_model_parallel()
    return {"alone": alone.tolist(), "packed": together.tolist(), "real": int(real.sum()), "tokens": sum(lengths)}


def _loss_ignores_user_targets(argv: list[str]) -> dict:
    """A real SFT batch (Megatron-LM's SFTDataset through the datasets provider): the loss mask is 1 on
    assistant tokens only, so changing a user/system/padding token's target changes nothing."""
    import torch
    from megatron.core import parallel_state
    from megatron.training.training import get_train_valid_test_num_samples

    from megatron_jreg import patches
    from megatron_jreg.training.data import train_valid_test_datasets_provider
    from megatron_jreg.training.run import parse_and_validate, teardown
    from megatron_jreg.training.sft import CHAT_TARGETS, chat_targets
    from megatron_jreg.training.step import loss_func

    try:
        parse_and_validate(argv)
        patches.apply({CHAT_TARGETS: chat_targets})  # until teardown, as training_patches does around a run
        parallel_state.initialize_model_parallel()
        train_ds, _, _ = train_valid_test_datasets_provider(get_train_valid_test_num_samples())
        sample = train_ds[0]
        mask, labels = sample["loss_mask"], sample["labels"]
        losses = torch.rand(labels.shape, generator=torch.Generator().manual_seed(1))
        loss, count, _ = loss_func(mask[None], losses[None])
        changed = losses.clone()
        changed[mask == 0] += 10.0  # any other target there: another per-token loss at those positions
        loss2, _, _ = loss_func(mask[None], changed[None])
        return {"equal": float(loss) == float(loss2), "count": int(count), "masked": int((mask == 0).sum())}
    finally:
        teardown()


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return run_ranks(sft_suite, 1, str(tmp_path_factory.mktemp("sft")), timeout=1200)[0]


def test_targets_are_the_assistant_turns_only(suite):
    t = suite["targets"]
    assert t["same_tokens"] and t["megatron_all"]  # Megatron-LM's default prompt format trains on every token
    for text in t["assistant"]:
        assert text in t["kept"]
    for text in t["user"]:
        assert text not in t["kept"]


def test_changing_a_non_assistant_target_changes_nothing(suite):
    m = suite["masking"]
    assert m["equal"] and m["count"] > 0 and m["masked"] > 0


def test_psi_of_a_pack_equals_each_conversation_alone(suite):
    p = suite["psi"]
    assert p["real"] == p["tokens"]
    assert p["packed"] == pytest.approx(p["alone"], rel=1e-5)


def test_sft_run_resumes_exactly(suite, tmp_path_factory):
    assert suite["full"] == suite["exit"] == suite["resume"] == 0
    base = Path(str(tmp_path_factory.getbasetemp())) / "sft0"
    full = {r["iteration"]: r for r in records(base / "full.jsonl") if "lm_loss" in r}
    resumed = [r for r in records(base / "resumed.jsonl") if "lm_loss" in r]
    assert [r["iteration"] for r in resumed] == [1, 2, 3, 4]
    for r in resumed:  # --metrics-file: each iteration's own loss, the uninterrupted run's
        assert r["lm_loss"] == full[r["iteration"]]["lm_loss"]
        assert r["jreg_loss"] == pytest.approx(full[r["iteration"]]["jreg_loss"], rel=1e-6)


def test_fine_tuning_from_pretrained_checkpoint_resumes_from_load(suite, tmp_path_factory):
    """--pretrained-checkpoint starts the run at iteration 1 from the pretrained weights; once --load holds a
    checkpoint of the fine-tuning run, a requeued job continues it exactly."""
    assert suite["ft_full"] == suite["ft_exit"] == suite["ft_resume"] == 0
    base = Path(str(tmp_path_factory.getbasetemp())) / "sft0"
    full = {r["iteration"]: r["lm_loss"] for r in records(base / "ft-full.jsonl") if "lm_loss" in r}
    resumed = [r for r in records(base / "ft.jsonl") if "lm_loss" in r]
    pretrain = {r["iteration"]: r["lm_loss"] for r in records(base / "full.jsonl") if "lm_loss" in r}
    assert sorted(full) == [r["iteration"] for r in resumed] == [1, 2, 3, 4]
    assert full[1] < pretrain[1]  # the pretrained weights were loaded
    for r in resumed:
        assert r["lm_loss"] == full[r["iteration"]]
