"""One JREG forward-backward of a tiny Llama under a given parallel layout (runs inside gloo ranks).

Every layout sees the same global batch and the same layout-independent initial weights, so the loss,
the Ψ vector and the full (unsharded) gradients must agree across layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SEQ, VOCAB, BATCH, LAYERS, SEED = 16, 128, 4, 4, 7


@dataclass
class Layout:
    name: str
    tp: int = 1
    pp: int = 1
    vpp_layers: int | None = None
    sp: bool = False
    first: int | None = None
    last: int | None = None
    microbatches: int = 2
    recompute: str | None = None  # None | "full" | "selective"
    per_token: bool = False
    loss_scale: float | None = None
    lam: float = 1.0
    alpha: float = 1.0
    distance: str = "angular"


def transformer_config(layout: Layout | None = None, **overrides):
    """megatron-core's TransformerConfig of the tiny Llama (RoPE, RMSNorm, SwiGLU, GQA, no biases)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    layout = layout or Layout("one")
    vpp = LAYERS // (layout.pp * layout.vpp_layers) if layout.vpp_layers else None
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, use_cpu_initialization=True, transformer_impl="local", pipeline_dtype=torch.float32,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=vpp, sequence_parallel=layout.sp,
        num_layers_in_first_pipeline_stage=layout.first, num_layers_in_last_pipeline_stage=layout.last,
        **overrides,
    )


def build_chunks(config) -> list:
    """GPTModel chunks of this rank (one per virtual stage) through Megatron-LM's model builder, with
    megatron-jreg's layer spec (training/model.py), as `megatron-jreg train` builds them."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

    from megatron_jreg.layer_spec import layer_spec

    cfg = GPTModelConfig(transformer=config, transformer_layer_spec=layer_spec, vocab_size=VOCAB,
                         make_vocab_size_divisible_by=64, should_pad_vocab=True, seq_length=SEQ,
                         position_embedding_type="rope", share_embeddings_and_output_weights=True)
    builder, pg = GPTModelBuilder(cfg), ProcessGroupCollection.use_mpu_process_groups()
    vpp = config.virtual_pipeline_model_parallel_size
    return [builder.build_model(pg, vp_stage=v) for v in (range(vpp) if vpp else [None])]


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def setup(layout: Layout):
    """Initialise parallel state and build DDP-wrapped model chunks + the JREG plugin."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_jreg.plugin import JregConfig, JregPlugin
    from megatron_jreg.training.sharding import init_layout_independent

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    overrides: dict = {"calculate_per_token_loss": layout.per_token}
    if layout.recompute == "full":
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif layout.recompute == "selective":
        overrides.update(recompute_granularity="selective")
    config = transformer_config(layout, **overrides)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
    )
    model_parallel_cuda_manual_seed(SEED)
    chunks = build_chunks(config)
    init_layout_independent(chunks, config, SEED)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    ddp = [DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    config.finalize_model_grads_func = finalize_model_grads
    if layout.loss_scale is not None:
        config.grad_scale_func = lambda loss: loss * layout.loss_scale
    plugin = JregPlugin(ddp, JregConfig(lam=layout.lam, alpha=layout.alpha, distance=layout.distance))
    return config, ddp, plugin


def lm_loss_func(labels_mask: torch.Tensor):
    import torch

    def loss_func(output: torch.Tensor):
        total = (output.float() * labels_mask).sum()
        count = labels_mask.sum().to(torch.int)
        return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}

    return loss_func


def forward_step(data_iterator, model):
    import torch

    tokens, labels = next(data_iterator)
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, None, labels=labels)
    return output, lm_loss_func(torch.ones_like(labels, dtype=torch.float32))


