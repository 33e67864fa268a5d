"""The seam with Megatron-LM and torch (megatron_jreg.patches): the table is the whole inventory, every row
applies and undoes, the loop adapter reads Megatron-LM's arguments by name, and a changed Megatron-LM
(signatures, dataset config fields) fails here rather than mid-run.

Cheap: no training, no ranks; megatron is imported inside the tests that need it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_jreg import patches

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_jreg"
ROOTS = ("megatron", "torch")


# -- the inventory cannot go stale --------------------------------------------------------------------------
def _module_names(tree: ast.AST) -> set[str]:
    """Names bound by imports of megatron/torch (modules, or anything imported from them)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ROOTS:
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ROOTS:
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" and node.args:
        return _root(node.args[0])
    return node.id if isinstance(node, ast.Name) else None


def assignments_into_modules(source: str) -> list[str]:
    """`line: code` of every assignment into an attribute (or __dict__/vars()) of an imported megatron/torch name,
    and every setattr/delattr on one."""
    tree = ast.parse(source)
    names = _module_names(tree)
    found = []

    def flag(node: ast.AST, target: ast.AST) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                flag(node, element)
        elif isinstance(target, ast.Starred):
            flag(node, target.value)
        elif isinstance(target, (ast.Attribute, ast.Subscript)) and _root(target) in names:
            found.append(f"{node.lineno}: {ast.unparse(target)}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                flag(node, target)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            flag(node, node.target)
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                flag(node, target)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
              and node.args and _root(node.args[0]) in names):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_each_form_of_patch():
    source = """
import torch
import torch.distributed as dist
from megatron.training import training
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.timers import Timer

torch.cuda.synchronize = None
dist.barrier, other = None, 1
training.train_step += 0
mrandom.CudaRNGStatesTracker.add = None
Timer.elapsed = None
vars(training)["evaluate"] = None
setattr(training, "evaluate", None)
delattr(torch.cuda, "Event")
del training.evaluate
args = object()
args.distributed_backend = "gloo"  # not a module
"""
    assert sorted(int(line.split(":")[0]) for line in assignments_into_modules(source)) == list(range(8, 17))


def test_only_the_patches_module_assigns_into_megatron_or_torch():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "patches.py":
            continue
        offenders += [f"{path.relative_to(PACKAGE.parent)}:{hit}" for hit in assignments_into_modules(path.read_text())]
    assert not offenders, ("assign into megatron/torch only through megatron_jreg.patches (add a row to PATCHES): "
                           + "; ".join(offenders))


def test_every_row_is_complete_and_used_by_its_owner():
    for patch in patches.PATCHES:
        assert patch.target.split(".")[0] in ROOTS, patch
        assert patch.scope in (patches.PROCESS, patches.TRAINING, patches.CALL), patch
        assert patch.why and patch.until and patch.written_for == patches.WRITTEN_FOR, patch
        module = patch.owner.split()[0]
        source = (PACKAGE.parent / (module.replace(".", "/") + ".py")).read_text()
        assert f'"{patch.target}"' in source, f"{patch.target}: not named by its owner {module}"


def test_the_applier_refuses_what_the_table_does_not_list():
    with pytest.raises(patches.PatchError, match="not in megatron_jreg.patches.PATCHES"):
        patches.apply({"torch.cuda.is_available": lambda original: original})


def test_signature_drift_names_the_function_and_the_parameters():
    def written_for(a, b, c=None):  # noqa: ANN001, ANN202
        pass

    def reordered(a, c=None, b=None):  # noqa: ANN001, ANN202
        pass

    def renamed(a, bb, c=None):  # noqa: ANN001, ANN202
        pass

    expected = tuple(inspect.signature(written_for).parameters)
    assert patches.signature_drift("m.f", expected, written_for) is None
    line = patches.signature_drift("m.f", expected, reordered)
    assert line.startswith("m.f: ") and "reordered b, c" in line and "\n" not in line
    assert "missing b" in patches.signature_drift("m.f", expected, renamed)
    assert "new bb" in patches.signature_drift("m.f", expected, renamed)


# -- applying and undoing (imports megatron) -----------------------------------------------------------------
def _holder(patch: patches.Patch):
    if patch.on_instance:
        from megatron.core.timers import Timer

        assert patch.target == "megatron.core.timers.Timer.elapsed"
        return Timer("interval-time"), "elapsed"
    return patches.resolve(patch.target)


