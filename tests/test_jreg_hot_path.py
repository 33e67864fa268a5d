"""JREG's per-microbatch path on megatron-core (real gloo ranks): no host-device synchronisation on a step
that does not log, no forward computation on such a step and its gradients added into the incoming ones in place,
non-finite hidden states named where they start, and no activation kept for backward beyond the two hidden states
JREG's backward reads.

The sync check patches every torch entry point that makes the host wait for the device (`.item()`,
`float(t)`, `bool(t)`, `.tolist()`, `.cpu()`, `torch.tensor(data)` (a host-to-device copy), `nonzero`, ...)
to raise when it is called from megatron-jreg's JREG code (plugin, jreg, kernels), and runs whole
training steps through megatron-core's schedule: forward, backward, full-recompute, a padded (SFT) token
mask and an unmasked microbatch. On CPU these calls cost nothing, on a GPU each one stalls the stream.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks

pytestmark = pytest.mark.multirank

# Modules whose code runs per layer and per microbatch (megatron_jreg/compat.py's device redirection is
# on the stack of every megatron call and is not JREG's).
HOT_MODULES = ("plugin.py", "jreg.py", "jreg_kernels.py", "jreg_triton.py")


def _caller_in_jreg(skip: int = 2) -> str | None:
    """'file:line' of the innermost frame of a JREG hot-path module on the stack, or None."""
    import os
    import sys

    import megatron_jreg

    root = os.path.dirname(megatron_jreg.__file__)
    frame = sys._getframe(skip)
    while frame is not None:
        name = frame.f_code.co_filename
        if os.path.dirname(name) == root and os.path.basename(name) in HOT_MODULES:
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class HostSyncError(AssertionError):
    pass


def _no_host_sync():
    """Context manager: torch's host-sync entry points raise HostSyncError when JREG's code calls them."""
    import contextlib

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[str] = []

    def guard(owner, name):
        original = getattr(owner, name)

        def patched(*args, **kwargs):
            where = _caller_in_jreg()
            if where is not None:
                calls.append(f"{name} at {where}")
                raise HostSyncError(f"host sync: {name} called at {where}")
            return original(*args, **kwargs)

        return original, patched

    entry_points = [(torch.Tensor, n) for n in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__",
                                                "numpy", "cpu", "nonzero")]
    entry_points += [(torch, n) for n in ("tensor", "as_tensor", "nonzero", "masked_select")]
    entry_points += [(torch.cuda, "synchronize")]

    class SyncOps(TorchDispatchMode):
        # Ops that read a device value on the host (item/float/bool), copy host data in (torch.tensor), or
        # size their output from device data.
        SYNC = {"_local_scalar_dense", "lift_fresh", "nonzero", "masked_select", "is_nonzero", "equal"}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in self.SYNC:
                where = _caller_in_jreg()
                if where is not None:
                    calls.append(f"aten.{name} at {where}")
                    raise HostSyncError(f"host sync: aten.{name} at {where}")
            return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def active():
        saved = []
        try:
            for owner, name in entry_points:
                original, patched = guard(owner, name)
                saved.append((owner, name, original))
                setattr(owner, name, patched)
            with SyncOps():
                yield calls
        finally:
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)

    return active()


def _masked_microbatches():
    """Two microbatches of the tiny model's global batch: one with end padding (SFT), one unmasked."""
    import torch

    from tests._layouts import BATCH, SEQ, global_batch

    tokens, labels = global_batch()
    half = BATCH // 2
    mask = torch.ones(half, SEQ, dtype=torch.bool)
    mask[1, -5:] = False
    return [(tokens[:half], labels[:half], mask), (tokens[half:], labels[half:], None)]


