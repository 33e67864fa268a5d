"""JREG on megatron-core: collect (h_in, h_out) of every TransformerLayer and add λ·Σ w_ℓ Ψ_ℓ to backward.

How it fits megatron-core (the MoE auxiliary-loss pattern, no schedule edits):
- A forward hook on each `TransformerLayer` this rank owns sees the layer's input and output. With
  grad enabled it computes the layer's term λ·w_ℓ·Ψ_ℓ and attaches it to the *layer output* through a
  small autograd function, so its gradient enters backward on the stage that owns layer ℓ and flows on
  into the activations received from the previous pipeline stage.
- Global layer numbers come from `TransformerLayer.layer_number` (megatron computes it for pipeline
  stages, virtual stages and uneven first/last stages), so w_ℓ is right on every rank.
- Scaling follows megatron's main loss: ×loss-scale of the optimizer, /num_microbatches, ×CP size
  (DDP averages gradients over DP×CP); with `calculate_per_token_loss` the term is a token *sum* and
  megatron's division by the global token count makes it the token mean.
- Tokens: with sequence or context parallelism a rank holds a slice of the tokens. Each rank attaches
  S_local/N where N is the token count of the whole (unsplit) microbatch, so the gradient of each slice
  is exactly its share of ∂Ψ/∂h. Without sequence parallelism hidden states are replicated over TP and
  every TP rank computes the same full term (as megatron does for the cross-entropy).
- Full activation recomputation: the first (no-grad) forward of a checkpointed layer does nothing; the
  recompute does the work, so no activation is kept beyond what recompute keeps.
- Logging: detached per-layer shares are summed over the microbatches and reduced with ONE all-reduce of
  an [L] vector over all ranks per step, so every rank reports the same Ψ, ζ and L_cos.
- λ = 0: no hooks are installed except on steps that record Ψ for logging (detached, no graph).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor
from torch import Tensor

from megatron_jreg import jreg
from megatron_jreg.compat import device as _device


@dataclass
class JregConfig:
    """JREG settings; `lam` = λ (0 disables the penalty), `alpha` = α of w_ℓ = softmax(α·ℓ)."""

    lam: float = 0.0
    alpha: float = 1.0  # the paper's best
    distance: str = "angular"
    layers: list[int] | None = None  # penalized global layers (1-based); None = all

    def validate(self, num_layers: int) -> None:
        if self.lam < 0:
            raise ValueError(f"--jreg-lambda must be >= 0 (got {self.lam}); 0 trains the plain baseline")
        if self.distance not in jreg.DISTANCES:
            raise ValueError(f"--jreg-distance must be one of {jreg.DISTANCES} (got {self.distance!r})")
        if self.layers is not None and not all(1 <= x <= num_layers for x in self.layers):
            raise ValueError(f"--jreg-layers must lie in 1..{num_layers} (got {self.layers})")


@dataclass
class JregStats:
    """Ψ of all L layers for one step (same on every rank) and the figures derived from it.

    `psi` and ζ always use the paper's angular Ψ; `psi_distance` and `jreg_loss` use the training
    distance (identical lists when that is angular).
    """

    psi: list[float]
    jreg_loss: float  # L_cos = Σ w_ℓ Ψ_ℓ under the training distance, before λ
    zeta: dict[str, float] = field(default_factory=dict)  # zeta_L, zeta_L-1, zeta_L-2
    psi_distance: list[float] = field(default_factory=list)

    @classmethod
    def from_psi(cls, psi: Tensor, weights: Tensor, psi_distance: Tensor | None = None) -> JregStats:
        psi = psi.double().cpu()
        psi_distance = psi if psi_distance is None else psi_distance.double().cpu()
        zeta = jreg.final_jumps(psi) if psi.numel() >= 2 else {}
        return cls(psi=psi.tolist(), jreg_loss=float(jreg.jreg_loss(psi_distance, weights)), zeta=zeta,
                   psi_distance=psi_distance.tolist())


class _AttachLoss(torch.autograd.Function):
    """Identity on `output` whose backward also seeds d(term)/d(term) = 1 (term is pre-scaled)."""

    @staticmethod
    def forward(ctx, output: Tensor, term: Tensor) -> Tensor:  # type: ignore[override]
        ctx.term_shape = term.shape
        ctx.term_dtype = term.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        return grad_output, torch.ones(ctx.term_shape, dtype=ctx.term_dtype, device=grad_output.device)


def attach_loss(output: Tensor, term: Tensor) -> Tensor:
    """Return `output` unchanged, with `term` added to the loss that backward differentiates."""
    out = _AttachLoss.apply(output, term)
    return make_viewless_tensor(out, requires_grad=True, keep_graph=True)


def transformer_layers(model_chunks: list[torch.nn.Module]) -> list[TransformerLayer]:
    """All TransformerLayers of this rank's model chunks (virtual pipeline stages included)."""
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]


