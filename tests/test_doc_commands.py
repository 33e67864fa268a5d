"""Every training command the user docs quote runs through megatron-jreg train's own checks, and they agree.

The commands are read from the docs themselves (README.md, docs/*.md, docker/README.md: shell code blocks and
inline commands), so a command added or changed there is checked here:
- `torchrun ... -m megatron_jreg.train FLAGS`, `megatron-jreg train FLAGS` (also inside `docker run`): the flags
  through parse_and_validate as rank 0 of the command's world size (examples/slurm/check_args.py);
- `sbatch [--nodes=N] <preset>.sbatch`, `DRY_RUN=1 bash <preset>.sbatch`, with their settings: the launcher's dry
  run without an allocation (NODES=N for --nodes), then its rank command through the same checks;
- `examples/gpu_smoke.sh`: the script with a stand-in `nvidia-smi` and Python, then each training it starts.
On a CPU, on stand-in files for the docs' /data, /scratch and /runs paths (tests/_standins.py). A command with a
gap (`...`, `$MEGATRON_LM_ARGS`) is completed with the recipe's flags it lacks; one whose gap is another
command's output (`<the flags hf-to-mcore printed>`) names the test that runs it. A command the docs quote as
refused (`# refused`) must be refused, with the line the docs show.

Then: the docs' full recipes agree with the Slurm recipe (optimizer, schedule, batch, data, tokenizer,
retention, Megatron-LM settings); docs/cluster.md's install lines keep this environment's torch; the user docs
name files that exist, no internal issue numbers, and the README's first screen says what has run on a GPU.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _standins
from tests.test_cluster_scripts import CHECK_PYTHON, SMOKE_PYTHON, checked, read_args, write_stub

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted(REPO.glob("docs/*.md")), REPO / "docker" / "README.md"]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.M | re.S)
INLINE_COMMAND = re.compile(r"^(?:[A-Z_]+=\S*\s+)*(?:torchrun|sbatch|bash|srun|python -m megatron_jreg\.train|"
                            r"megatron-jreg train)\s+\S")  # a command with an argument, not a name
# quoted commands whose gap is another command's output, and the test that runs them with it
COVERED = {"<the flags hf-to-mcore printed, --load included>":
           ("tests/test_convert.py", "test_training_cli_loads_import_like_its_source_run")}
# the Slurm recipe's settings every full pretraining command the docs quote must share (SFT: the SFT recipe's)
RECIPE = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "weight_decay", "adam_beta1", "adam_beta2", "clip_grad",
          "global_batch_size", "train_iters", "seq_length", "bf16", "split", "eval_interval", "eval_iters",
          "save_interval", "save_retain_interval", "log_interval", "tokenizer_type", "tokenizer_model", "data_path",
          "use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "cross_entropy_loss_fusion",
          "cross_entropy_fusion_impl", "manual_gc", "jreg_lambda", "jreg_alpha")


def is_training(tokens: list[str]) -> bool:
    return ("megatron_jreg.train" in tokens or any(a == "megatron-jreg" and b == "train" for a, b in
                                                     zip(tokens, tokens[1:]))
            or any(t.endswith(".sbatch") or t.endswith("gpu_smoke.sh") for t in tokens))


def inline_command(span: str) -> bool:
    """An inline code span that is a command to run, not a name: a script, a gap to fill, or several arguments
    (`megatron-jreg train --sft` names a feature)."""
    span = " ".join(span.split())
    return bool(INLINE_COMMAND.match(span)) and ("..." in span or span.endswith((".sbatch", ".sh"))
                                                 or len(span.split()) > 3)


def quoted_commands() -> dict[str, list[str]]:
    """{command line (continuations joined, the comment kept): [the docs quoting it]} of every training command."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        lines = [line for block in SHELL_BLOCK.findall(text) for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
        outside = SHELL_BLOCK.sub("", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))
        lines += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", outside) if inline_command(span)]
        for line in lines:
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:
                continue
            if tokens and is_training(tokens):
                found.setdefault(line.strip(), []).append(str(doc.relative_to(REPO)))
    return found


COMMANDS = quoted_commands()


