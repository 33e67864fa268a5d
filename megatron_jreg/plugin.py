"""JREG on megatron-core: forward hooks on each decoder layer add λ·Σ w_ℓ Ψ_ℓ into backward the way megatron-core adds
its MoE auxiliary loss (no schedule edits). Layers, microbatches, recompute, SP/CP scaling and logging: DEVELOPERS.md,
"JREG on megatron-core"."""

from __future__ import annotations

import argparse
import math
from collections import defaultdict, deque
from dataclasses import dataclass, field, fields
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
from megatron.core.utils import get_attr_wrapped_model, get_model_config, get_pg_rank
from torch import Tensor

from megatron_jreg import jreg, jreg_kernels
from megatron_jreg.compat import device as _device
from megatron_jreg.errors import UsageError


def _flag(name: str, help: str, **kwargs: object) -> dict:
    return {"flag": name, "help": help, **kwargs}


@dataclass(frozen=True)
class JregConfig:
    """JREG's settings, said once: the `--jreg-*` flags, their checks and a checkpoint's record come from these."""

    lam: float = field(default=0.0, metadata=_flag(
        "--jreg-lambda", "λ of the JREG penalty λ·Σ w_ℓ Ψ_ℓ (0 = the plain Megatron-LM baseline; paper: 1)",
        type=float))
    alpha: float = field(default=1.0, metadata=_flag(
        "--jreg-alpha", "α of the layer weights w_ℓ = softmax(α·ℓ) (paper's best: 1)", type=float))
    distance: str = field(default="angular", metadata=_flag(
        "--jreg-distance", "displacement Ψ: angular = arccos(cos)/π (paper), cosine = 1 − cos (smooth)",
        choices=jreg.DISTANCES))
    layers: tuple[int, ...] | None = field(default=None, metadata=_flag(
        "--jreg-layers", "penalize only these global layers (1-based); default all", type=int, nargs="+"))
    min_weight: float = field(default=0.0, metadata=_flag(
        "--jreg-min-weight", "skip the term of a layer whose weight w_ℓ is below this (its share of λ; at α = 1 "
        "the lower layers' weights are tiny); default 0: every penalized layer", type=float))

    def __post_init__(self) -> None:
        if not (isinstance(self.lam, int | float) and math.isfinite(self.lam) and self.lam >= 0):
            raise UsageError(f"--jreg-lambda must be >= 0 (got {self.lam}); 0 trains the plain baseline")
        if not (isinstance(self.alpha, int | float) and math.isfinite(self.alpha)):
            raise UsageError(f"--jreg-alpha must be a finite number (got {self.alpha})")
        if self.distance not in jreg.DISTANCES:
            raise UsageError(f"--jreg-distance must be one of {', '.join(jreg.DISTANCES)} (got {self.distance!r})")
        try:
            jreg_kernels.forced_backend()
        except ValueError as e:
            raise UsageError(str(e)) from None
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))
            if not self.layers or not all(isinstance(x, int) and x >= 1 for x in self.layers):
                raise UsageError(f"--jreg-layers {list(self.layers)}: layers are numbered from 1")
            if len(set(self.layers)) < len(self.layers):  # a layer named twice would read as weighted twice
                twice = sorted({x for x in self.layers if self.layers.count(x) > 1})
                raise UsageError(f"--jreg-layers {list(self.layers)}: layer {twice[0]} is named more than once; "
                                 "name each layer once")
        if not (isinstance(self.min_weight, int | float) and 0 <= self.min_weight < 1):
            raise UsageError(f"--jreg-min-weight must be in [0, 1) (got {self.min_weight}): the layer weights sum to 1")

    def check_layers(self, num_layers: int) -> None:
        """--jreg-layers and --jreg-min-weight against the model's depth (known only once the model's flags are)."""
        bad = [x for x in self.layers or () if x > num_layers]
        if bad:
            raise UsageError(f"--jreg-layers {bad}: layers are numbered 1..{num_layers}")
        top = float(jreg.layer_weights(num_layers, self.alpha, self.layers).max())
        if self.lam > 0 and top < self.min_weight:
            raise UsageError(f"--jreg-min-weight {self.min_weight} skips every layer (the largest weight is {top:.4g} "
                             f"at --jreg-alpha {self.alpha}): give a smaller one")

    def check_args(self, args: argparse.Namespace) -> None:
        """JREG's pre-flight checks against Megatron-LM's flags, before any work (training/checks.py runs the rest)."""
        packed = args.sft or args.dataloader_inter_document_masking
        virtual = args.num_layers_per_virtual_pipeline_stage or args.num_virtual_stages_per_pipeline_rank
        readers_only = not packed and (args.pipeline_model_parallel_size > 2 or (
            args.pipeline_model_parallel_size > 1 and virtual is not None))
        if args.eod_mask_loss and args.calculate_per_token_loss and self.lam > 0 and readers_only:
            raise UsageError("--eod-mask-loss with --calculate-per-token-loss and --jreg-lambda > 0: JREG weights each "
                             "microbatch by its loss tokens, which the pipeline stages between the first and last do "
                             "not read here (more than 2 stages, or virtual stages); drop one of the three")

    def weights(self, num_layers: int) -> Tensor:
        """w[L] = softmax(α·ℓ) over the penalized layers, 0 where below --jreg-min-weight (what training uses)."""
        w = jreg.layer_weights(num_layers, self.alpha, self.layers)
        return torch.where(w < self.min_weight, 0.0, w)

    @staticmethod
    def add_flags(group: argparse._ArgumentGroup) -> None:
        """The `--jreg-*` flags, one per field (dest `jreg_<flag>`), with the fields' defaults."""
        for f in fields(JregConfig):
            meta = dict(f.metadata)
            group.add_argument(meta.pop("flag"), default=f.default, **meta)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> JregConfig:
        # a field's default where the args predate its flag (a checkpoint's saved args)
        cfg = cls(**{f.name: getattr(args, f.metadata["flag"][2:].replace("-", "_"), f.default) for f in fields(cls)})
        if getattr(args, "num_layers", None) is not None:
            cfg.check_layers(args.num_layers)
        return cfg

    def record(self) -> dict:
        """What a checkpoint's megatron_jreg.json keeps of the run's JREG settings (keys as the flags)."""
        return {f.metadata["flag"].removeprefix("--jreg-"): (list(v) if isinstance(v := getattr(self, f.name), tuple)
                                                            else v) for f in fields(self)}


