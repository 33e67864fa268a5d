"""A megatron-jreg checkpoint as a model to run: for analysis, evaluation and conversion.

Builds the run's GPTModel at TP=1/PP=1 in this process (dist_checkpointing reshards whatever layout the
checkpoint was saved at), loads the weights, and offers logits and the per-layer Ψ sums. Ψ goes through
`JregPlugin` in recording mode: the very code that logs Ψ during training.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_jreg.config import ParallelConfig, PrecisionConfig, TrainConfig, train_config_from_dict
from megatron_jreg.plugin import JregConfig, JregPlugin
from megatron_jreg.training import checkpoint as ckpt


@dataclass
class MegatronModel:
    model: torch.nn.Module  # GPTModel, eval mode
    config: TrainConfig
    iteration: int
    path: Path
    tokenizer: object | None  # megatron_jreg.data.tokenizers.Tokenizer, when the run had one

    @property
    def vocab_size(self) -> int:
        return int(self.config.model.vocab_size)

    @property
    def num_layers(self) -> int:
        return self.config.model.num_layers

    @property
    def seq_length(self) -> int:
        return self.config.model.seq_length

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens[b, t] int64 → fp32 logits[b, t, V] over the true vocabulary (padding columns cut)."""
        tokens = tokens.to(self._device())
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        out = self.model(tokens, position_ids, None)
        return out[..., : self.vocab_size].float()

    @torch.no_grad()
    def layer_sums(
        self, tokens: torch.Tensor, mask: torch.Tensor | None = None, kind: str = "angular"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-layer Σ displacement over real tokens and the token count, (sums[L], counts[L]) float64.

        tokens[b, t], mask[b, t] (1 = real; right padding — the causal mask keeps real tokens blind to it).
        """
        plugin = JregPlugin([self.model], JregConfig(lam=0.0, distance=kind))
        plugin.start_step(1, record=True)
        if mask is not None:
            plugin.set_token_mask(mask.to(self._device()))
        self.logits(tokens)
        stats = plugin.finish_step()
        plugin.remove_hooks()
        count = float(mask.sum()) if mask is not None else float(tokens.numel())
        psi = torch.tensor(stats.psi_distance, dtype=torch.float64)
        return psi * count, torch.full_like(psi, count)


def load_megatron_model(
    path: str | Path,
    iteration: int | None = None,
    dtype: torch.dtype = torch.float32,
    tokenizer_model: str | None = None,
    load_tokenizer: bool = True,
) -> MegatronModel:
    """Load a checkpoint (a save dir or an iter_* dir) into a one-process TP=1/PP=1 model.

    load_tokenizer=False skips the run's tokenizer (e.g. exporting weights whose tokenizer has moved).
    """
    from megatron_jreg.training.data import tokenizer_for
    from megatron_jreg.training.distributed import init_model_parallel, init_process_group
    from megatron_jreg.training.model import build_model_chunks, transformer_config

    ckpt_dir, iteration = ckpt.resolve(path, iteration)
    cfg = train_config_from_dict(ckpt.read_run_config(ckpt_dir))
    cfg.parallel = ParallelConfig()
    if tokenizer_model is not None:
        cfg.data.tokenizer_model = tokenizer_model
    tokenizer = None
    if load_tokenizer and cfg.data.tokenizer_type is not None:
        tokenizer, _ = tokenizer_for(cfg)
    init_process_group()
    init_model_parallel(cfg.model, cfg.parallel, cfg.seed)
    precision = PrecisionConfig(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    tconfig = transformer_config(cfg.model, cfg.parallel, precision)
    (model,) = build_model_chunks(tconfig, cfg.model, cfg.model.padded_vocab_size(1), "local")
    if torch.cuda.is_available():
        model = model.cuda()
    ckpt.load_checkpoint(ckpt_dir, [model], iteration=iteration, load_rng=False)
    model.eval()
    return MegatronModel(model, cfg, iteration, ckpt_dir, tokenizer)
