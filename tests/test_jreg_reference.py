"""JREG equals an independent reference under every Megatron-LM feature in the table (one row each).

The reference is a run of `megatron-jreg train` at --jreg-lambda 0 (the plugin adds nothing) with a few
lines of its own: forward hooks on the decoder's layers (found by module name) computing
Ψ_ℓ = mean over real tokens of arccos(cosine_similarity(h_ℓ−1, h_ℓ))/π in float64, and
λ·N_loss·Σ_ℓ w_ℓ Ψ_ℓ added to each microbatch's loss sum inside the loss function, so Megatron-LM scales
it exactly as it scales the cross-entropy (÷ loss tokens and microbatches, or ÷ the step's loss tokens
under --calculate-per-token-loss). It runs on one rank without the feature; each row runs the plugin
(λ = 1) with the feature, and must give the reference's Ψ, jreg loss, lm loss and grad norm at every
iteration and its full gradients after iteration 1, to float noise. A new feature is one `Row`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests._train_runs import TINY, records, train
from tests.distributed import run_ranks

if TYPE_CHECKING:
    import torch

pytestmark = pytest.mark.multirank

RTOL = 1e-5
LAM, ALPHA = 1.0, 1.0
ITERS = ["--train-iters", "2", "--eval-iters", "1", "--eval-interval", "100", "--lr", "1e-3",
         "--lr-warmup-iters", "0"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
PP2, VPP = ["--pipeline-model-parallel-size", "2"], ["--num-layers-per-virtual-pipeline-stage", "1"]
SFT_MODEL = ("--num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
             "--num-query-groups 2 --seq-length 64 --max-position-embeddings 64 --position-embedding-type rope "
             "--normalization RMSNorm --swiglu --disable-bias-linear --attention-dropout 0 --hidden-dropout 0 "
             "--transformer-impl local --sft --tokenizer-type SFTTokenizer --sft-tokenizer-prompt-format default "
             "--no-create-attention-mask-in-dataloader --split 90,10,0 --num-workers 0 --log-interval 1 "
             "--init-mode layout-independent --no-progress --jreg-lambda 1 --jreg-alpha 1").split()

# What a run trains on: the rows' features must not change it (the reference runs it on one rank).
REFERENCES: dict[str, list[str]] = {
    "base": TINY,  # 4 microbatches of 1 × 32 tokens, mock data, every token real and a loss token
    # untied: megatron-core 0.19.2 cannot build the sharded state dict of an MTP stage tied to the embeddings
    "mtp": TINY + ["--mtp-num-layers", "1", "--untie-embeddings-and-output-weights"],
    "sft": SFT_MODEL + ["--micro-batch-size", "2", "--global-batch-size", "4"],  # 2 microbatches of 2 packs
    "sft-per-token": SFT_MODEL + ["--micro-batch-size", "2", "--global-batch-size", "4",
                                  "--calculate-per-token-loss"],  # ... weighted by their loss tokens
    "sft-1mb": SFT_MODEL + ["--micro-batch-size", "2", "--global-batch-size", "2"],
}
PER_TOKEN = ("--calculate-per-token-loss",)


@dataclass(frozen=True)
class Row:
    name: str
    reference: str = "base"
    flags: tuple[str, ...] = ()
    world: int = 1
    grads: bool = True  # full gradients comparable (the distributed optimizer keeps only shards reduced)


ROWS = [
    Row("one-rank"),
    Row("full-recompute", flags=tuple(RECOMPUTE)),
    Row("per-token-loss", flags=PER_TOKEN),  # microbatches of equal loss tokens: the same objective
    Row("pp2-vpp-full-recompute", flags=(*PP2, *VPP, *RECOMPUTE), world=2),
    Row("tp2-sequence-parallel", flags=("--tensor-model-parallel-size", "2", "--sequence-parallel"), world=2),
    Row("dp2-distributed-optimizer-per-token-loss", flags=("--use-distributed-optimizer", "--overlap-grad-reduce",
                                                           "--overlap-param-gather", *PER_TOKEN), world=2, grads=False),
    Row("mtp", "mtp"),
    Row("mtp-pp2", "mtp", tuple(PP2), world=2),
    Row("sft", "sft"),
    Row("sft-selective-recompute", "sft", ("--recompute-granularity", "selective")),
    Row("sft-pp2-full-recompute", "sft", (*PP2, *RECOMPUTE), world=2),
    Row("sft-pp2-vpp", "sft", (*PP2, *VPP), world=2),
    Row("sft-pp2-per-token-loss", "sft-per-token", tuple(PP2), world=2),
    Row("sft-one-microbatch-per-token-loss", "sft-1mb", PER_TOKEN),  # issue 19: the same penalty in both modes
]


def _decoder_layers(chunk: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(ℓ, layer) of a one-rank model, from module names: `…decoder.layers.<i>` (MTP's are `…mtp.…`)."""
    named = [(re.fullmatch(r"(?:module\.)*decoder\.layers\.(\d+)", n), m) for n, m in chunk.named_modules()]
    return [(int(match.group(1)) + 1, m) for match, m in named if match]


