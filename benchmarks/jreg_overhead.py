"""Forward+backward time and activation memory of JREG (λ = 1) against the plain model (λ = 0).

Same model, batch and process; λ = 0 and λ = 1 steps alternate so machine noise hits both alike.
Memory: peak allocated bytes on GPU; on CPU (no allocator statistics) the bytes of distinct storages
autograd saves for backward, i.e. the activations a step keeps alive, which is what JREG could add to.

    python benchmarks/jreg_overhead.py                       # CPU: hidden 256, 4 layers
    python benchmarks/jreg_overhead.py --preset llama-170m --bf16 --seq-length 2048   # on a GPU

Last line: time_ratio=… memory_ratio=…
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def saved_bytes(run) -> int:
    """Bytes of distinct storages saved for backward while `run()` builds the graph (then backward)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="model preset (default: CPU size, hidden 256)")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--jreg-distance", default="angular")
    args = p.parse_args(argv)

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_jreg.compat import apply_cpu_compat, device, dist_backend
    from megatron_jreg.config import PRESETS, ModelConfig, ParallelConfig, PrecisionConfig
    from megatron_jreg.plugin import JregConfig, JregPlugin
    from megatron_jreg.training.model import build_model_chunks, transformer_config

    apply_cpu_compat()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    dist.init_process_group(dist_backend(), rank=0, world_size=1)
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    if args.preset:
        model = PRESETS[args.preset].model
        model.seq_length = args.seq_length
    else:
        model = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                            num_attention_heads=max(1, args.hidden_size // 64), seq_length=args.seq_length)
    model.vocab_size = args.vocab_size
    precision = PrecisionConfig(bf16=args.bf16)
    config = transformer_config(model, ParallelConfig(), precision)
    chunks = build_model_chunks(config, model, model.padded_vocab_size(1))
    dev = device()
    if dev.type == "cuda":
        chunks = [c.cuda() for c in chunks]
    if args.bf16:
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(config, c) for c in chunks]
    ddp = [DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), c) for c in chunks]
    plugins = {
        lam: JregPlugin(ddp, JregConfig(lam=lam, alpha=1.0, distance=args.jreg_distance)) for lam in (0.0, 1.0)
    }
    b, s = args.micro_batch_size, model.seq_length
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (b, s), generator=g).to(dev)
    labels = torch.randint(0, args.vocab_size, (b, s), generator=g).to(dev)
    position_ids = torch.arange(s, device=dev).unsqueeze(0).expand(b, s)

    def forward_step(_, model):
        out = model(tokens, position_ids, None, labels=labels)
        return out, lambda o: (o.float().mean(), {})

    def step(lam: float) -> None:
        for other in plugins.values():
            other.remove_hooks()
        plugins[lam].start_step(1, record=False)
        for c in ddp:
            c.zero_grad_buffer()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=None, model=ddp,
                                    num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=False)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for lam in (0.0, 1.0, 0.0, 1.0):  # warm-up
        step(lam)
    times: dict[float, list[float]] = {0.0: [], 1.0: []}
    for i in range(args.iters):
        for lam in ((0.0, 1.0) if i % 2 == 0 else (1.0, 0.0)):
            sync()
            t0 = time.perf_counter()
            step(lam)
            sync()
            times[lam].append(time.perf_counter() - t0)
    memory = {}
    for lam in (0.0, 1.0):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            step(lam)
            sync()
            memory[lam] = torch.cuda.max_memory_allocated()
        else:
            memory[lam] = saved_bytes(lambda lam=lam: step(lam))
    med = {lam: statistics.median(v) for lam, v in times.items()}
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    print(f"model: {model.num_layers} layers x {model.hidden_size}, {n_params / 1e6:.1f}M params, batch {b}x{s}, "
          f"{'bf16' if args.bf16 else 'fp32'}, {dev.type}, distance {args.jreg_distance}")
    for lam in (0.0, 1.0):
        print(f"lambda={lam:g}: median step {med[lam] * 1e3:.1f} ms over {len(times[lam])}, "
              f"{'peak allocated' if dev.type == 'cuda' else 'saved activations'} {memory[lam] / 2**20:.1f} MiB")
    print(f"time_ratio={med[1.0] / med[0.0]:.4f} memory_ratio={memory[1.0] / memory[0.0]:.4f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
