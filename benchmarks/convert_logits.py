"""`megatron-jreg convert`'s own logit check on a small Llama, both directions, in one process (about a minute).

A randomly initialised Hugging Face Llama (4 layers × 128, 4 heads / 2 KV groups, untied, RoPE base 5e5,
vocabulary 1000, which megatron pads to 1024; norm gains perturbed so a norm mapping error would show) is
imported (hf-to-mcore), exported back in float32 and in bfloat16 (mcore-to-hf), and the float32 round trip
is compared tensor by tensor. Each conversion's `max_abs_logit_diff` is its own check: the same tokens through
the megatron-core and the transformers model, both in float32 on the written weights. docs/convert.md cites
the output (docs/results/convert_logits.txt). Ends with one key=value line.

    python benchmarks/convert_logits.py
"""

from __future__ import annotations

import contextlib
import io
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def convert(argv: list[str]) -> list[str]:
    """`megatron-jreg convert ARGV` in this process; its stdout lines (exits on failure)."""
    from megatron_jreg.convert.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    if rc != 0:
        raise SystemExit(f"convert {' '.join(argv[:1])} failed ({rc}):\n{out.getvalue()}")
    return out.getvalue().splitlines()


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def main() -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests._toy import perturb_vectors

    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(
            vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rope_theta=500000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=0))
        perturb_vectors(model)
        model.save_pretrained(t / "hf")
        steps = {
            "import": ["hf-to-mcore", "--hf", str(t / "hf"), "--output", str(t / "mc")],
            "export_fp32": ["mcore-to-hf", "--load", str(t / "mc"), "--output", str(t / "rt")],
            "export_bf16": ["mcore-to-hf", "--load", str(t / "mc"), "--dtype", "bfloat16", "--output", str(t / "rt16")],
        }
        keys = []
        for name, argv in steps.items():
            lines = convert(argv)
            shown = [line for line in lines if line.startswith(("max_abs_logit_diff=", "note: rounding"))]
            print(f"$ megatron-jreg convert {' '.join(argv).replace(tmp, '$TMP')}")
            print("\n".join(f"  {line}" for line in shown))
            keys.append(f"{name}={lines[-1].split('=', 1)[1]}")
        a, b = tensors(t / "hf"), tensors(t / "rt")
        exact = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        print(f"round trip HF → megatron → HF: {len(a)} tensors, {'bit-exact' if exact else 'DIFFERENT'}")
        print(" ".join(keys) + f" round_trip_bit_exact={int(exact)}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