def run_layout(layout: Layout, grads: bool = True) -> dict:
    """One forward-backward on the global batch; returns lm loss, Ψ stats and full gradients."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_jreg.training.sharding import gather_full

    config, ddp, plugin = setup(layout)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tokens, labels = global_batch()
    rows = BATCH // dp
    tokens, labels = tokens[dp_rank * rows:(dp_rank + 1) * rows], labels[dp_rank * rows:(dp_rank + 1) * rows]
    mbs = rows // layout.microbatches
    micro = [(tokens[i * mbs:(i + 1) * mbs], labels[i * mbs:(i + 1) * mbs]) for i in range(layout.microbatches)]
    iterators = [iter(list(micro)) for _ in ddp]
    for chunk in ddp:
        chunk.zero_grad_buffer()
    plugin.start_step(layout.microbatches)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(ddp) > 1 else iterators[0],
        model=ddp,
        num_microbatches=layout.microbatches,
        seq_length=SEQ,
        micro_batch_size=mbs,
        forward_only=False,
    )
    stats = plugin.finish_step()
    # One rank per DP replica (TP rank 0 of the last stage) contributes its mean lm loss.
    counting = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    lm = torch.zeros(2, dtype=torch.float64)
    if counting:
        pairs = torch.stack([x["lm loss"].double() for x in losses])
        lm = torch.tensor([(pairs[:, 0] / pairs[:, 1]).mean().item(), 1.0], dtype=torch.float64)
    dist.all_reduce(lm)
    result = {"lm_loss": (lm[0] / lm[1]).item(), "psi": stats.psi, "jreg_loss": stats.jreg_loss,
              "psi_distance": stats.psi_distance}
    if grads:
        full = gather_full(ddp, value=lambda p: p.main_grad)
        if dist.get_rank() == 0:
            result["grads"] = full
    return result


def run_layouts(rank: int, world: int, layouts: list[Layout]) -> list[dict]:
    return [run_layout(layout) for layout in layouts]


def explicit_reference(rank: int, world: int, layout: Layout) -> dict:
    """The same loss written out by hand on one rank: mean over microbatches of CE + λ Σ w_ℓ Ψ_ℓ,
    with Ψ from plain hooks and `jreg.displacement`, differentiated by autograd (no plugin, no DDP)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_jreg import jreg
    from megatron_jreg.training.sharding import gather_full, init_layout_independent

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(SEED)
    config = transformer_config()
    (gpt,) = build_chunks(config)
    init_layout_independent([gpt], config, SEED)
    pairs: dict[int, tuple] = {}

    def capture(layer, args, kwargs, output):
        pairs[layer.layer_number] = (kwargs["hidden_states"], output[0])

    for m in gpt.modules():
        if isinstance(m, TransformerLayer):
            m.register_forward_hook(capture, with_kwargs=True)
    weights = jreg.layer_weights(LAYERS, layout.alpha)
    tokens, labels = global_batch()
    mbs = BATCH // layout.microbatches
    total = 0.0
    psis = []
    for i in range(layout.microbatches):
        t, lab = tokens[i * mbs:(i + 1) * mbs], labels[i * mbs:(i + 1) * mbs]
        ce = gpt(t, torch.arange(SEQ).unsqueeze(0).expand_as(t), None, labels=lab).float().mean()
        psi = torch.stack([jreg.displacement(*pairs[ell], kind=layout.distance) for ell in range(1, LAYERS + 1)])
        psis.append(psi.detach())
        total = total + (ce + layout.lam * jreg.jreg_loss(psi, weights)) / layout.microbatches
    total.backward()
    return {"psi": torch.stack(psis).mean(0).tolist(), "grads": gather_full([gpt], value=lambda p: p.grad)}