def _step(config, ddp, plugin, record: bool, batches) -> list:
    """One forward-backward through megatron-core's schedule, JREG's token mask set per microbatch."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests._layouts import SEQ, lm_loss_func

    def forward_step(data_iterator, model):
        tokens, labels, mask = next(data_iterator)
        plugin.set_token_mask(mask)
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        output = model(tokens, position_ids, None, labels=labels)
        return output, lm_loss_func(torch.ones_like(labels, dtype=torch.float32))

    for chunk in ddp:
        chunk.zero_grad_buffer()
    plugin.start_step(len(batches), record=record)
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(list(batches)), model=ddp,
        num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=batches[0][0].shape[0], forward_only=False,
    )


def sync_and_fault_suite(rank: int, world: int) -> dict:
    import torch

    from tests._layouts import Layout, setup

    out: dict = {}
    batches = _masked_microbatches()
    for distance in ("angular", "cosine"):
        config, ddp, plugin = setup(Layout("sync", recompute="full", distance=distance))
        _step(config, ddp, plugin, True, batches)  # warm-up (kernels compiled), then the checked steps
        plugin.finish_step()
        for record in (False, True):  # a non-logging step, and a logging step up to finish_step
            try:
                with _no_host_sync():
                    _step(config, ddp, plugin, record, batches)
                out[(distance, record)] = "ok"
            except HostSyncError as e:
                out[(distance, record)] = str(e)
            plugin.finish_step()
    for recompute in (None, "full"):  # where the kernels write, with and without megatron's checkpointing
        config, ddp, plugin = setup(Layout(f"in-place-{recompute}", recompute=recompute))
        _step(config, ddp, plugin, True, batches)
        plugin.finish_step()
        for record in (False, True):
            with _kernel_calls() as calls:
                _step(config, ddp, plugin, record, batches)
            plugin.finish_step()
            out[("calls", recompute, record)] = calls
    out["layers"], out["microbatches"] = len(plugin.layers), len(batches)
    out["sanity"] = _sanity_check_the_guard()

    # A non-finite hidden state from layer 3 on: Ψ is NaN from layer 3 (never 0.5), ζ NaN, layer 3 named.
    config, ddp, plugin = setup(Layout("fault"))
    layers = dict(plugin.layers)

    def overflow(layer, args, kwargs, output):
        h = output[0].clone()
        h[0, 0, 0] = float("inf")
        return (h, *output[1:])

    handle = layers[3].register_forward_hook(overflow, with_kwargs=True)
    _step(config, ddp, plugin, True, batches)
    stats = plugin.finish_step()
    out["fault"] = {"psi": stats.psi, "zeta": stats.zeta, "first": stats.first_nonfinite_layer}
    handle.remove()
    _step(config, ddp, plugin, True, batches)
    stats = plugin.finish_step()
    out["clean"] = {"psi": stats.psi, "first": stats.first_nonfinite_layer}
    # A non-finite state at a padded position is not a real token: Ψ stays finite.
    padded = [(t, lab, torch.zeros_like(m) if m is not None else None) for t, lab, m in batches]
    padded[0][2][:, :4] = True

    def overflow_padding(layer, args, kwargs, output):
        h = output[0].clone()
        h[-1, 0, :] = float("nan")  # last position of sequence 0: padding (the last layer: nothing attends to it)
        return (h, *output[1:])

    handle = layers[4].register_forward_hook(overflow_padding, with_kwargs=True)
    _step(config, ddp, plugin, True, padded[:1])
    stats = plugin.finish_step()
    out["padding"] = {"psi": stats.psi, "first": stats.first_nonfinite_layer}
    handle.remove()
    return out


def _kernel_calls():
    """Context manager: the calls of jreg_kernels' entry points, {name: [whether each wrote into its incoming gradient]}
    (forward: [None])."""
    import contextlib
    from unittest import mock

    from megatron_jreg import jreg_kernels

    calls: dict[str, list] = {"forward": [], "grad_b": [], "grad_a": []}

    def spy(name):
        original = getattr(jreg_kernels, name)

        def wrapped(*args, **kwargs):
            g = {"grad_b": 5, "grad_a": 3}.get(name)
            calls[name].append(None if g is None else kwargs["out"].data_ptr() == args[g].data_ptr())
            return original(*args, **kwargs)

        return mock.patch.object(jreg_kernels, name, wrapped)

    @contextlib.contextmanager
    def active():
        with spy("forward"), spy("grad_b"), spy("grad_a"):
            yield calls

    return active()


def _sanity_check_the_guard() -> list[str]:
    """The guard catches what it claims to when called from a JREG module (here: the plugin's globals)."""
    import torch

    from megatron_jreg import plugin

    caught = []
    probes = {
        "item": "torch.ones(()).item()",
        "float": "float(torch.ones(()))",
        "bool": "bool(torch.ones(()) > 0)",
        "tensor": "torch.tensor(1.0)",
        "tolist": "torch.ones(2).tolist()",
        "nonzero": "torch.ones(2).nonzero()",
    }
    for name, code in probes.items():
        try:
            with _no_host_sync():
                eval(compile(code, plugin.__file__, "eval"), {"torch": torch})  # a frame "in" plugin.py
        except HostSyncError:
            caught.append(name)
    return caught


def _saved_per_microbatch(lam: float, microbatches: int) -> tuple[float, object, object]:
    """Mean bytes of the distinct storages autograd saves for backward per microbatch on this rank (PP = 2, 1F1B)."""
    import statistics
    from collections import defaultdict

    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests._layouts import BATCH, SEQ, Layout, forward_step, global_batch, setup

    tokens, labels = global_batch()
    mbs = BATCH // microbatches
    batches = [(tokens[i * mbs:(i + 1) * mbs], labels[i * mbs:(i + 1) * mbs]) for i in range(microbatches)]
    config, ddp, plugin = setup(Layout("pp2-memory", pp=2, lam=lam, microbatches=microbatches))
    saved: dict[int, dict[int, int]] = defaultdict(dict)
    current = [-1]

    def counted_step(data_iterator, model):
        current[0] += 1
        return forward_step(data_iterator, model)

    def pack(t):
        if current[0] >= 0:
            saved[current[0]][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for chunk in ddp:
        chunk.zero_grad_buffer()
    plugin.start_step(microbatches, record=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        get_forward_backward_func()(forward_step_func=counted_step, data_iterator=iter(batches), model=ddp,
                                    num_microbatches=microbatches, seq_length=SEQ, micro_batch_size=mbs,
                                    forward_only=False)
    return statistics.mean(sum(v.values()) for v in saved.values()), config, plugin


def pp2_saved_bytes(rank: int, world: int) -> dict:
    """Saved bytes per microbatch on this pipeline stage (PP = 2, 4 microbatches), without JREG (λ = 0) and with
    it, and the sizes of what JREG's backward reads."""
    from megatron.core import parallel_state as ps

    from tests._layouts import BATCH, SEQ

    microbatches = 4
    out: dict = {}
    for lam in (0.0, 1.0):
        out[lam], config, plugin = _saved_per_microbatch(lam, microbatches)
    tokens = BATCH // microbatches * SEQ
    out.update(stage=ps.get_pipeline_model_parallel_rank(), layers=len(plugin.layers), tokens=tokens,
               stage_output=tokens * config.hidden_size * 4)
    return out


@pytest.fixture(scope="module")
def pp2():
    return run_ranks(pp2_saved_bytes, 2)


def test_pp2_jreg_keeps_only_what_its_backward_reads(pp2):
    """Per microbatch in flight, JREG adds the microbatch's scale (one fp32 value expanded over its tokens: every
    token is real here) and, on a stage that sends its output on (Megatron-LM frees it once sent), that output: its
    backward reads it. Nothing per layer (no forward figures: the backward computes its own), nothing else (fp32
    model: the norms keep every other layer's input anyway)."""
    for r in pp2:
        extra = r[1.0] - r[0.0]
        expected = 4 + (r["stage_output"] if r["stage"] == 0 else 0)
        print(f"PP stage {r['stage'] + 1}: saved per microbatch λ=0 {r[0.0]:.0f} B, λ=1 {r[1.0]:.0f} B, "
              f"JREG +{extra:.0f} B = the scale's 4 B" + (f" + the stage output {r['stage_output']} B"
                                                          if r["stage"] == 0 else "") + f" ({r['layers']} layers)")
        assert extra == expected


@pytest.fixture(scope="module")
def suite():
    return run_ranks(sync_and_fault_suite, 1)[0]


def test_the_sync_guard_catches_each_entry_point(suite):
    assert suite["sanity"] == ["item", "float", "bool", "tensor", "tolist", "nonzero"]


@pytest.mark.parametrize("distance", ["angular", "cosine"])
@pytest.mark.parametrize("record", [False, True], ids=["non-logging", "logging"])
def test_no_host_sync_per_microbatch(suite, distance, record):
    assert suite[(distance, record)] == "ok"


@pytest.mark.parametrize("recompute", [None, "full"])
def test_a_step_that_does_not_log_computes_no_value_and_adds_into_the_incoming_gradients(suite, recompute):
    """Through megatron-core's schedule (an SFT mask): a non-logging step runs no forward kernel, one grad_b and one
    grad_a per layer and microbatch, each written into the gradient autograd handed it (in place: no [T, h] tensor
    of JREG's own); a logging step adds one forward (Ψ's value) per layer and microbatch. Under full recompute
    megatron's checkpoint keeps the gradient it hands each recomputed layer's output, so grad_b writes a fresh one
    there (one pass all the same)."""
    calls = {record: suite[("calls", recompute, record)] for record in (False, True)}
    n = suite["layers"] * suite["microbatches"]
    assert calls[False]["forward"] == [] and calls[True]["forward"] == [None] * n
    for record in (False, True):
        assert calls[record]["grad_b"] == [recompute is None] * n and calls[record]["grad_a"] == [True] * n, calls


def test_non_finite_states_give_nan_and_name_the_first_layer(suite):
    import math

    fault = suite["fault"]
    assert fault["first"] == 3
    assert all(math.isfinite(p) for p in fault["psi"][:2])
    assert all(math.isnan(p) for p in fault["psi"][2:])
    assert fault["zeta"] and all(math.isnan(z) for z in fault["zeta"].values())
    assert suite["clean"]["first"] is None and all(math.isfinite(p) for p in suite["clean"]["psi"])


def test_non_finite_padding_is_not_a_fault(suite):
    import math

    assert suite["padding"]["first"] is None
    assert all(math.isfinite(p) for p in suite["padding"]["psi"])