@dataclass
class JregStats:
    """Ψ of all L layers for one step (same on every rank). `psi` and ζ use the paper's angular Ψ, `psi_distance` and
    `jreg_loss` the training distance; ζ is NaN over a non-finite state or a zero vector (Ψ reads 0.5 there, an angle
    to nothing), never a jump."""

    psi: list[float]
    jreg_loss: float  # L_cos = Σ w_ℓ Ψ_ℓ under the training distance, before λ
    zeta: dict[str, float] = field(default_factory=dict)  # zeta_L, zeta_L-1, zeta_L-2
    psi_distance: list[float] = field(default_factory=list)
    first_nonfinite_layer: int | None = None  # 1-based ℓ of the first layer with a non-finite Ψ; None: all finite
    zero_fraction: list[float] = field(default_factory=list)  # per ℓ: share of real tokens with a zero h_ℓ−1 or h_ℓ

    @property
    def zero_layers(self) -> list[int]:
        return [ell for ell, z in enumerate(self.zero_fraction, 1) if z > 0]

    @classmethod
    def from_psi(cls, psi: Tensor, weights: Tensor, psi_distance: Tensor | None = None,
                 zero: Tensor | None = None) -> JregStats:
        psi = psi.double().cpu()
        psi_distance = psi if psi_distance is None else psi_distance.double().cpu()
        zero = torch.zeros_like(psi) if zero is None else zero.double().cpu()
        broken = ~(torch.isfinite(psi) & torch.isfinite(psi_distance))
        first = int(broken.nonzero()[0, 0]) + 1 if bool(broken.any()) else None
        zeta = jreg.final_jumps(psi) if psi.numel() >= 2 else {}
        if first is not None or bool((zero > 0).any()):  # no jump rates over a non-finite state or a zero vector
            zeta = dict.fromkeys(zeta, math.nan)
        return cls(psi=psi.tolist(), jreg_loss=float(jreg.jreg_loss(psi_distance, weights)), zeta=zeta,
                   psi_distance=psi_distance.tolist(), first_nonfinite_layer=first, zero_fraction=zero.tolist())