def sequence_split_mask(mask: Tensor | None, tp_rank: int, tp_size: int) -> Tensor | None:
    """[b, s] token mask → the [s/tp, b] rows this rank holds under sequence parallelism."""
    if mask is None:
        return None
    rows = mask.t()
    if tp_size == 1:
        return rows.contiguous()
    return rows.chunk(tp_size, dim=0)[tp_rank].contiguous()


class JregPlugin:
    """Attach JREG to megatron-core model chunks; see the module docstring for the mechanics.

    Per training step: `start_step(num_microbatches, record=...)`, run megatron's forward-backward
    (calling `set_token_mask` in the forward-step function when batches have padding), then
    `finish_step()` for the Ψ/ζ/L_cos of the step (collective: every rank must call it).
    """

    def __init__(self, model_chunks: list[torch.nn.Module], cfg: JregConfig) -> None:
        self.layers = transformer_layers(model_chunks)
        if not self.layers and not model_chunks:
            raise ValueError("JregPlugin needs the model chunks of this rank")
        self.mcfg = _model_config(model_chunks)
        self.num_layers = self.mcfg.num_layers
        cfg.validate(self.num_layers)
        self.cfg = cfg
        self.weights = jreg.layer_weights(self.num_layers, cfg.alpha, cfg.layers)
        self.penalize = cfg.lam > 0
        self.recording = False
        self._handles: list = []
        self._scale: Tensor | float = 1.0
        self._mask: Tensor | None = None
        self._mask_count: Tensor | None = None
        self._microbatches = 0
        # [2, L] fp64 on the activations' device, created on first use: row 0 Ψ under the training
        # distance, row 1 the angular Ψ (only filled when the training distance is not angular).
        self._sums: Tensor | None = None
        self._angular = cfg.distance == "angular"
        self._tp = self.mcfg.tensor_model_parallel_size
        self._cp = self.mcfg.context_parallel_size
        self._sp = bool(self.mcfg.sequence_parallel) and self._tp > 1

    # -- step protocol -------------------------------------------------------------------------
    def start_step(self, num_microbatches: int, record: bool = True) -> None:
        """Prepare for one forward-backward (or forward-only) pass over `num_microbatches`."""
        self._microbatches = num_microbatches
        if self._sums is not None:
            self._sums.zero_()
        self.recording = record
        loss_scale: Tensor | float = 1.0
        if self.mcfg.grad_scale_func is not None:  # the optimizer's loss scale, kept on device (no sync)
            loss_scale = self.mcfg.grad_scale_func(torch.ones((), device=_device())).detach()
        if self.mcfg.calculate_per_token_loss:
            self._scale = loss_scale
        else:
            self._scale = loss_scale * self._cp / num_microbatches
        want_hooks = self.penalize or record
        if want_hooks and not self._handles:
            self._handles = [
                layer.register_forward_hook(self._hook, with_kwargs=True) for layer in self.layers
            ]
        elif not want_hooks:
            self.remove_hooks()

    def set_token_mask(self, mask: Tensor | None) -> None:
        """Token mask [b, s] of the next microbatch on this rank (after the CP split); None = all real."""
        if mask is None:
            self._mask, self._mask_count = None, None
            return
        count = mask.float().sum()
        if self._cp > 1:
            from megatron.core import parallel_state

            dist.all_reduce(count, group=parallel_state.get_context_parallel_group())
        tp_rank = _tp_rank() if self._sp else 0
        self._mask = sequence_split_mask(mask.bool(), tp_rank, self._tp if self._sp else 1)
        self._mask_count = count

    def finish_step(self) -> JregStats:
        """Reduce the recorded Ψ over all ranks (one all-reduce) and return the step's statistics."""
        shares = torch.zeros(2, self.num_layers, dtype=torch.float64, device=_device())
        if self._sums is not None:
            shares += self._sums.to(shares.device)
        if not self._sp and self._tp > 1:
            shares /= self._tp  # replicated over TP: count each value once
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(shares)
        shares = shares.cpu()
        from megatron.core import parallel_state

        dp = parallel_state.get_data_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
        psi = shares / max(self._microbatches, 1) / dp
        if not self.penalize:
            self.remove_hooks()
        self.recording = False
        if self._angular:
            return JregStats.from_psi(psi[0], self.weights)
        return JregStats.from_psi(psi[1], self.weights, psi_distance=psi[0])

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- the hook --------------------------------------------------------------------------------
    def _token_count(self, h: Tensor) -> Tensor | float:
        if self._mask_count is not None:
            return self._mask_count
        return float(h.shape[0] * h.shape[1] * (self._tp if self._sp else 1) * self._cp)

    def _hook(self, layer: TransformerLayer, args: tuple, kwargs: dict, output: tuple) -> tuple | None:
        h_in = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        h_out = output[0] if isinstance(output, tuple) else output
        new = self.process_layer(layer.layer_number, layer.training, h_in, h_out)
        if new is None:
            return None
        return (new, *output[1:]) if isinstance(output, tuple) else new

    def process_layer(self, layer_number: int, training: bool, h_in: Tensor, h_out: Tensor) -> Tensor | None:
        """Record Ψ of global layer `layer_number` from h_in/h_out[s, b, h] (this rank's tokens) and,
        when penalizing, return h_out carrying λ·w_ℓ·Ψ_ℓ for backward; None = output unchanged."""
        grad = torch.is_grad_enabled()
        if training and not grad:
            return None  # first pass of full recompute: the recompute will do the work
        weight = float(self.weights[layer_number - 1])
        attach = self.penalize and training and weight > 0
        if not attach and not self.recording:
            return None
        mask = self._mask
        if mask is not None and mask.shape != h_out.shape[:2]:
            raise ValueError(f"token mask {tuple(mask.shape)} does not match hidden rows {tuple(h_out.shape[:2])}")
        if attach:
            total, _ = jreg.displacement_sum(h_in, h_out, mask, self.cfg.distance)
        else:
            with torch.no_grad():
                total, _ = jreg.displacement_sum(h_in.detach(), h_out.detach(), mask, self.cfg.distance)
        count = self._token_count(h_out)
        if self.recording:
            if self._sums is None:
                self._sums = torch.zeros(2, self.num_layers, dtype=torch.float64, device=h_out.device)
            self._sums[0, layer_number - 1] += (total.detach() / count).double()
            if not self._angular:  # ζ is defined on the angular Ψ whatever the training distance
                with torch.no_grad():
                    angular, _ = jreg.displacement_sum(h_in.detach(), h_out.detach(), mask, "angular")
                self._sums[1, layer_number - 1] += (angular / count).double()
        if not attach:
            return None
        if self.mcfg.calculate_per_token_loss:
            term = total * (self.cfg.lam * weight * self._scale)
        else:
            term = total * (self.cfg.lam * weight * self._scale / count)
        return attach_loss(h_out, term)


def _tp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def _model_config(model_chunks: list[torch.nn.Module]):
    """The TransformerConfig of the (possibly DDP/Float16-wrapped) model."""
    for chunk in model_chunks:
        module = chunk
        while module is not None:
            cfg = getattr(module, "config", None)
            if cfg is not None and hasattr(cfg, "num_layers"):
                return cfg
            module = getattr(module, "module", None)
    raise ValueError("could not find a megatron TransformerConfig on the model chunks")
