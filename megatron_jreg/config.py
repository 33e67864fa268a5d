"""Configuration dataclasses. Flags map onto these one to one; `validate()` runs once, before any work,
and every error names the flag and the fix."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megatron_jreg.plugin import JregConfig

__all__ = [
    "ModelConfig", "ParallelConfig", "OptimConfig", "DataConfig", "CheckpointConfig", "LoggingConfig",
    "PrecisionConfig", "TrainConfig", "JregConfig", "PRESETS", "ConfigError", "parse_blend", "train_config_from_dict",
]


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
    untie_embeddings_and_output_weights: bool = False  # Megatron-LM default: tied
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
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False

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
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer")
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


# The paper gives layers × hidden (12×768, 16×2048, 30×3072) and the names 170M/1B/3.4B. Heads, query
# groups, FFN width, RoPE base and tied embeddings follow Llama-3.2 (1B: 16×2048, 32 heads, 8 KV heads,
# FFN 8192; 3B: 24 heads, 8 KV heads, FFN 8192); with the Llama-3 tokenizer (128,256 tokens) and tied
# embeddings the parameter counts come out at 174M, 1.24B and 3.41B, matching the paper's names.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        ModelConfig(num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                    num_query_groups=2, seq_length=128),
        "CPU demo/test size; not from the paper",
    ),
    "llama-170m": Preset(
        ModelConfig(num_layers=12, hidden_size=768, ffn_hidden_size=2048, num_attention_heads=12,
                    num_query_groups=4, seq_length=2048, rotary_base=500000),
        "paper: 12 layers × 768; 12 heads of 64, 4 KV groups, FFN 2048 (8/3·h) in Llama-3.2 proportions",
    ),
    "llama-1b": Preset(
        ModelConfig(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                    num_query_groups=8, seq_length=2048, rotary_base=500000),
        "paper: 16 layers × 2048; heads, KV groups and FFN of Llama-3.2-1B",
    ),
    "llama-3.4b": Preset(
        ModelConfig(num_layers=30, hidden_size=3072, ffn_hidden_size=8192, num_attention_heads=24,
                    num_query_groups=8, seq_length=2048, rotary_base=500000),
        "paper: 30 layers × 3072; heads, KV groups and FFN of Llama-3.2-3B",
    ),
}


@dataclass
class OptimConfig:
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # default: micro_batch_size × data-parallel size
    train_iters: int = 1000
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # default: train_iters
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    calculate_per_token_loss: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    initial_loss_scale: float = 2.0**16  # fp16 only

    def validate(self) -> None:
        if self.micro_batch_size < 1:
            raise ConfigError(f"--micro-batch-size must be >= 1 (got {self.micro_batch_size})")
        if self.train_iters < 0:
            raise ConfigError(f"--train-iters must be >= 0 (got {self.train_iters})")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need 0 <= --min-lr <= --lr and --lr > 0 (got lr={self.lr}, min_lr={self.min_lr})")
        if self.lr_decay_style not in ("cosine", "linear", "constant", "inverse-square-root"):
            raise ConfigError("--lr-decay-style must be cosine, linear, constant or inverse-square-root")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ConfigError("--recompute-granularity must be full or selective")
        if self.recompute_granularity == "full" and self.recompute_method is None:
            self.recompute_method, self.recompute_num_layers = "uniform", self.recompute_num_layers or 1
        if self.clip_grad < 0:
            raise ConfigError("--clip-grad must be >= 0 (0 disables clipping)")

    def microbatches(self, data_parallel_size: int) -> int:
        """Gradient-accumulation steps per iteration; the global batch must split evenly."""
        gbs = self.global_batch_size or self.micro_batch_size * data_parallel_size
        per_step = self.micro_batch_size * data_parallel_size
        if gbs % per_step:
            raise ConfigError(
                f"--global-batch-size {gbs} is not divisible by --micro-batch-size × data-parallel size = "
                f"{self.micro_batch_size} × {data_parallel_size}: choose a multiple of {per_step}"
            )
        return gbs // per_step


@dataclass
class DataConfig:
    data_path: list[str] | None = None  # Megatron-LM blend: "PREFIX" or "W1 PREFIX1 W2 PREFIX2 ..."
    train_data_path: list[str] | None = None
    valid_data_path: list[str] | None = None
    test_data_path: list[str] | None = None
    split: str = "969,30,1"
    mock_data: bool = False
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None  # for --mock-data without a tokenizer
    data_cache_path: str | None = None
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    def validate(self) -> None:
        sources = [self.data_path, self.train_data_path]
        if not self.mock_data and not any(sources):
            raise ConfigError("no training data: give --data-path PREFIX (or --train-data-path), or --mock-data")
        if self.mock_data and any(sources):
            raise ConfigError("--mock-data and --data-path/--train-data-path exclude each other")
        if self.tokenizer_type is None and self.vocab_size is None:
            raise ConfigError("give --tokenizer-type/--tokenizer-model (or --vocab-size with --mock-data)")
        for paths in (self.data_path, self.train_data_path, self.valid_data_path, self.test_data_path):
            for prefix in parse_blend(paths)[0] if paths else []:
                missing = [ext for ext in (".bin", ".idx") if not Path(prefix + ext).is_file()]
                if missing:
                    raise ConfigError(
                        f"--data-path prefix {prefix!r}: {prefix}{missing[0]} not found (the prefix is the path "
                        "without .bin/.idx, e.g. my-data_text_document)"
                    )


def parse_blend(values: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron-LM's --data-path: prefixes, or alternating weight prefix pairs."""
    if len(values) == 1:
        return [values[0]], None
    try:
        weights = [float(v) for v in values[0::2]]
    except ValueError:
        return list(values), None  # several prefixes, equal weights
    if len(values) % 2:
        raise ConfigError("--data-path with weights needs pairs: W1 PREFIX1 W2 PREFIX2 ...")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError("--data-path weights must be >= 0 and not all 0")
    return list(values[1::2]), weights