def decoder_layers(model_chunks: list[torch.nn.Module]) -> list[tuple[int, TransformerLayer]]:
    """(ℓ, layer) for the decoder layers of this rank's model chunks, ℓ = 1..L by place in the decoder (not MTP's)."""
    out = []
    for chunk in model_chunks:
        try:
            decoder = get_attr_wrapped_model(chunk, "decoder")
        except RuntimeError:
            continue
        if decoder is None:
            continue
        offset = get_transformer_layer_offset(decoder.config, decoder.vp_stage, get_pg_rank(decoder.pg_collection.pp))
        out += [(offset + i + 1, layer) for i, layer in enumerate(decoder.layers)
                if isinstance(layer, TransformerLayer)]
    return out


@dataclass
class Microbatch:
    """What the hooks need about one microbatch, fixed when its forward starts."""

    mask: Tensor | None  # [s_local, b] rows this rank holds, True = real token; None = all real
    real: Tensor | float | None  # real tokens of the whole microbatch (all slices); None = every token
    loss: Tensor | float | None  # its loss tokens (weighting under per-token loss); None = `real`
    scale: Tensor | float  # the step's scale: loss scale (/num_microbatches ×CP without per-token loss)
    up: Tensor | None = None  # per token [s_local·b]: what λ·w_ℓ multiplies in every layer's term (made once)