def split_env(tokens: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
        key, value = tokens[0].split("=", 1)
        env[key] = value
        tokens = tokens[1:]
    return env, tokens


def inner_command(tokens: list[str]) -> list[str]:
    """The command a `docker run ... IMAGE COMMAND` runs (the image is megatron-jreg)."""
    if tokens[:2] != ["docker", "run"]:
        return tokens
    return tokens[tokens.index("megatron-jreg") + 1:]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The stand-in cluster: files under `root`, the working directory the commands' relative paths resolve in,
    stubs for the dry run's check and for gpu_smoke's nvidia-smi and Python."""
    root = tmp_path_factory.mktemp("site")
    work = _standins.build(root)
    work.mkdir(exist_ok=True)
    stubs = root / "bin"
    stubs.mkdir()
    write_stub(stubs / "check-python", CHECK_PYTHON)
    write_stub(stubs / "python", SMOKE_PYTHON)
    write_stub(stubs / "nvidia-smi", "#!/usr/bin/env bash\necho 'NVIDIA H100 80GB HBM3, 9.0'\n")
    out = root / "out"
    out.mkdir()

    class Site:
        pass

    s = Site()
    s.root, s.work, s.stubs, s.out = root, work, stubs, out
    s.recipe = {}  # preset script → the launcher's rank flags (filled by `slurm`)
    return s


def slurm(site, env: dict[str, str], tokens: list[str]) -> tuple[subprocess.CompletedProcess, int, list[str]]:
    """`sbatch [options] SCRIPT` / `bash SCRIPT` as the launcher's dry run without an allocation: (the run, the
    world size and rank flags it handed to the check)."""
    script = next(t for t in tokens if t.endswith(".sbatch"))
    nodes = next((t.split("=", 1)[1] for t in tokens if t.startswith("--nodes=")), None)
    full = {"PATH": os.environ["PATH"], "HOME": str(site.root), "STUB_OUT": str(site.out), "DRY_RUN": "1",
            "RUN_ROOT": str(site.root / "runs"), "DATA_PATH": str(site.root / "data/fwe100b/fwe_text_document"),
            "TOKENIZER_MODEL": str(site.root / "data/tok/fwe32k.model"), "PYTHON": "python",
            "CHECK_PYTHON": str(site.stubs / "check-python"),
            **{k: _standins.mapped(v, site.root) for k, v in env.items()}, **({"NODES": nodes} if nodes else {})}
    (site.out / "check.args").unlink(missing_ok=True)
    run = subprocess.run(["bash", str(REPO / script)], env=full, cwd=REPO, capture_output=True, text=True, timeout=60)
    if run.returncode != 0:
        return run, 0, []
    world, argv = checked(site.out)
    return run, world, argv


def smoke(site, env: dict[str, str]) -> list[list[str]]:
    """examples/gpu_smoke.sh with the stand-in nvidia-smi and Python: the flags of each training it starts."""
    for path in site.out.glob("*.args"):
        path.unlink()
    full = {"PATH": f"{site.stubs}{os.pathsep}{os.environ['PATH']}", "HOME": str(site.root),
            "STUB_OUT": str(site.out), "REAL_PYTHON": sys.executable, "OUT": str(site.out / "smoke"),
            "PYTHON": str(site.stubs / "python"), **env}
    (site.out / "smoke").mkdir(exist_ok=True)
    run = subprocess.run(["bash", str(REPO / "examples" / "gpu_smoke.sh")], env=full, cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    return [read_args(path)[2:] for path in sorted(site.out.glob("*.args")) if path.name != "check.args"]


def launcher_recipe(site, script: str = "examples/slurm/llama-1b.sbatch") -> list[str]:
    """The Slurm recipe's rank flags for `script` (its dry run), on the stand-in files."""
    if script not in site.recipe:
        run, _, argv = slurm(site, {}, ["sbatch", script])
        assert run.returncode == 0, run.stderr
        site.recipe[script] = argv
    return site.recipe[script]


def completed(tokens: list[str], recipe: list[str]) -> list[str]:
    """A command's flags with its gaps (`...`, `$VARS`) filled by the recipe's flags it does not give."""
    given = [t for t in tokens if t != "..." and not t.startswith("$")]
    have = {t for t in given if t.startswith("--")}
    extra, keep = [], False
    for token in recipe:
        if token.startswith("--"):
            keep = token not in have
        if keep:
            extra.append(token)
    return given + extra


def training_flags(tokens: list[str]) -> tuple[int, list[str]]:
    """(world size, flags) of `torchrun [opts] -m megatron_jreg.train FLAGS` or `megatron-jreg train FLAGS`."""
    if "megatron_jreg.train" in tokens:
        head, flags = tokens[: tokens.index("megatron_jreg.train")], tokens[tokens.index("megatron_jreg.train") + 1:]
    else:
        head, flags = tokens[: tokens.index("train") + 1], tokens[tokens.index("train") + 1:]
    per_node = next((int(b) for a, b in zip(head, head[1:]) if a == "--nproc-per-node"), 1)
    nodes = next((int(b) for a, b in zip(head, head[1:]) if a == "--nnodes"), 1)
    return per_node * nodes, flags


