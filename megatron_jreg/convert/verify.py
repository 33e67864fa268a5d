"""What makes a conversion trustworthy: the converted model computes the same logits as the source within float32
rounding, and a failed conversion leaves nothing behind (the budget and its margins: DEVELOPERS.md, convert)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_jreg.convert.hf_io import ConversionError
from megatron_jreg.errors import FAILED, JregError
from megatron_jreg.fileio import atomic_folder

THRESHOLD = 1e-4  # float32 arithmetic, same weights on both sides (the floor of default_threshold)
EPS32 = torch.finfo(torch.float32).eps
ROUNDING_BUDGET = 16  # see default_threshold


def default_threshold(depth: int, max_abs_logit: float) -> float:
    """The largest |logit difference| two float32 implementations of the same weights may show: each layer adds a
    few ε₃₂ of relative rounding, a mapping error far more."""
    return max(THRESHOLD, ROUNDING_BUDGET * EPS32 * (depth + 1) * max_abs_logit)


class VerificationFailed(JregError, RuntimeError):
    """The converted model's logits differ from the source's by more than the threshold."""

    exit_code = FAILED


@dataclass
class Verification:
    max_abs_logit_diff: float
    threshold: float
    max_abs_logit: float
    tokens_shape: tuple[int, int]
    rounding_effect: float | None = None  # max |logit change| from rounding the weights to the export dtype


def probe_tokens(vocab_size: int, seq_length: int, batch: int = 2, length: int = 32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, min(length, seq_length)), generator=gen)


def compare_logits(reference: Callable[[torch.Tensor], torch.Tensor], converted: Callable[[torch.Tensor], torch.Tensor],
                   tokens: torch.Tensor, threshold: float | None = None, depth: int = 1) -> Verification:
    """Run tokens[b, t] through both models; raise above threshold (default `default_threshold`)."""
    with torch.no_grad():
        ref = reference(tokens).float().cpu()
        got = converted(tokens).float().cpu()
    if ref.shape != got.shape:
        raise VerificationFailed(f"logit shapes differ: source {tuple(ref.shape)}, converted {tuple(got.shape)}")
    scale = float(ref.abs().max())
    threshold = default_threshold(depth, scale) if threshold is None else threshold
    diff = float((ref - got).abs().max())
    if not diff <= threshold:  # also catches NaN
        raise VerificationFailed(f"max_abs_logit_diff={diff:.3e} exceeds the threshold {threshold:.1e} (largest "
                                 f"|logit| {scale:.3g}): the converted model does not reproduce the source; nothing "
                                 "was written")
    return Verification(diff, threshold, scale, (tokens.shape[0], tokens.shape[1]))


@torch.no_grad()
def round_weights(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    changed = False
    for p in model.parameters():
        rounded = p.to(dtype).to(p.dtype)
        if not torch.equal(rounded, p):
            p.copy_(rounded)
            changed = True
    return changed


def hf_logits_fn(folder: Path, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    from megatron_jreg import hub

    model = hub.load_causal_lm(folder, where=f"--hf {folder}", dtype=torch.float32, allow_pickle=True).to(device)
    model.eval()
    return lambda tokens: model(input_ids=tokens.to(device)).logits


def should_verify(verify: bool | None, num_params: int) -> tuple[bool, str]:
    """(run the logit check?, why not): by default when three float32 copies of the model fit in free memory."""
    import psutil

    if verify is False:
        return False, "logits not verified: --no-verify"
    needed = num_params * 4 * 3
    free = psutil.virtual_memory().available + (torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0)
    if verify is None and not needed < 0.9 * free:
        return False, (f"logits not verified: verification needs ~{needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB "
                       "free (pass --verify to check anyway)")
    return True, ""


def single_process() -> None:
    """Conversions run in one process; under torchrun every rank would write the same output."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ConversionError(f"the converter runs as one process (found a world of {world} ranks): run it with "
                              "python, not torchrun; checkpoints load at any TP/PP")


@contextlib.contextmanager
def staged_output(output: Path) -> Iterator[Path]:
    """A temporary sibling folder to write into, renamed to `output` only when the block succeeds."""
    from megatron_jreg.fileio import check_output_folder

    output = Path(output).absolute()
    check_output_folder(output, f"--output {output}", empty=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_folder(output) as tmp:
        yield tmp