class JregPlugin:
    """Attach JREG to megatron-core model chunks. Per step: `start_step(num_microbatches, record=...)`, megatron's
    forward-backward (`set_token_mask` before the model runs where batches have padding or a per-token loss mask),
    then `finish_step()` for the step's Ψ/ζ/L_cos (collective: every rank calls it)."""

    def __init__(self, model_chunks: list[torch.nn.Module], cfg: JregConfig) -> None:
        if not model_chunks:
            raise ValueError("JregPlugin needs the model chunks of this rank")
        self.chunks = list(model_chunks)
        self.mcfg = get_model_config(model_chunks[0])  # the TransformerConfig under the DDP/Float16 wrappers
        self.num_layers = self.mcfg.num_layers
        cfg.check_layers(self.num_layers)
        self.layers = decoder_layers(model_chunks)  # [(ℓ, layer)]
        self.cfg = cfg
        self.weights = cfg.weights(self.num_layers)  # 0 where --jreg-layers or --jreg-min-weight leave a layer out
        self._weight = self.weights.tolist()  # w_ℓ as Python floats: read per layer call without a device read
        self.penalize = cfg.lam > 0
        self.recording = False
        self._handles: list = []
        self._scale: Tensor | float = 1.0
        self._next = Microbatch(None, None, None, 1.0)  # set_token_mask's, for the next chunk forward
        self._active: Microbatch | None = None  # the microbatch whose chunk forward is running
        self._deferred: dict[int, deque[Microbatch]] = defaultdict(deque)  # ℓ → microbatches to recompute
        self._calls: dict[int, tuple[Microbatch, jreg.LayerPenalty | None]] = {}  # ℓ → its call between the hooks
        self._microbatches = 0
        # [L, 3] fp64 on the activations' device, created on first use: per layer the angular Ψ, the cosine Ψ and
        # the share of real tokens with a zero-vector state, summed over the step's microbatches
        self._sums: Tensor | None = None
        self._tp = self.mcfg.tensor_model_parallel_size
        self._cp = self.mcfg.context_parallel_size
        self._sp = bool(self.mcfg.sequence_parallel) and self._tp > 1

    # -- step protocol -------------------------------------------------------------------------
    def start_step(self, num_microbatches: int, record: bool = True) -> None:
        self._microbatches = num_microbatches
        if self._sums is not None:
            self._sums.zero_()
        self._deferred.clear()
        self._calls.clear()
        self._active = None
        self.recording = record
        loss_scale: Tensor | float = 1.0
        if self.mcfg.grad_scale_func is not None:  # the optimizer's loss scale, kept on device (no sync)
            loss_scale = self.mcfg.grad_scale_func(torch.ones((), device=_device())).detach()
        per_token = self.mcfg.calculate_per_token_loss
        self._scale = loss_scale if per_token else loss_scale * self._cp / num_microbatches
        self._next = Microbatch(None, None, None, self._scale)
        want_hooks = self.penalize or record
        if want_hooks and not self._handles:
            for ell, layer in self.layers:
                self._handles.append(layer.register_forward_pre_hook(partial(self._before_layer, ell),
                                                                     with_kwargs=True))
                self._handles.append(layer.register_forward_hook(partial(self._after_layer, ell), with_kwargs=True))
            for chunk in self.chunks:
                self._handles.append(chunk.register_forward_pre_hook(self._begin_microbatch))
                self._handles.append(chunk.register_forward_hook(self._end_microbatch, always_call=True))
        elif not want_hooks:
            self.remove_hooks()

    def set_token_mask(self, mask: Tensor | None, loss_tokens: Tensor | float | None = None) -> None:
        """The next microbatch on this rank: token mask [b, s] (after the CP split; None = all real) and
        its loss-token count over the whole microbatch (all CP slices; None = its real-token count)."""
        real = rows = None
        if mask is not None:
            real = mask.float().sum()
            if self._cp > 1:
                dist.all_reduce(real, group=parallel_state.get_context_parallel_group())
            real = real.clamp_min(1.0)  # a microbatch without real tokens adds 0 (not 0/0) to Ψ
            tp_rank = parallel_state.get_tensor_model_parallel_rank() if self._sp else 0
            rows = mask.bool().t().chunk(self._tp if self._sp else 1, dim=0)[tp_rank].contiguous()  # [s/tp, b]
        self._next = Microbatch(rows, real, loss_tokens, self._scale)

    def finish_step(self) -> JregStats:
        """Reduce the recorded Ψ over all ranks (one all-reduce) and return the step's statistics."""
        shares = torch.zeros(self.num_layers, 3, dtype=torch.float64, device=_device())
        if self._sums is not None:
            shares += self._sums.to(shares.device)
        if not self._sp and self._tp > 1:
            shares /= self._tp  # replicated over TP: count each value once
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(shares)
        shares = shares.cpu()
        dp = parallel_state.get_data_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
        angular, cosine, zero = (shares / max(self._microbatches, 1) / dp).unbind(1)
        if not self.penalize:
            self.remove_hooks()
        self.recording = False
        self._deferred.clear()
        self._calls.clear()
        distance = None if self.cfg.distance == "angular" else cosine  # ζ is angular whatever the training distance
        return JregStats.from_psi(angular, self.weights, psi_distance=distance, zero=zero)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- the hooks -------------------------------------------------------------------------------
    def _begin_microbatch(self, chunk: torch.nn.Module, args: tuple) -> None:
        self._active, self._next = self._next, Microbatch(None, None, None, self._scale)

    def _end_microbatch(self, chunk: torch.nn.Module, args: tuple, output: object) -> None:
        self._active = None

    def _before_layer(self, ell: int, layer: TransformerLayer, args: tuple, kwargs: dict) -> tuple | None:
        """Open layer ℓ's call; a penalized layer's input goes through its LayerPenalty's identity."""
        call = self._open_call(ell, layer.training)
        if call is None or call[1] is None:
            return None
        penalty = call[1]
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": penalty.watch(kwargs["hidden_states"])}
        return (penalty.watch(args[0]), *args[1:]), kwargs

    def _after_layer(self, ell: int, layer: TransformerLayer, args: tuple, kwargs: dict,
                     output: tuple) -> tuple | None:
        call = self._calls.pop(ell, None)
        if call is None:
            return None
        h_in = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        h_out = output[0] if isinstance(output, tuple) else output
        new = self._close_call(ell, *call, h_in, h_out)
        if new is None:
            return None
        return (new, *output[1:]) if isinstance(output, tuple) else new

    def _microbatch_for(self, ell: int, training: bool) -> Microbatch | None:
        """The microbatch a call of layer ℓ computes; None = the first (no-grad) pass of a checkpointed
        layer, which only queues the microbatch for its recompute in backward."""
        current = self._active if self._active is not None else self._next
        if training and not torch.is_grad_enabled():
            self._deferred[ell].append(current)
            return None
        if self._active is None and training and self._deferred[ell]:
            return self._deferred[ell].popleft()  # a recompute in backward: the oldest queued microbatch
        return current

    def _open_call(self, ell: int, training: bool) -> tuple[Microbatch, jreg.LayerPenalty | None] | None:
        """(its microbatch, its LayerPenalty or None) of a call of layer ℓ; None: it neither records nor penalizes."""
        attach = self.penalize and training and self._weight[ell - 1] > 0
        if not attach and not self.recording:
            return None
        mb = self._microbatch_for(ell, training)
        if mb is None:
            return None
        call = (mb, jreg.LayerPenalty(self.cfg.distance) if attach else None)
        self._calls[ell] = call
        return call

    def process_layer(self, ell: int, training: bool, h_in: Tensor, h_out: Tensor) -> Tensor | None:
        """Both hooks' work for a layer ℓ that has already run on h_in[s, b, h]: record Ψ and, when penalizing, return
        h_out carrying λ·w_ℓ·Ψ_ℓ for backward (∂/∂h_in a tensor of its own that autograd adds); None = unchanged."""
        call = self._open_call(ell, training)
        if call is None:
            return None
        del self._calls[ell]
        return self._close_call(ell, *call, h_in, h_out)

    def _close_call(self, ell: int, mb: Microbatch, penalty: jreg.LayerPenalty | None, h_in: Tensor,
                    h_out: Tensor) -> Tensor | None:
        mask = mb.mask
        if mask is not None and mask.shape != h_out.shape[:2]:
            raise ValueError(f"token mask {tuple(mask.shape)} does not match hidden rows {tuple(h_out.shape[:2])}")
        real = mb.real if mb.real is not None else self._all_tokens(h_out)
        if self.recording:
            figures = jreg.token_figures(h_in, h_out).flatten(1)  # [3, tokens]: angular d, cosine d, zero vector
            if mask is not None:  # where, not multiply: a padded position may hold anything (even inf/NaN)
                figures = torch.where(mask.reshape(-1), figures, 0.0)
            if self._sums is None:
                self._sums = torch.zeros(self.num_layers, 3, dtype=torch.float64, device=h_out.device)
            self._sums[ell - 1] += figures.sum(1).double() / real  # this rank's part of the microbatch's Ψ_ℓ
        if penalty is None:
            return None
        return penalty.attach(h_out, h_in, self._upstream(mb, h_out, real), self.cfg.lam * self._weight[ell - 1])

    def _upstream(self, mb: Microbatch, h_out: Tensor, real: Tensor | float) -> Tensor:
        """The microbatch's per-token factor of every layer's term [s_local·b], made at its first layer: the step's
        scale over its real tokens (× its loss tokens under per-token loss, weighted as megatron weights the CE),
        0 at padding; one value expanded when every token is real."""
        if mb.up is None:
            coef = mb.scale / real
            if self.mcfg.calculate_per_token_loss:
                coef = coef * (mb.loss if mb.loss is not None else real)
            tokens = h_out.shape[0] * h_out.shape[1]
            if mb.mask is not None:
                mb.up = mb.mask.reshape(-1) * coef
            elif isinstance(coef, Tensor):
                mb.up = coef.reshape(1).float().expand(tokens)
            else:
                mb.up = torch.full((1,), coef, dtype=torch.float32, device=h_out.device).expand(tokens)
        return mb.up

    def _all_tokens(self, h: Tensor) -> float:
        """Tokens of the whole microbatch from this rank's hidden rows h[s_local, b, h]."""
        return float(h.shape[0] * h.shape[1] * (self._tp if self._sp else 1) * self._cp)