def check(site, flags: list[str], world: int, monkeypatch):
    monkeypatch.chdir(site.work)
    return _standins.check_args().check(flags, world).args


def args_of(site, line: str, monkeypatch) -> list:
    """Every training the quoted command starts, as the args a rank checks (UsageError if one is refused)."""
    env, tokens = split_env(shlex.split(line, comments=True))
    tokens = inner_command(tokens)
    gap = next((g for g in COVERED if g in line), None)
    if gap is not None:
        path, name = COVERED[gap]
        assert f"def {name}(" in (REPO / path).read_text(encoding="utf-8"), (line, path, name)
        return []
    if any(t.endswith(".sbatch") for t in tokens):
        run, world, argv = slurm(site, env, tokens)
        assert run.returncode == 0, run.stdout + run.stderr
        return [check(site, argv, world, monkeypatch)]
    if any(t.endswith("gpu_smoke.sh") for t in tokens):
        return [check(site, argv, 1, monkeypatch) for argv in smoke(site, env)]
    world, flags = training_flags(tokens)
    flags = [_standins.mapped(t, site.root) for t in flags]
    if "..." in tokens or any(t.startswith("$") for t in tokens):
        flags = completed(flags, launcher_recipe(site))
    return [check(site, flags, world, monkeypatch)]


def test_the_docs_quote_the_commands_this_test_knows():
    """The extraction finds what the docs hold (a change of their form must not hide commands from this test)."""
    by_doc = {doc for docs in COMMANDS.values() for doc in docs}
    assert {"README.md", "docs/scaling.md", "docs/training.md", "docs/sft.md", "docs/cluster.md",
            "docker/README.md"} <= by_doc, by_doc
    assert sum("megatron_jreg.train" in c for c in COMMANDS) >= 7 and sum(".sbatch" in c for c in COMMANDS) >= 12
    assert any("gpu_smoke.sh" in c for c in COMMANDS)


@pytest.mark.parametrize("line", sorted(c for c in COMMANDS if "refused" not in c), ids=lambda c: c[:70])
def test_every_quoted_training_command_passes_megatron_jreg_trains_checks(site, line, monkeypatch):
    checked_args = args_of(site, line, monkeypatch)
    assert checked_args or any(g in line for g in COVERED)


def refusals() -> dict[str, str]:
    """{command quoted as refused: the line the docs show for it}: the block after "The first line ends in"."""
    out = {}
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for command in (c for c, docs in COMMANDS.items() if "refused" in c and str(doc.relative_to(REPO)) in docs):
            shown = re.search(r"The first line ends in[^\n]*:\n\n```\n(.*?)\n```", text, re.S)
            assert shown, f"{doc.name}: {command!r} is quoted as refused, but no refusal line is shown"
            out[command] = shown.group(1)
    return out


def test_commands_quoted_as_refused_are_refused_with_the_line_shown(site):
    found = refusals()
    assert found, "docs/cluster.md quotes no refused command"
    for command, shown in found.items():
        env, tokens = split_env(shlex.split(command, comments=True))
        run, _, _ = slurm(site, env, tokens)
        assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
        assert run.stderr.strip() == shown, (run.stderr, shown)


def test_the_docs_recipes_agree_with_the_slurm_recipe(site, monkeypatch):
    """Every full pretraining command (a --model-preset of the paper, no gap) has the Slurm recipe's optimizer,
    schedule, batch, data, tokenizer, retention and Megatron-LM settings; the SFT command the SFT recipe's."""
    compared = 0
    for line in COMMANDS:
        tokens = inner_command(split_env(shlex.split(line, comments=True))[1])
        if "megatron_jreg.train" not in tokens or "..." in tokens or any(t.startswith("$") for t in tokens):
            continue
        world, flags = training_flags(tokens)
        flags = [_standins.mapped(t, site.root) for t in flags]
        preset = flags[flags.index("--model-preset") + 1]
        if "--sft" in flags:
            sft = next(c for c in COMMANDS if "sft-llama-3.4b.sbatch" in c)
            env, sbatch = split_env(shlex.split(sft, comments=True))
            run, recipe_world, recipe_flags = slurm(site, env, sbatch)
        else:
            recipe_world, recipe_flags = 0, launcher_recipe(site, f"examples/slurm/{preset}.sbatch")
        ours = check(site, flags, world, monkeypatch)
        recipe = check(site, recipe_flags, recipe_world or world, monkeypatch)
        differ = {key: (getattr(ours, key), getattr(recipe, key)) for key in RECIPE
                  if getattr(ours, key) != getattr(recipe, key)}
        assert not differ, (line[:100], differ)
        compared += 1
    assert compared >= 4, compared
    data = (REPO / "docs" / "data.md").read_text(encoding="utf-8")
    assert "-> /data/tok/fwe32k.model" in data and "--tokenizer-model /data/tok/fwe32k.model" in data
    launcher = (REPO / "examples" / "slurm" / "launch.sh").read_text()
    assert ': "${TOKENIZER_MODEL:=/data/tok/fwe32k.model}"' in launcher


