"""How far float32 logits of megatron-core and transformers drift apart on the same weights, by depth and
logit size: the measurement behind `convert.verify.default_threshold`.

    python benchmarks/convert_logit_rounding.py [--layers 2 8 32] [--hidden 64 256] [--logit-scale 1 100]

Each point is a random Llama (GQA, untied head, norm gains perturbed, attention/MLP outputs ×5 so the residual
stream grows as in a trained model, the head ×scale to set the logits' size) converted with `convert hf-to-mcore`,
whose check runs the same tokens through both models. Printed per point: max|logit|, max_abs_logit_diff and the
ratios diff / (ε₃₂·max|logit|) and diff / (ε₃₂·(L + 1)·max|logit|), the form of the threshold. The last line is
`max_ratio=<largest diff / (ε₃₂·(L+1)·max|logit|)> budget=<ROUNDING_BUDGET> margin=<budget ÷ max_ratio>
fixed_1e-4_fails=<points above the old fixed threshold>`.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/_toy.py


def one_point(root: Path, layers: int, hidden: int, scale: float) -> tuple[float, float]:
    """(max |logit|, max |logit difference|) of one random Llama through `hf_to_mcore`'s check."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from megatron_jreg.convert.from_hf import hf_to_mcore
    from tests._toy import perturb_vectors

    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 11 // 32 * 8,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(layers)
    model = AutoModelForCausalLM.from_config(config)
    perturb_vectors(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(5)
            layer.self_attn.o_proj.weight.mul_(5)
    name = f"{layers}x{hidden}x{scale:g}"
    model.save_pretrained(root / f"hf-{name}")
    result = hf_to_mcore(root / f"hf-{name}", root / f"mc-{name}", verify=True, threshold=1.0)
    shutil.rmtree(root / f"mc-{name}")
    return result.verification.max_abs_logit, result.verification.max_abs_logit_diff


def main(argv: list[str] | None = None) -> int:
    from megatron_jreg.convert.verify import EPS32, ROUNDING_BUDGET, THRESHOLD

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 256])
    p.add_argument("--logit-scale", type=float, nargs="+", default=[1.0, 100.0])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # megatron-core's deprecation and CPU notes, on stdout
    ratios, over = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            for hidden in args.hidden:
                for scale in args.logit_scale:
                    logit, diff = one_point(Path(tmp), layers, hidden, scale)
                    ratio = diff / (EPS32 * (layers + 1) * logit)
                    ratios.append(ratio)
                    over += diff > THRESHOLD
                    print(f"layers={layers:3d} hidden={hidden:4d} max|logit|={logit:8.3g} diff={diff:.3e} "
                          f"diff/(eps*|logit|)={diff / (EPS32 * logit):6.2f} diff/(eps*(L+1)*|logit|)={ratio:6.3f}",
                          flush=True)
    worst = max(ratios)
    print(f"max_ratio={worst:.3f} budget={ROUNDING_BUDGET} margin={ROUNDING_BUDGET / worst:.1f} "
          f"fixed_1e-4_fails={over}")
    return 0


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import __main__
    raise SystemExit(main())
