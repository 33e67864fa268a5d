"""Configuration dataclasses. Flags map onto these one to one; `validate()` runs once, before any work,
and every error names the flag and the fix."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_jreg.plugin import JregConfig

__all__ = ["ModelConfig", "ParallelConfig", "JregConfig", "PRESETS", "ConfigError"]


class ConfigError(ValueError):
    """A bad flag value; the message names the flag and the fix."""


@dataclass
class ModelConfig:
    """A Llama-style decoder (pre-norm, RoPE, SwiGLU, RMSNorm, no biases by default)."""

    num_layers: int = 12
    hidden_size: int = 768
    ffn_hidden_size: int | None = None  # default: Llama's 8/3·h rounded up to a multiple of 256
    num_attention_heads: int = 12
    num_query_groups: int | None = None  # None = multi-head attention
    seq_length: int = 2048
    max_position_embeddings: int | None = None  # default: seq_length
    position_embedding_type: str = "rope"
    rotary_base: int = 10000
    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = True
    disable_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = True
    init_method_std: float = 0.02
    vocab_size: int | None = None  # true vocabulary size (from the tokenizer), before padding
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            ffn = int(8 * self.hidden_size / 3) if self.swiglu else 4 * self.hidden_size
            self.ffn_hidden_size = -(-ffn // 256) * 256 if self.hidden_size >= 256 else ffn
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length

    def validate(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "ffn_hidden_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}: pick a head count that divides it"
            )
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            raise ConfigError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by --num-query-groups "
                f"{groups}"
            )
        if self.position_embedding_type not in ("rope", "learned_absolute"):
            raise ConfigError("--position-embedding-type must be rope or learned_absolute")
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ConfigError("--normalization must be RMSNorm or LayerNorm")
        if self.max_position_embeddings < self.seq_length and self.position_embedding_type != "rope":
            raise ConfigError("--max-position-embeddings must be >= --seq-length")

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by × TP."""
        if self.vocab_size is None:
            raise ConfigError("the vocabulary size is unknown: give --tokenizer-model or --vocab-size")
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    use_distributed_optimizer: bool = False

    def validate(self, model: ModelConfig, world_size: int) -> None:
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        for flag, value in (("tensor", tp), ("pipeline", pp)):
            if value < 1:
                raise ConfigError(f"--{flag}-model-parallel-size must be >= 1 (got {value})")
        if cp < 1:
            raise ConfigError(f"--context-parallel-size must be >= 1 (got {cp})")
        if world_size % (tp * pp * cp):
            raise ConfigError(
                f"world size {world_size} is not divisible by TP×PP×CP = {tp}×{pp}×{cp}: change the "
                "parallel sizes or the number of ranks"
            )
        first, last = self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers
        if pp > 1:
            middle_layers = model.num_layers - (first or 0) - (last or 0)
            middle_stages = pp - (first is not None) - (last is not None)
            if middle_layers < 0 or (middle_stages and middle_layers % middle_stages) or (
                not middle_stages and middle_layers
            ):
                raise ConfigError(
                    f"--num-layers {model.num_layers} cannot be split over --pipeline-model-parallel-size "
                    f"{pp} stages: use a layer count divisible by the number of stages (or set "
                    "--decoder-first/last-pipeline-num-layers)"
                )
        if self.num_layers_per_virtual_pipeline_stage is not None:
            if pp < 2:
                raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
            if model.num_layers % (pp * self.num_layers_per_virtual_pipeline_stage):
                raise ConfigError(
                    f"--num-layers {model.num_layers} is not divisible by PP × layers per virtual stage = "
                    f"{pp} × {self.num_layers_per_virtual_pipeline_stage}"
                )
        if self.sequence_parallel and tp == 1:
            self.sequence_parallel = False  # as Megatron-LM: sequence parallelism needs TP > 1
        heads = model.num_attention_heads
        groups = model.num_query_groups or heads
        if heads % tp or groups % tp:
            raise ConfigError(
                f"--tensor-model-parallel-size {tp} must divide --num-attention-heads {heads} and "
                f"--num-query-groups {groups}"
            )
        if model.ffn_hidden_size % tp:
            raise ConfigError(f"--ffn-hidden-size {model.ffn_hidden_size} is not divisible by TP {tp}")

    @property
    def virtual_pipeline_model_parallel_size(self) -> int | None:
        return None  # resolved by the model builder from num_layers_per_virtual_pipeline_stage


@dataclass
class Preset:
    """An architecture from the paper; explicit flags override each field."""

    model: ModelConfig
    source: str = ""
    extra: dict = field(default_factory=dict)


# The paper gives layers × hidden (12×768, 16×2048, 30×3072). Heads, FFN width and vocabulary follow
# the Llama recipes of those widths (see README "Model presets" for where each number comes from).
PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        ModelConfig(num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                    num_query_groups=2, seq_length=128),
        "CPU demo/test size; not from the paper",
    ),
    "llama-170m": Preset(
        ModelConfig(num_layers=12, hidden_size=768, ffn_hidden_size=2048, num_attention_heads=12,
                    seq_length=2048),
        "paper: 12 layers × 768; 12 heads of 64 and FFN 8/3·h (2048) as in Llama",
    ),
    "llama-1b": Preset(
        ModelConfig(num_layers=16, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16,
                    seq_length=2048),
        "paper: 16 layers × 2048; 16 heads of 128 and FFN 5632 as in TinyLlama-1.1B",
    ),
    "llama-3.4b": Preset(
        ModelConfig(num_layers=30, hidden_size=3072, ffn_hidden_size=8192, num_attention_heads=24,
                    seq_length=2048),
        "paper: 30 layers × 3072; 24 heads of 128 and FFN 8/3·h (8192) as in Llama-3.2-3B",
    ),
}