def test_every_row_is_applied_and_restored_by_the_context_manager():
    for patch in patches.PATCHES:
        holder, name = _holder(patch)
        before, own = getattr(holder, name), name in vars(holder)
        replacement, seen = object(), []
        objects = {patch.target: holder} if patch.on_instance else None
        maker = {patch.target: lambda original, s=seen, r=replacement: s.append(original) or r}
        with pytest.raises(KeyError):  # undone also when the block raises
            with patches.patched(maker, objects):
                assert getattr(holder, name) is replacement, patch.target
                raise KeyError
        assert seen == [before], patch.target
        after = getattr(holder, name)
        assert (after == before if patch.on_instance else after is before), patch.target  # (a new bound method)
        assert (name in vars(holder)) == own, patch.target


def test_a_refused_row_undoes_the_rows_applied_before_it():
    from megatron.core.datasets import utils

    before = utils.compile_helpers
    with pytest.raises(patches.PatchError):
        patches.apply({"megatron.core.datasets.utils.compile_helpers": lambda original: None,
                       "megatron.training.training.no_such_function": lambda original: None})
    assert utils.compile_helpers is before


def _loop_args(**changes) -> SimpleNamespace:
    return SimpleNamespace(**{**dict(
        rank=0, world_size=1, metrics_file=None, progress=False, train_iters=1, log_interval=1, sft=False,
        sft_tokenizer_prompt_format=None, eval_iters=3, eval_global_batch_size=8, eval_micro_batch_size=2,
        data_parallel_size=2, gtp_weight_remat_size=1, save=None, load=None, pretrained_checkpoint=None,
        ckpt_step=None), **changes})


def _loop(args: SimpleNamespace):  # noqa: ANN202 - a JregLoop of λ = 0.1 that starts from no checkpoint
    from megatron_jreg.plugin import JregConfig
    from megatron_jreg.training.loop import JregLoop
    from megatron_jreg.training.run_folder import RunFolder

    cfg = JregConfig(lam=0.1)
    return JregLoop(args, cfg, RunFolder.open(args, cfg, None))


def test_training_patches_are_the_training_rows_and_are_undone(monkeypatch):
    from megatron_jreg.training import sft
    from megatron_jreg.training.run import training_patches

    monkeypatch.setattr(sft, "chat_targets", lambda tokenizer: "chat targets")
    args = _loop_args(sft=True, sft_tokenizer_prompt_format="default")
    rows = [p for p in patches.PATCHES if p.scope == patches.TRAINING]
    before = {p.target: getattr(*patches.resolve(p.target)) for p in rows}
    loop = _loop(args)
    with pytest.raises(RuntimeError, match="pretrain failed"):
        with training_patches(args, loop):
            for p in rows:
                assert getattr(*patches.resolve(p.target)) is not before[p.target], p.target
            raise RuntimeError("pretrain failed")
    loop.close()
    assert {p.target: getattr(*patches.resolve(p.target)) for p in rows} == before


# -- the loop adapter ----------------------------------------------------------------------------------------
class _Events:
    """Records the events the adapter raises."""

    def __init__(self) -> None:
        self.seen: list = []

    def on_eval_start(self, eval_iters):  # noqa: ANN001, ANN201
        self.seen.append(("eval_start", eval_iters))

    def on_eval_end(self, result):  # noqa: ANN001, ANN201
        self.seen.append(("eval_end", dict(result)))