@dataclass
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False  # load weights only; fresh optimizer, scheduler and iteration count
    exit_signal_handler: bool = True  # SIGTERM: save and exit (Slurm preemption)
    exit_interval: int | None = None

    def validate(self) -> None:
        if self.save_interval is not None and self.save_interval < 1:
            raise ConfigError("--save-interval must be >= 1")
        if self.save_interval and not self.save:
            raise ConfigError("--save-interval needs --save DIR")


@dataclass
class LoggingConfig:
    log_interval: int = 10
    eval_interval: int | None = 1000
    eval_iters: int = 10
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    metrics_file: str | None = None
    skip_train: bool = False  # load, evaluate once, exit
    progress: bool | None = None  # None: a progress line when stdout is a terminal

    def validate(self) -> None:
        if self.log_interval < 1:
            raise ConfigError("--log-interval must be >= 1")
        if self.eval_interval is not None and self.eval_interval < 1:
            raise ConfigError("--eval-interval must be >= 1")
        if self.wandb_project:
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise ConfigError("--wandb-project needs the wandb package: pip install wandb") from None


@dataclass
class PrecisionConfig:
    bf16: bool = False
    fp16: bool = False
    transformer_impl: str | None = None  # transformer_engine | local; None = TE when importable
    fp8_format: str | None = None  # e4m3 | hybrid
    fp8_recipe: str = "delayed"  # delayed | tensorwise | mxfp8 | blockwise
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"
    fp8_param_gather: bool = False

    def validate(self) -> None:
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 exclude each other")
        if self.transformer_impl not in (None, "transformer_engine", "local"):
            raise ConfigError("--transformer-impl must be transformer_engine or local")


@dataclass
class TrainConfig:
    """Everything `megatron-jreg train` needs; built from flags by training/args.py."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    jreg: JregConfig = field(default_factory=JregConfig)
    seed: int = 1234
    init_mode: str = "layout-independent"  # or "megatron" (megatron-core's own per-rank init)
    preset: str | None = None

    def validate(self, world_size: int) -> None:
        """All checks that need no model or data loading; raise ConfigError naming the flag."""
        self.model.validate()
        self.parallel.validate(self.model, world_size)
        self.optim.validate()
        self.data.validate()
        self.checkpoint.validate()
        self.logging.validate()
        self.precision.validate()
        try:
            self.jreg.validate(self.model.num_layers)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.precision.fp8_param_gather and not self.parallel.use_distributed_optimizer:
            raise ConfigError("--fp8-param-gather gathers FP8 parameters in the distributed optimizer: add "
                              "--use-distributed-optimizer (or drop the flag)")
        if self.init_mode not in ("layout-independent", "megatron"):
            raise ConfigError("--init-mode must be layout-independent or megatron")
        if self.parallel.context_parallel_size > 1 and self.precision.transformer_impl == "local":
            raise ConfigError(
                "--context-parallel-size > 1 needs Transformer Engine attention: use --transformer-impl "
                "transformer_engine on a GPU image"
            )
        self.optim.microbatches(self.data_parallel_size(world_size))

    def data_parallel_size(self, world_size: int) -> int:
        p = self.parallel
        return world_size // (
            p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
        )


def train_config_from_dict(values: dict) -> TrainConfig:
    """Rebuild a TrainConfig from `dataclasses.asdict` output (e.g. a checkpoint's megatron_jreg.json)."""
    import dataclasses

    cfg = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        if f.name not in values:
            continue
        current = getattr(cfg, f.name)
        if dataclasses.is_dataclass(current):
            known = {x.name for x in dataclasses.fields(current)}
            setattr(cfg, f.name, type(current)(**{k: v for k, v in values[f.name].items() if k in known}))
        else:
            setattr(cfg, f.name, values[f.name])
    return cfg
