"""`analyze` on tiny random models of many transformers families: in memory and `--stream`, each with and
without `--include-final-norm`, each ending in a result or one error line (never a traceback), with the
streamed Ψ equal to the in-memory one.

    python benchmarks/analyze_families.py [--families llama,mixtral,...] [--all] [--keep DIR]

Each family's config class is built with its defaults shrunk to a tiny model (2 layers, hidden 32, 4 heads,
vocabulary 320, ...); a family whose config or model transformers cannot build at that size is reported as
`not built` (a limit of this shrinking, not of the analysis). Per family the four runs go through the CLI's
`main` in this process on 4 LAMBADA passages. The last line is `families=<asked> built=<built>
ran=<in-memory runs that ended in a result> one_line=<runs refused with one error line> tracebacks=<runs that
raised> stream_equal=<families whose streamed Ψ equals the in-memory Ψ to 1e-6> stream_max_abs_diff=<largest
|ΔΨ|>`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/_toy.py

FAMILIES = (
    "arcee,biogpt,bloom,codegen,cohere,cohere2,deepseek_v2,deepseek_v3,ernie4_5,exaone4,falcon_h1,gemma,gemma2,"
    "gemma3_text,glm,glm4,gpt2,gpt_bigcode,gpt_neox,gpt_oss,gptj,granite,granitemoe,helium,hunyuan_v1_dense,jamba,"
    "lfm2,llama,llama4_text,mamba,ministral,mistral,mixtral,mpt,nemotron,olmo,olmo2,olmoe,opt,persimmon,phi,phi3,"
    "phimoe,qwen2,qwen2_moe,qwen3,qwen3_moe,qwen3_next,recurrent_gemma,seed_oss,smollm3,stablelm,starcoder2,xglm"
).split(",")
# Config attributes shrunk wherever a family's config has them.
SHRINK = dict(
    hidden_size=32, n_embd=32, d_model=32, num_hidden_layers=2, n_layer=2, num_layers=2, num_attention_heads=4,
    n_head=4, num_key_value_heads=2, intermediate_size=64, ffn_dim=64, n_inner=64, vocab_size=320, head_dim=8,
    max_position_embeddings=256, n_positions=256, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32, kv_lora_rank=16,
    q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, word_embed_proj_dim=32, rotary_dim=4,
    n_group=1, topk_group=1, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4,
)
MODES = {"in_memory": ["--no-stream"], "final_norm": ["--no-stream", "--include-final-norm"], "stream": ["--stream"],
         "stream_final_norm": ["--stream", "--include-final-norm"]}


def tiny_config(model_type: str):
    """The family's config with its sizes shrunk (layer-type lists dropped, so they follow the new depth)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    text = default.get_text_config()
    names = {k for k, v in vars(type(text)).items() if isinstance(v, property)}  # read-only derived values
    sizes = {k: v for k, v in SHRINK.items() if hasattr(text, k) and k not in names}
    if hasattr(text, "layer_types") and "layer_types" not in names:
        sizes["layer_types"] = None

    def build(**kw):
        return cls(text_config={**text.to_dict(), **kw}) if text is not default else cls(**kw)

    try:
        config = build(**sizes)
    except (ValueError, TypeError, AttributeError):  # a family that derives its layer types itself
        sizes.pop("layer_types", None)
        config = build(**sizes)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if hasattr(config.get_text_config(), key):
            setattr(config.get_text_config(), key, 0)
    return config


def run_family(model_type: str, root: Path, tokenizer) -> dict:
    from transformers import AutoModelForCausalLM

    from megatron_jreg.analysis.cli import main as analyze
    from tests._toy import perturb_vectors

    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
        perturb_vectors(model)
        folder = root / model_type
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - a config this shrinking cannot build: reported, not analysed
        return {"built": False, "why": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
    out: dict = {"built": True}
    for mode, flags in MODES.items():
        err = io.StringIO()
        argv = ["--model", str(folder), "--num-samples", "4", "--max-length", "40", "--no-progress",
                "--output", str(root / f"{model_type}-{mode}"), *flags]
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                rc = analyze(argv)
        except BaseException as e:  # noqa: BLE001 - a traceback is what this run looks for
            out[mode] = {"traceback": f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"}
            continue
        errors = [line for line in err.getvalue().splitlines() if "error:" in line]
        if rc == 0:
            out[mode] = {"psi": json.loads((root / f"{model_type}-{mode}" / "results.json").read_text())
                         ["models"][0]["psi"]}
        else:
            out[mode] = {"rc": rc, "error": errors[-1] if errors else "", "lines": len(errors)}
    pairs = [(out[a]["psi"], out[b]["psi"]) for a, b in (("in_memory", "stream"), ("final_norm", "stream_final_norm"))
             if "psi" in out[a] and "psi" in out[b]]
    if pairs:
        out["stream_diff"] = max(abs(x - y) for ref, got in pairs for x, y in zip(ref, got))
    return out


def main(argv: list[str] | None = None) -> int:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging as hf_logging

    from megatron_jreg.data.text import lambada_passages
    from tests._toy import train_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", help="comma-separated model types (default: 54 common decoder families)")
    p.add_argument("--all", action="store_true", help="every causal-LM model type transformers knows")
    p.add_argument("--keep", type=Path, help="keep the tiny models and results in this folder")
    args = p.parse_args(argv)
    families = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) if args.all else (
        args.families.split(",") if args.families else FAMILIES)
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = train_tokenizer(lambada_passages()[:200], vocab_size=320)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for family in families:
            r = results[family] = run_family(family, root, tokenizer)
            if not r["built"]:
                line = f"not built ({r['why']})"
            else:
                line = "  ".join(
                    f"{mode}: " + ("ok" if "psi" in r[mode] else f"TRACEBACK {r[mode]['traceback']}"
                                   if "traceback" in r[mode] else f"rc {r[mode]['rc']} {r[mode]['error'][-110:]}")
                    for mode in MODES) + (f"  stream |ΔΨ| {r['stream_diff']:.1e}" if "stream_diff" in r else "")
            print(f"{family:<18} {line}", flush=True)
            if not args.keep:
                for path in root.glob(f"{family}*"):
                    shutil.rmtree(path, ignore_errors=True)
    built = [r for r in results.values() if r["built"]]
    runs = [r[m] for r in built for m in MODES]
    diffs = [r["stream_diff"] for r in built if "stream_diff" in r]
    one_line = sum("rc" in x and x["lines"] == 1 for x in runs)
    print(f"families={len(families)} built={len(built)} ran={sum('psi' in x for x in runs)} one_line={one_line} "
          f"tracebacks={sum('traceback' in x for x in runs)} stream_equal={sum(d <= 1e-6 for d in diffs)} "
          f"stream_max_abs_diff={max(diffs, default=0.0):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