def cp_split_penalty(rank: int, world: int) -> dict:
    """Context parallelism on split hidden states: each CP rank holds megatron's load-balanced pair of
    sequence chunks; the plugin's penalty, Ψ and gradients must equal the unsplit computation."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    from megatron_jreg import jreg
    from megatron_jreg.plugin import JregConfig, JregPlugin

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    cp = world
    ps.initialize_model_parallel(context_parallel_size=cp)
    layers, s, b, h, lam, alpha = 3, 8, 2, 16, 0.7, 1.0
    holder = torch.nn.Module()
    holder.config = TransformerConfig(num_layers=layers, hidden_size=h, num_attention_heads=2, context_parallel_size=cp)
    g = torch.Generator().manual_seed(3)
    h0 = torch.randn(s, b, h, generator=g)
    mats = [torch.randn(h, h, generator=g) / h**0.5 for _ in range(layers)]
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, -3:] = False  # right padding in sequence 1

    def run(x, ws, on_layer):
        for ell, w in enumerate(ws, 1):
            y = x + torch.tanh(x @ w)  # token-wise, so the CP split is exact
            x = on_layer(ell, x, y)
        return x

    # Unsplit reference straight from the definition.
    x_ref = h0.clone().requires_grad_(True)
    w_ref = [m.clone().requires_grad_(True) for m in mats]
    psi_ref = []

    def ref_layer(ell, x, y):
        psi_ref.append(jreg.displacement(x, y, mask.t()))
        return y

    run(x_ref, w_ref, ref_layer)
    (lam * jreg.jreg_loss(torch.stack(psi_ref), jreg.layer_weights(layers, alpha))).backward()

    # This rank's tokens: chunks r and 2·cp-1-r of the sequence (megatron's load balancing).
    chunks = torch.arange(s).chunk(2 * cp)
    idx = torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])
    x_loc = h0[idx].clone().requires_grad_(True)
    w_loc = [m.clone().requires_grad_(True) for m in mats]
    plugin = JregPlugin([holder], JregConfig(lam=lam, alpha=alpha))
    plugin.start_step(num_microbatches=1)
    plugin.set_token_mask(mask[:, idx])
    out = run(x_loc, w_loc, lambda ell, x, y: plugin.process_layer(ell, True, x, y))
    (out * 0).sum().backward()  # no main loss: only the attached penalty has gradient
    stats = plugin.finish_step()
    grads = torch.stack([w.grad for w in w_loc])
    dist.all_reduce(grads)
    grads /= cp  # DDP averages over the DP×CP group
    return {
        "psi": stats.psi, "psi_ref": [p.item() for p in psi_ref],
        "w_grad": grads, "w_grad_ref": torch.stack([w.grad for w in w_ref]),
        "x_grad": x_loc.grad / cp, "x_grad_ref": x_ref.grad[idx],
        "jreg_loss": stats.jreg_loss,
    }


def train_psi_last(rank: int, world: int, lams: list[float], steps: int = 8) -> dict[float, list[float]]:
    """Ψ_L after each of `steps` AdamW steps on the fixed global batch, for each λ."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    out = {}
    tokens, labels = global_batch()
    for lam in lams:
        config, ddp, plugin = setup(Layout("train", lam=lam, microbatches=1))
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.0), ddp)
        history = []
        for _ in range(steps):
            for chunk in ddp:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            plugin.start_step(1)
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([(tokens, labels)]), model=ddp,
                num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH, forward_only=False,
            )
            history.append(plugin.finish_step().psi[-1])
            optimizer.step()
        out[lam] = history
    return out


SINGLE_LAYOUTS = [
    Layout("single"),
    Layout("full-recompute", recompute="full"),
    Layout("selective-recompute", recompute="selective"),
    Layout("per-token-loss", per_token=True),
    Layout("loss-scale-8", loss_scale=8.0),
    Layout("lambda-0", lam=0.0),
    Layout("cosine", distance="cosine"),
]
TWO_RANK_LAYOUTS = [
    Layout("tp2", tp=2),
    Layout("tp2-sp", tp=2, sp=True),
    Layout("pp2", pp=2),
    Layout("pp2-vpp", pp=2, vpp_layers=1),
    Layout("pp2-uneven-1-3", pp=2, first=1, last=3),
    Layout("dp2", microbatches=1),
    Layout("dp2-per-token", microbatches=1, per_token=True),
]


def hook_counts(lam: float) -> dict[str, int]:
    """Forward hooks installed on the layers: λ=0 installs none unless the step records Ψ."""
    _, _, plugin = setup(Layout("hooks", lam=lam))
    count = lambda: sum(len(layer._forward_hooks) for _, layer in plugin.layers)  # noqa: E731
    plugin.start_step(1, record=False)
    silent = count()
    plugin.start_step(1, record=True)
    recording = count()
    plugin.finish_step()
    return {"silent": silent, "recording": recording, "after": count()}


def single_rank_suite(rank: int, world: int) -> dict:
    return {
        "layouts": run_layouts(rank, world, SINGLE_LAYOUTS),
        "explicit": explicit_reference(rank, world, Layout("explicit")),
        "explicit-cosine": explicit_reference(rank, world, Layout("explicit-cosine", distance="cosine")),
        "train": train_psi_last(rank, world, [0.0, 1.0, 5.0]),
        "hooks": {lam: hook_counts(lam) for lam in (0.0, 1.0)},
    }


def two_rank_suite(rank: int, world: int) -> dict:
    return {"layouts": run_layouts(rank, world, TWO_RANK_LAYOUTS), "cp": cp_split_penalty(rank, world)}