class Reference:
    """Own hooks and loss term (see the module docstring), installed around one in-process run."""

    def __init__(self, num_layers: int, distance: str = "angular") -> None:
        import torch

        self.weights = torch.softmax(ALPHA * torch.arange(1, num_layers + 1, dtype=torch.float64), 0)
        self.num_layers = num_layers
        self.pairs: dict[int, tuple] = {}
        self.real: torch.Tensor | None = None
        self.psi: list[list[float]] = []  # per training microbatch
        self.tokens: list[tuple[int, int]] = []  # (real, loss) tokens per training microbatch
        self.grads: dict | None = None

    def _tokens(self, module, args, kwargs) -> None:
        import torch
        from megatron.training import get_args, get_tokenizer

        tokens = kwargs.get("input_ids", args[0] if args else None)
        if not get_args().sft:
            self.real = None
            return
        rows = tokens.reshape(-1, get_args().seq_length)  # the packs, before flattening
        pad = rows == get_tokenizer().pad
        last_real = torch.where(~pad, torch.arange(rows.shape[1]), -1).max(dim=1).values
        self.real = (torch.arange(rows.shape[1])[None] <= last_real[:, None]).reshape(tokens.shape)

    def _layer(self, ell, module, args, kwargs, output) -> None:
        import torch

        if module.training and torch.is_grad_enabled():
            self.pairs[ell] = (kwargs["hidden_states"], output[0])

    def penalty(self, loss_mask: torch.Tensor) -> torch.Tensor:
        import torch

        psi = []
        for ell in range(1, self.num_layers + 1):
            h_in, h_out = (h.double() for h in self.pairs.pop(ell))
            angle = torch.acos(torch.nn.functional.cosine_similarity(h_in, h_out, dim=-1).clamp(-1, 1)) / math.pi
            real = torch.ones_like(angle, dtype=torch.bool) if self.real is None else self.real.t()
            psi.append(angle[real].mean())
        psi = torch.stack(psi)
        self.psi.append(psi.tolist())
        self.tokens.append((int(real.sum()), int(loss_mask.sum())))
        return (LAM * loss_mask.sum() * (self.weights * psi).sum()).float()

    def install(self):
        """Patch the run's model hook, loss and train step; returns the undo function."""
        from megatron_jreg.training import loop, step
        from megatron_jreg.training.sharding import gather_full

        attach, loss_func, step_end = loop.JregLoop.attach, step.loss_func, loop.JregLoop.on_train_step_end
        ref = self

        def own_attach(loop_self, chunks):
            (chunk,) = chunks
            chunk.register_forward_pre_hook(ref._tokens, with_kwargs=True)
            for ell, layer in _decoder_layers(chunk):
                layer.register_forward_hook(lambda *a, ell=ell: ref._layer(ell, *a), with_kwargs=True)
            return attach(loop_self, chunks)

        def own_loss(loss_mask, output_tensor):
            loss, num_tokens, report = loss_func(loss_mask, output_tensor)
            if ref.pairs:
                loss = loss + ref.penalty(loss_mask)
            return loss, num_tokens, report

        def own_step_end(loop_self, iteration, model, result):
            step_end(loop_self, iteration, model, result)
            if ref.grads is None:
                ref.grads = gather_full(model, value=lambda p: p.main_grad)

        loop.JregLoop.attach, step.loss_func, loop.JregLoop.on_train_step_end = own_attach, own_loss, own_step_end

        def undo():
            loop.JregLoop.attach, step.loss_func, loop.JregLoop.on_train_step_end = attach, loss_func, step_end

        return undo


def _grads_after_first_step(argv: list[str]) -> tuple[int, dict]:
    """Run the plugin; full gradients of iteration 1 (gathered on every rank)."""
    from megatron_jreg.training import loop
    from megatron_jreg.training.sharding import gather_full

    step_end = loop.JregLoop.on_train_step_end
    box: dict = {}

    def capture(loop_self, iteration, model, result):
        step_end(loop_self, iteration, model, result)
        if "grads" not in box:
            box["grads"] = gather_full(model, value=lambda p: p.main_grad)

    loop.JregLoop.on_train_step_end = capture
    try:
        rc = train(argv)[0]
    finally:
        loop.JregLoop.on_train_step_end = step_end
    return rc, box.get("grads", {})


def _sft_inputs(tmp: Path) -> list[str]:
    from tests.test_sft import chat_tokenizer, conversations

    tok = chat_tokenizer(tmp)
    data = tmp / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations(60)))
    return ["--tokenizer-model", tok, "--data-path", str(data)]


def _argv(reference: str, sft: list[str]) -> list[str]:
    return REFERENCES[reference] + (sft if reference.startswith("sft") else []) + ITERS