def _like(function, result=None, parameters=None):  # noqa: ANN001, ANN202
    """A stand-in with `function`'s signature (or its parameters reordered) returning `result`."""
    calls = []

    def fake(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append((args, kwargs))
        return result

    signature = inspect.signature(function)
    fake.__signature__ = signature.replace(parameters=parameters or list(signature.parameters.values()))
    fake.calls = calls
    return fake


def test_evaluate_reads_eval_iters_by_name(monkeypatch):
    """Megatron-LM calls evaluate(..., config, verbose, non_loss_data_func, eval_iters=..., ...): eval_iters is
    the 8th parameter (the old wrapper read the 9th positional, pg_collection)."""
    from megatron.training import training

    from megatron_jreg.training.loop import EVALUATE, MegatronLoopAdapter

    fake = _like(training.evaluate, ({"lm loss": 2.5}, None, False))
    monkeypatch.setattr(training, "evaluate", fake)
    events = _Events()
    with patches.patched({EVALUATE: MegatronLoopAdapter(events).evaluate}):
        assert training.evaluate("fwd", "it", "model", None, "config", False, None, 7, "pg", "p2p")[0] == {
            "lm loss": 2.5}
        training.evaluate("fwd", "it", "model", None, "config", False, None, eval_iters=5, pg_collection="pg")
        training.evaluate("fwd", "it", "model", None, "config")
    assert training.evaluate is fake and len(fake.calls) == 3
    assert fake.calls[0] == (("fwd", "it", "model", None, "config", False, None, 7, "pg", "p2p"), {})
    assert [e for e in events.seen if e[0] == "eval_start"] == [("eval_start", 7), ("eval_start", 5),
                                                                 ("eval_start", None)]
    assert events.seen[1] == ("eval_end", {"total_loss_dict": {"lm loss": 2.5}, "collected_non_loss_data": None,
                                           "timelimit": False})


def test_jreg_loop_counts_the_eval_microbatches_of_the_call():
    loop = _loop(_loop_args())
    started: list = []
    loop.plugin = SimpleNamespace(start_step=lambda n, record: started.append((n, record)))
    loop.on_eval_start(7)
    loop.on_eval_start(None)  # --eval-iters
    assert started == [(2 * 7, True), (2 * 3, True)]  # 8 // (2 × 2) microbatches per iteration


# -- drift guard: what the code expects of the installed megatron-core ----------------------------------------
def test_replaced_functions_have_the_parameters_they_were_written_for():
    for patch in patches.PATCHES:
        if patch.params is not None:
            patches.check(patch.target, patches.original(patch.target))


def test_relied_on_names_exist_with_their_parameters():
    for reliance in patches.RELIED_ON:
        holder, name = patches.resolve(reliance.name)
        assert hasattr(holder, name), reliance.name
        if reliance.params is not None:
            drift = patches.signature_drift(reliance.name, reliance.params, getattr(holder, name))
            assert drift is None, drift


def test_the_adapter_refuses_a_function_whose_parameters_moved(monkeypatch):
    from megatron.training import training

    from megatron_jreg.training.loop import EVALUATE, MegatronLoopAdapter

    originals = {name: getattr(training, name) for name in ("train_step", "training_log", "evaluate",
                                                             "evaluate_and_print_results")}
    params = list(inspect.signature(training.train_step).parameters.values())
    params[2], params[3] = params[3], params[2]  # optimizer before model
    monkeypatch.setattr(training, "train_step", _like(training.train_step, parameters=params))
    makers = MegatronLoopAdapter(_loop(_loop_args())).makers()
    makers = {EVALUATE: makers[EVALUATE], **makers}  # one applied before the refused one
    with pytest.raises(patches.SignatureDrift, match=r"^megatron\.training\.training\.train_step: .*reordered model, "
                                                     r"optimizer"):
        with patches.patched(makers):
            pass
    for name, function in originals.items():  # nothing stays installed
        if name != "train_step":
            assert getattr(training, name) is function


def test_train_step_returns_the_tuple_the_adapter_names():
    """train_step's return statements in the installed wheel have as many fields as TRAIN_STEP_RESULT."""
    from megatron.training import training

    from megatron_jreg.training.loop import TRAIN_STEP_RESULT

    tree = ast.parse(inspect.getsource(training.train_step))
    returns = [n.value for n in ast.walk(tree) if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)]
    assert returns and all(len(r.elts) == len(TRAIN_STEP_RESULT) for r in returns)
    named = [r for r in returns if all(isinstance(e, ast.Name) for e in r.elts[1:])]
    assert [e.id for e in named[-1].elts[1:]][:-1] == list(TRAIN_STEP_RESULT[1:-1])


def _dataset_config_keywords() -> tuple[set[str], set[str]]:
    """The GPTDatasetConfig fields training/data.py fills (its `fields = dict(...)`), and the FIM extras."""
    tree = ast.parse((PACKAGE / "training" / "data.py").read_text())
    common = fim = None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "dict" and getattr(node.targets[0], "id", "") == "fields"):
            common = {k.arg for k in node.value.keywords}
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "GPTFIMDatasetConfig":
            fim = {k.arg for k in node.keywords if k.arg is not None}
    assert common and fim
    return common, fim


def test_dataset_config_fields_are_those_data_py_fills():
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training.datasets.fim_dataset import GPTFIMDatasetConfig

    common, fim = _dataset_config_keywords()
    for cls, filled in ((GPTDatasetConfig, common), (GPTFIMDatasetConfig, common | fim)):
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(filled - set(fields))
        required = sorted(n for n, f in fields.items() if n not in filled and f.default is dataclasses.MISSING
                          and f.default_factory is dataclasses.MISSING)
        assert not unknown, f"{cls.__name__} has no fields {unknown} (training/data.py fills them)"
        assert not required, f"{cls.__name__} requires {required}, which training/data.py does not fill"