@pytest.mark.slow
def test_the_cluster_pages_install_lines_keep_this_environments_torch(tmp_path):
    """docs/cluster.md's pins and pip lines in this venv (the site environment here): pip would install
    megatron-jreg alone (--dry-run, offline), torch and the rest kept; the check after it passes."""
    text = (REPO / "docs" / "cluster.md").read_text(encoding="utf-8")
    block = next(b for b in SHELL_BLOCK.findall(text) if "docker/pins.py constraints" in b)
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    pins = next(t for t in lines if t[:3] == ["python", "docker/pins.py", "constraints"])
    install = next(t for t in lines if t[:2] == ["pip", "install"])
    after = next(t for t in lines if t[:3] == ["python", "docker/pins.py", "check"])
    assert pins[-2:] == [">", "site-pins.txt"] and "-c" in install and "site-pins.txt" in install

    def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, **kw)

    constraints = run([sys.executable, *pins[1:-2]])
    assert constraints.returncode == 0, constraints.stderr
    from importlib.metadata import version

    assert f"torch=={version('torch')}" in constraints.stdout.split()  # this environment's torch, pinned
    (tmp_path / "site-pins.txt").write_text(constraints.stdout)
    argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
            *[str(tmp_path / t) if t == "site-pins.txt" else t for t in install[2:]]]
    dry = run(argv)
    assert dry.returncode == 0, dry.stdout[-2000:] + dry.stderr[-2000:]
    assert re.search(r"^Would install megatron-jreg-\S+$", dry.stdout, re.M), dry.stdout[-2000:]
    check_after = run([sys.executable, *after[1:3], *[str(tmp_path / t) if t == "site-pins.txt" else t
                                                     for t in after[3:]]])
    assert check_after.returncode == 0, check_after.stdout + check_after.stderr


# -- what the user docs say about themselves ---------------------------------------------------------------


def test_readmes_first_screen_says_what_has_run_on_a_gpu():
    first_screen = (REPO / "README.md").read_text(encoding="utf-8").split("\n## ", 1)[0]
    flat = " ".join(first_screen.split())
    assert "Nothing has run on a GPU yet" in flat and "docs/cluster.md" in flat
    assert "tested on CPU" in flat and "Slurm recipes" in flat


def test_user_docs_name_no_internal_issue_numbers():
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        found = re.findall(r"\b[Ii]ssues? #?\d+|(?<![\w&])#\d+\b", text)
        assert not found, f"{doc.relative_to(REPO)}: {found}"


PATH_REFERENCE = re.compile(r"(?<![\w./-])((?:examples|docs|experiments|tests|benchmarks|tools|megatron_jreg|docker)"
                            r"/[A-Za-z0-9_./{}<>-]*)")
# Megatron-LM's own files, which the docs name as sources (not in this repository)
MEGATRON_LM_FILES = {"examples/llama/train_llama3_8b_h100_fp8.sh", "docker/.ngc_version.dev",
                     "docker/Dockerfile.ci.dev"}


def test_files_the_user_docs_name_exist():
    missing = []
    for doc in DOCS:
        for ref in PATH_REFERENCE.findall(doc.read_text(encoding="utf-8")):
            if "{" in ref or "<" in ref:  # a pattern (`llama-{170m,1b}`, `<name>.txt`), not a file
                continue
            ref = ref.rstrip(".-")  # the sentence's full stop
            if ref not in MEGATRON_LM_FILES and not (REPO / ref).exists() and not (doc.parent / ref).exists():
                missing.append(f"{doc.relative_to(REPO)}: {ref}")
    assert not missing, missing


def test_sft_docs_name_the_report_section_they_show():
    sft = " ".join((REPO / "docs" / "sft.md").read_text(encoding="utf-8").split())
    report, section = re.search(r"(experiments/study/\S+\.md)[^.]*?\"([^\"]+)\" section", sft).groups()
    assert f"## {section}\n" in (REPO / report).read_text(encoding="utf-8"), (report, section)