def reference_runs(rank: int, world: int, tmp_dir: str) -> dict:
    tmp = Path(tmp_dir)
    sft = _sft_inputs(tmp)
    out = {"sft_inputs": sft}
    for name in REFERENCES:
        ref = Reference(4)
        undo = ref.install()
        try:
            rc = train(_argv(name, sft) + ["--jreg-lambda", "0", "--metrics-file", str(tmp / f"ref-{name}.jsonl")])[0]
        finally:
            undo()
        out[name] = {"rc": rc, "psi": ref.psi, "tokens": ref.tokens, "grads": ref.grads}
    return out


def row_runs(rank: int, world: int, tmp_dir: str, rows: list[Row], sft: list[str]) -> dict:
    tmp = Path(tmp_dir)
    out = {}
    for row in rows:
        rc, grads = _grads_after_first_step(_argv(row.reference, sft) + list(row.flags)
                                            + ["--metrics-file", str(tmp / f"{row.name}.jsonl")])
        out[row.name] = {"rc": rc, "grads": grads if rank == 0 and row.grads else None}
    return out


def one_rank_runs(rank: int, world: int, tmp_dir: str, rows: list[Row]) -> dict:
    """The references, then the one-rank rows, in one spawned process (imports cost seconds)."""
    refs = reference_runs(rank, world, tmp_dir)
    return {"refs": refs, "rows": row_runs(rank, world, tmp_dir, rows, refs["sft_inputs"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    first = run_ranks(one_rank_runs, 1, str(tmp), [row for row in ROWS if row.world == 1], timeout=1800)[0]
    refs, got = first["refs"], first["rows"]
    for world in sorted({row.world for row in ROWS} - {1}):
        rows = [row for row in ROWS if row.world == world]
        got.update(run_ranks(row_runs, world, str(tmp), rows, refs["sft_inputs"], timeout=1800)[0])
    return {"tmp": tmp, "refs": refs, "rows": got}


def _train_records(path: Path) -> list[dict]:
    return [r for r in records(path) if "lm_loss" in r]


def _max_rel_diff(grads: dict, ref: dict) -> float:
    assert set(grads) == set(ref)
    return max(((grads[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)).item() for k in ref)


def _mean(rows: list[list[float]]) -> list[float]:
    import torch

    return torch.tensor(rows, dtype=torch.float64).mean(0).tolist()


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_jreg_equals_the_reference(runs, row):
    import torch

    ref = runs["refs"][row.reference]
    got = runs["rows"][row.name]
    assert ref["rc"] == 0 and got["rc"] == 0
    ref_records = _train_records(runs["tmp"] / f"ref-{row.reference}.jsonl")
    got_records = _train_records(runs["tmp"] / f"{row.name}.jsonl")
    per_iteration = len(ref["psi"]) // len(ref_records)
    weights = torch.softmax(ALPHA * torch.arange(1, 5, dtype=torch.float64), 0)
    assert [r["iteration"] for r in got_records] == [r["iteration"] for r in ref_records] == [1, 2]
    for i, (r, g) in enumerate(zip(ref_records, got_records)):
        psi = _mean(ref["psi"][i * per_iteration:(i + 1) * per_iteration])
        assert g["psi"] == pytest.approx(psi, rel=RTOL)
        assert g["jreg_loss"] == pytest.approx(float((weights * torch.tensor(psi)).sum()), rel=RTOL)
        assert g["lm_loss"] == pytest.approx(r["lm_loss"], rel=RTOL)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=RTOL)
    if row.grads:
        assert _max_rel_diff(got["grads"], ref["grads"]) < RTOL


def test_mtp_layers_are_not_part_of_psi(runs):
    """With --mtp-num-layers 1 the decoder's Ψ_1..Ψ_L at iteration 1 are those of the run without MTP (the
    same embeddings and layers, layout-independent init): MTP's own TransformerLayer is not Ψ_1."""
    base = _train_records(runs["tmp"] / "one-rank.jsonl")[0]
    for name in ("mtp", "mtp-pp2"):
        assert _train_records(runs["tmp"] / f"{name}.jsonl")[0]["psi"] == pytest.approx(base["psi"], rel=RTOL)


def test_penalty_is_the_same_with_and_without_per_token_loss(runs):
    """One SFT microbatch whose real tokens far outnumber its loss tokens (assistant turns only): under
    --calculate-per-token-loss the penalty, hence every gradient, is the one without it (the row above
    checks it against the reference without per-token loss); Ψ is not scaled by N_real/N_loss."""
    (real, loss), *_ = runs["refs"]["sft-1mb"]["tokens"]
    assert real > 1.5 * loss > 0
    row = next(r for r in ROWS if r.name == "sft-one-microbatch-per-token-loss")
    assert row.reference == "sft-1mb" and "--calculate-per-token-loss" not in REFERENCES[row.reference]
    test_jreg_equals_the_reference(runs, row)
