"""`python experiments/study/study.py`: a laptop-scale study designed to confirm or refute the paper's claims.

Design (fixed here, before any run; experiments/study/report_v2.md reports whatever comes out):
- Arms at one **fixed token budget** (the paper's §3.4 compares 20K with 200K steps by changing the batch size):
  `baseline-large` (global batch 40, N steps), `baseline-small` (batch 4, 10·N steps) and `jreg-a1` (JREG
  λ = 1, α = 1, angular, at the small batch); `--alphas` adds JREG arms at the small batch. Every arm of a seed
  starts from the same weights (`--init-mode layout-independent --seed s`).
- Model: a 12-layer Llama (12 × 128), so that α means what it means for the paper's 12-layer 170M
  (α = 1 puts 0.58 of the weight on the top layer, as for the paper's 170M model). Data: WikiText-2 split by
  article (examples/laptop_scale.py); every evaluation reads the held-out articles.
- Measurement (examples/measure.py): held-out cross-entropy, Ψ_ℓ and ζ of every checkpoint on the same
  tokens; the final checkpoint also on training windows (the train–held-out gap).
- Endpoints (ENDPOINTS, study_report.py): primary (ii) ζ_L(baseline-small) − ζ_L(baseline-large) > 0,
  (iii) ζ_L(jreg-a1) − ζ_L(baseline-small) < 0, (iv) held-out CE(jreg-a1) − CE(baseline-small) < 0; one-sided
  paired t-tests over seeds at 5 %, Holm-adjusted over the three, two-sided p and "significantly worse" beside.
  Secondary: ζ_{L−1}, ζ_{L−2}, Ψ_L / median middle-layer Ψ, within-run Spearman ρ(step, ζ_L) with a sign test
  over seeds, an iso-loss comparison, the train–held-out gap, the minimum detectable effect from the measured
  paired SD.
- Pilot gate: seed 1 of the two baselines runs first. The study goes on only if that baseline-small run has a
  jump to remove (final held-out ζ_L ≥ --gate, 0.5), otherwise it stops and reports that this regime cannot
  test (iii)/(iv) (`--ignore-gate` goes on anyway). The gate looks at one baseline run, never at JREG.
- SFT analogue (the paper's §5.3, whose SFT is plain cross-entropy): for seeds 1..3 the final baseline-small
  and jreg-a1 models are fine-tuned with λ = 0 on the vendored chat data (Megatron-LM's `--sft`); ζ and Ψ
  before and after on the same held-out windows.

    python experiments/study/study.py                     # study v2 (report_v2.md): ~2 h on 2 cores
    python experiments/study/study.py --design v3 --jobs 2   # study v3 (study_v3_analysis.py, report_v3.md)
    python experiments/study/study.py --design v4 --jobs 2   # study v4 (study_v4_analysis.py, docs/study.md)
    python experiments/study/study.py --quick             # pipeline smoke test: tiny model, 2 seeds, a few steps
    python experiments/study/study.py --report-only       # report from what is there
    python experiments/study/study.py --runs sft-jreg-a1/seed-3   # only these runs (and their parents), then:
    python experiments/study/study_report.py --raw experiments/study/raw_v2 --merge study_output/raw \
        --report experiments/study/report_v2.md
    # the v2 report from its committed raw files:
    python experiments/study/study_report.py --raw experiments/study/raw_v2 --report experiments/study/report_v2.md

Resumable: finished runs are skipped (train.done / post.done); an interrupted training continues from its
last checkpoint (Megatron-LM's exact resume). Ctrl-C / SIGTERM makes every training save and stop; run the
same command again to go on. Other settings on an existing --output are refused.

Output folder: data/ (tokenizer, datasets, chat data), runs/<arm>/seed-<s>/ (command.txt, train.log,
metrics.jsonl, checkpoints/, measures.json, attempts.jsonl), raw/ (one small JSON per run: what the report is
made from, and what experiments/study/raw_v2 holds), gate.json, invocations.jsonl, report.md, study_*.png.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(HERE)]  # this checkout's megatron_jreg, laptop_scale.py

import study_v4_analysis as V4A  # noqa: E402
from laptop_scale import SEQ_LENGTH, Data, Model, child_env, data_flags, prepare_data, recipe_flags  # noqa: E402

CHAT = ROOT / "examples" / "sft" / "data" / "wikitext_chat.jsonl"


@dataclass(frozen=True)
class Arm:
    """One training setting: {global batch, steps, λ, α}; every pretraining arm has the same token budget."""

    name: str
    batch: int
    steps: int
    lam: float = 0.0
    alpha: float | None = None
    lns: bool = False  # LayerNorm Scaling (study v4)
    model: Model | None = None  # None: the study's model

    @property
    def tokens(self) -> int:
        return self.batch * self.steps * SEQ_LENGTH

    def jreg_flags(self, distance: str) -> list[str]:
        lns = ["--layernorm-scaling"] if self.lns else []
        if self.lam == 0:
            return ["--jreg-lambda", "0", *lns]
        return ["--jreg-lambda", f"{self.lam:g}", "--jreg-alpha", f"{self.alpha:g}", "--jreg-distance", distance,
                *lns]


@dataclass(frozen=True)
class StudyConfig:
    """What the study trains and measures. The defaults are the committed study (experiments/study/report_v2.md)."""

    output: Path
    seeds: int = 4
    large_batch: int = 40
    small_batch: int = 4
    large_steps: int = 200  # the token budget: large_batch × large_steps × 128 tokens (1.02M, ~1.8 epochs)
    alphas: tuple[float, ...] = (1.0,)
    checkpoints: int = 10  # per run, evenly spaced; the last is the final model
    jobs: int = 2
    lam: float = 1.0
    distance: str = "angular"
    model: Model = Model(layers=12, hidden=128, heads=4, ffn=352)
    core_windows: int = 256  # held-out windows measured at every checkpoint
    train_windows: int = 512  # training windows measured at the final checkpoint
    eval_sequences: int = 160  # Megatron-LM's own validation at the end: this many held-out sequences
    gate: float | None = 0.5  # pilot gate: final held-out ζ_L of baseline-small seed 1; None: no pilot phase
    ignore_gate: bool = False
    sft_seeds: int = 3
    sft_steps: int = 300
    sft_batch: int = 8
    sft_lr: float = 1e-4
    quick: bool = False
    design: str = "v2"
    first_seed: int = 1
    steps: int | None = None  # v4: every arm's steps (batch small_batch)
    fallback: bool = False  # v4: the pre-registered fallback after a failed gate

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.first_seed, self.first_seed + self.seeds))

    @property
    def small_steps(self) -> int:
        return self.large_steps * self.large_batch // self.small_batch

    def arms(self) -> list[Arm]:
        if self.design == "v4":
            return [Arm(a.name, self.small_batch, self.steps, a.lam, a.alpha, a.lns) for a in V4A.STAGE1]
        arms = [Arm("baseline-large", self.large_batch, self.large_steps),
                Arm("baseline-small", self.small_batch, self.small_steps)]
        return arms + [Arm(arm_name(a), self.small_batch, self.small_steps, self.lam, a) for a in self.alphas]

    @property
    def jreg_arm(self) -> str:
        """The JREG arm of the primary endpoints and of the SFT analogue: α = 1 when in the sweep."""
        if self.design == "v4":
            return V4A.STAGE2_DEFAULT
        return arm_name(1.0 if 1.0 in self.alphas else self.alphas[0])


# Study v3 (issue 30; its analysis is fixed in experiments/study/study_v3_analysis.py): the 12 × 64 regime in which the
# jump forms (experiments/demo_regimes), fresh seeds 9..20, a 4× larger batch for baseline-large, JREG at α = 1
# and α = 0, 6 checkpoints per run, no pilot gate (the regime was chosen on seeds 1..8), no SFT analogue.
V3 = dict(design="v3", first_seed=9, seeds=12, model=Model(layers=12, hidden=64, heads=2, ffn=176), small_batch=4,
          large_batch=16, large_steps=750, alphas=(1.0, 0.0), checkpoints=6, gate=None, sft_seeds=0)
# Study v4 (issue 43; its analysis is fixed in experiments/study/study_v4_analysis.py): v3's model and recipe with the
# schedule ending at one epoch of the training articles (575,749 tokens: 4,498 samples of 128, 1,124 steps of 4),
# the arms of study_v4_analysis.STAGE1 on seeds 21..32, a gate on baseline seeds 21-22, then stage 2 at depth 24.
V4_STEPS = 1124
V4 = dict(design="v4", first_seed=21, seeds=12, model=Model(layers=12, hidden=64, heads=2, ffn=176), small_batch=4,
          steps=V4_STEPS, checkpoints=4, gate=None, sft_seeds=0, alphas=())
QUICK = dict(seeds=2, large_batch=4, small_batch=2, large_steps=4, alphas=(1.0,), checkpoints=2,
             model=Model(layers=4, hidden=64, heads=4, ffn=128), core_windows=8, train_windows=8, eval_sequences=4,
             gate=0.0, sft_seeds=1, sft_steps=3, sft_batch=2, quick=True)


def arm_name(alpha: float) -> str:
    return f"jreg-a{alpha:g}"


@dataclass(frozen=True)
class Run:
    arm: str
    seed: int
    dir: Path
    batch: int
    steps: int
    lam: float = 0.0
    alpha: float | None = None
    parent: Run | None = None  # SFT runs: the pretrained run they fine-tune
    lns: bool = False
    model: Model | None = None  # None: the study's model

    @property
    def name(self) -> str:
        return f"{self.arm}/seed-{self.seed}"

    @property
    def sft(self) -> bool:
        return self.parent is not None


def pretrain_runs(cfg: StudyConfig, arms: list[Arm] | None = None, seeds: list[int] | None = None) -> list[Run]:
    """Seed-major, so that complete seeds finish early."""
    return [Run(a.name, s, cfg.output / "runs" / a.name / f"seed-{s}", a.batch, a.steps, a.lam, a.alpha,
                lns=a.lns, model=a.model)
            for s in (seeds or cfg.seed_list) for a in (arms or cfg.arms())]


def stage2_runs(cfg: StudyConfig, arm: str) -> list[Run]:
    """Study v4's depth-24 runs: the baseline and the chosen stage-1 arm (study_v4_analysis.stage2_arm)."""
    model = replace(cfg.model, layers=2 * cfg.model.layers)
    arms = [Arm(a.name, cfg.small_batch, cfg.steps, a.lam, a.alpha, a.lns, model) for a in V4A.stage2_specs(arm)]
    return pretrain_runs(cfg, arms, [s for s in cfg.seed_list if s in V4A.STAGE2_SEEDS] or cfg.seed_list[:2])


def sft_runs(cfg: StudyConfig, pretrained: list[Run]) -> list[Run]:
    parents = [r for r in pretrained
               if r.seed < cfg.first_seed + cfg.sft_seeds and r.arm in ("baseline-small", cfg.jreg_arm)]
    return [Run(f"sft-{p.arm}", p.seed, cfg.output / "runs" / f"sft-{p.arm}" / f"seed-{p.seed}", cfg.sft_batch,
                cfg.sft_steps, parent=p) for p in parents]


def save_interval(cfg: StudyConfig, run: Run) -> int:
    return run.steps if run.sft else max(1, run.steps // cfg.checkpoints)


def run_spec(cfg: StudyConfig, run: Run) -> dict:
    """Everything that makes a run's results; a run folder started with another spec is refused."""
    spec = {"arm": run.arm, "seed": run.seed, "batch": run.batch, "steps": run.steps, "tokens": run.batch *
            run.steps * SEQ_LENGTH, "lambda": run.lam, "alpha": run.alpha,
            "distance": cfg.distance if run.lam else None, "model": asdict(run.model or cfg.model),
            "save_interval": save_interval(cfg, run), "core_windows": cfg.core_windows,
            "train_windows": cfg.train_windows, "eval_sequences": cfg.eval_sequences}
    if run.sft:
        spec.update(parent=run.parent.name, lr=cfg.sft_lr)
    if run.lns:
        spec["layernorm_scaling"] = True
    return spec


def train_command(cfg: StudyConfig, run: Run, data: Data) -> list[str]:
    """`megatron-jreg train`: the model, our recipe, this arm's batch, steps and JREG setting, this seed."""
    ckpt = str(run.dir / "checkpoints")
    log_interval = max(1, run.steps // 100)
    common = [
        "--seed", str(run.seed), "--log-interval", str(log_interval),
        # Megatron-LM's validation once, on the final weights (its end-of-training evaluation)
        "--eval-interval", str(run.steps + 1), "--eval-iters", str(max(1, cfg.eval_sequences // run.batch)),
        "--save", ckpt, "--load", ckpt, "--save-interval", str(save_interval(cfg, run)),
        "--metrics-file", str(run.dir / "metrics.jsonl"), "--no-progress",
    ]
    if not run.sft:
        return [sys.executable, "-m", "megatron_jreg.train", *(run.model or cfg.model).flags(),
                *recipe_flags(run.batch, run.steps), *data_flags(data), "--init-mode", "layout-independent", *common,
                *Arm(run.arm, run.batch, run.steps, run.lam, run.alpha, run.lns).jreg_flags(cfg.distance)]
    # the paper's SFT is plain cross-entropy (Hugging Face transformers, its A.3): λ = 0 for both models
    return [sys.executable, "-m", "megatron_jreg.train", *cfg.model.flags(),
            *recipe_flags(run.batch, run.steps, lr=cfg.sft_lr, min_lr=0.0), "--lr-warmup-iters", "0",
            "--lr-decay-style", "linear", "--sft", "--tokenizer-type", "SFTTokenizer",
            "--sft-tokenizer-prompt-format", "default", "--tokenizer-model", str(data.root / "chat_tokenizer"),
            "--data-path", str(data.root / "chat.jsonl"), "--split", "95,5,0",
            "--no-create-attention-mask-in-dataloader", "--num-workers", "0",
            # weights only, iteration 0, a fresh optimizer; an interrupted SFT resumes from its own --load
            "--pretrained-checkpoint", str(run.parent.dir / "checkpoints"), *common,
            "--jreg-lambda", "0"]


def latest_iteration(run: Run) -> int:
    try:
        return int((run.dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip())
    except (OSError, ValueError):
        return 0


def last_logged_iteration(run: Run) -> int:
    path = run.dir / "metrics.jsonl"
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 4096))
        lines = f.read().decode("utf-8", "replace").splitlines()
    for line in reversed(lines):
        try:
            return int(json.loads(line)["iteration"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def check_spec(cfg: StudyConfig, run: Run) -> None:
    """Write the run's spec, or refuse a folder that holds a run with other settings."""
    spec = run_spec(cfg, run)
    path = run.dir / "spec.json"
    if path.exists():
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(spec) | set(old) if spec.get(k) != old.get(k))
        if diff:
            changes = ", ".join(f"{k}: {old.get(k)!r} there, {spec.get(k)!r} now" for k in diff)
            raise SystemExit(f"study.py: error: {run.dir} holds a run with other settings ({changes}); "
                             "give another --output, or the settings it was started with")
        return
    run.dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=1) + "\n")


# ----------------------------------------------------------------------------------------------------------
# the per-run measurement worker (one process: one import of torch and megatron-core)


def measured(cfg: StudyConfig, run: Run) -> bool:
    """Every measurement of the design is done: the series (post.done) and, from v3 on, layer removal."""
    return (run.dir / "post.done").exists() and (cfg.design == "v2" or (run.dir / "removal.done").exists())


def post_process(run_dir: Path, removal: bool = False) -> int:
    """Measure the run's checkpoints (examples/measure.py) into measures.json, then post.done; with `removal`
    (v3) layer removal at the final checkpoint into removal.json, then removal.done."""
    spec = json.loads((run_dir / "spec.json").read_text())
    data = json.loads((run_dir.parents[2] / "data.json").read_text())
    if not (run_dir / "post.done").exists():
        rc = measure_series(run_dir, spec, data)
        if rc:
            return rc
    if removal and not (run_dir / "removal.done").exists():
        return measure_removal(run_dir, spec, data)
    return 0


def measure_removal(run_dir: Path, spec: dict, data: dict) -> int:
    """Study v3's mechanism (experiments/study/study_v3_analysis.py): ΔCE of skipping each decoder layer and the top
    1, 2, 3 layers of the final checkpoint, on every held-out window (`megatron-jreg analyze`'s layer removal)."""
    import measure

    from megatron_jreg.analysis.removal import layer_removal

    t0 = time.time()
    final = run_dir / "checkpoints" / f"iter_{spec['steps']:07d}"
    heldout = measure.token_windows(Path(data["heldout_prefix"]), SEQ_LENGTH)
    result = layer_removal(str(final), heldout, top_k=(1, 2, 3), batch_size=32)
    record = {"iteration": spec["steps"], "windows": len(heldout), "base_ce": result["base_ce"],
              "single": result["delta_ce"], "top": dict(zip(map(str, result["top_k"]), result["delta_ce_top"])),
              "layer_removal": result}
    tmp = run_dir / "removal.json.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(run_dir / "removal.json")
    (run_dir / "removal.done").write_text(json.dumps({"wall_s": time.time() - t0}) + "\n")
    return 0


def measure_series(run_dir: Path, spec: dict, data: dict) -> int:
    import measure

    t0 = time.time()
    checkpoints = sorted((run_dir / "checkpoints").glob("iter_*"), key=lambda p: int(p.name.split("_")[1]))
    checkpoints = [c for c in checkpoints if int(c.name.split("_")[1]) % spec["save_interval"] == 0]
    if not checkpoints or int(checkpoints[-1].name.split("_")[1]) != spec["steps"]:
        print(f"{run_dir}: no final checkpoint at step {spec['steps']}", file=sys.stderr)
        return 1
    heldout = measure.token_windows(Path(data["heldout_prefix"]), SEQ_LENGTH)
    core = heldout[: spec["core_windows"]]
    train = measure.token_windows(Path(data["train_prefix"]), SEQ_LENGTH, limit=spec["train_windows"])
    series = measure.measure_series(checkpoints, core, heldout, train)
    tmp = run_dir / "measures.json.tmp"
    tmp.write_text(json.dumps({"windows": {"core": len(core), "heldout": len(heldout), "train": len(train)},
                               "series": series}, indent=1) + "\n")
    tmp.replace(run_dir / "measures.json")
    (run_dir / "post.done").write_text(json.dumps({"wall_s": time.time() - t0}) + "\n")
    return 0


# ----------------------------------------------------------------------------------------------------------
# scheduling: at most --jobs processes at once, measurements before new trainings


@dataclass
class Job:
    run: Run
    kind: str  # "train" | "post"
    proc: subprocess.Popen
    log: object
    start: float
    from_iteration: int = 0
    cpu_s: float | None = None


@dataclass
class Progress:
    runs: list[Run]
    jobs: int
    start: float = field(default_factory=time.time)
    rates: list[float] = field(default_factory=list)  # seconds per token of finished trainings

    def line(self, running: list[Job]) -> str:
        trained = sum((r.dir / "train.done").exists() for r in self.runs)
        posted = sum((r.dir / "post.done").exists() for r in self.runs)
        parts = [f"{_clock(time.time() - self.start)}  trained {trained}/{len(self.runs)}, "
                 f"measured {posted}/{len(self.runs)}"]
        for job in running:
            parts.append(f"{job.run.name} step {last_logged_iteration(job.run)}/{job.run.steps}"
                         if job.kind == "train" else f"{job.run.name} measuring")
        if self.rates:
            left = sum((r.steps - latest_iteration(r)) * r.batch * SEQ_LENGTH for r in self.runs
                       if not (r.dir / "train.done").exists())
            parts.append(f"ETA {_clock(left * sum(self.rates) / len(self.rates) / self.jobs)} (training)")
        return "[study] " + " | ".join(parts)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class Stop(Exception):
    pass


def execute(cfg: StudyConfig, runs: list[Run], data: Data, code: dict) -> list[str]:
    """Train and measure every run not done yet; returns the names of the runs that failed."""
    trains = deque(r for r in runs if not (r.dir / "train.done").exists())
    posts = deque(r for r in runs if (r.dir / "train.done").exists() and not measured(cfg, r))
    running: list[Job] = []
    failed: list[str] = []
    progress = Progress(runs, cfg.jobs)
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum
        for job in running:  # trainings save a checkpoint and exit (Megatron-LM's exit-signal handler)
            if job.proc.poll() is None:
                job.proc.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    env = child_env()
    interval = 5.0 if cfg.quick else 60.0
    last_print = 0.0
    try:
        while trains or posts or running:
            while stopping["signal"] is None and len(running) < cfg.jobs and (trains or posts):
                if posts:
                    run = posts.popleft()
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--_post", str(run.dir)]
                    if cfg.design != "v2":
                        cmd.append("--_removal")
                    log = open(run.dir / "post.log", "a", encoding="utf-8")  # noqa: SIM115 - closed on exit
                    kind, from_it = "post", 0
                else:
                    run = trains.popleft()
                    cmd = train_command(cfg, run, data)
                    (run.dir / "command.txt").write_text(" ".join(cmd) + "\n")
                    log = open(run.dir / "train.log", "a", encoding="utf-8")  # noqa: SIM115 - closed on exit
                    kind, from_it = "train", latest_iteration(run)
                    if from_it:
                        print(f"[study] {run.name}: resuming from its checkpoint at step {from_it}", flush=True)
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                        start_new_session=True)  # Ctrl-C reaches them through on_signal only
                running.append(Job(run, kind, proc, log, time.time(), from_it))
            time.sleep(0.5)
            for job in [j for j in running if _reap(j)]:
                running.remove(job)
                job.log.close()
                wall = time.time() - job.start
                _record_attempt(job, wall, code)
                ok = job.proc.returncode == 0
                if job.kind == "train" and ok and latest_iteration(job.run) >= job.run.steps:
                    (job.run.dir / "train.done").write_text(json.dumps({"wall_s": wall}) + "\n")
                    done = (job.run.steps - job.from_iteration) * job.run.batch * SEQ_LENGTH
                    progress.rates.append(wall / max(1, done))
                    posts.append(job.run)
                elif (job.kind == "train" or not ok) and stopping["signal"] is None:
                    if cfg.design == "v4" and job.kind == "train" and job.proc.returncode == NONFINITE_EXIT:
                        if _nonfinite_attempts(job.run) < 2:  # study_v4_analysis: retried once from scratch
                            print(f"[study] {job.run.name}: not finite (exit {NONFINITE_EXIT}); retrying it once "
                                  "from scratch", flush=True)
                            _clear_run(job.run)
                            trains.append(job.run)
                        else:
                            print(f"[study] {job.run.name}: not finite twice: counted as failing", flush=True)
                            (job.run.dir / "failed.json").write_text(json.dumps({"reason": "not finite"}) + "\n")
                        continue
                    failed.append(job.run.name)
                    _report_failure(job.run, f"{job.kind}.log", job.proc.returncode)
            if stopping["signal"] is not None and not running:
                raise Stop
            if time.time() - last_print >= interval and running:
                last_print = time.time()
                print(progress.line(running), flush=True)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return failed


NONFINITE_EXIT = 16  # Megatron-LM's rerun machine on a NaN/Inf loss (training/loop.py)


def _nonfinite_attempts(run: Run) -> int:
    path = run.dir / "attempts.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return sum(1 for line in lines if json.loads(line).get("rc") == NONFINITE_EXIT)


def _clear_run(run: Run) -> None:
    """A retried run starts from scratch: its checkpoints and metrics go (its log and attempts stay)."""
    import shutil

    shutil.rmtree(run.dir / "checkpoints", ignore_errors=True)
    (run.dir / "metrics.jsonl").unlink(missing_ok=True)


def _reap(job: Job) -> bool:
    """Whether the job's process ended; reaps it with wait4 to keep its CPU time (user + system, its own
    children included): the study's cost in core-seconds, whatever else the machine was running."""
    pid, status, usage = os.wait4(job.proc.pid, os.WNOHANG)
    if pid == 0:
        return False
    job.proc.returncode = os.waitstatus_to_exitcode(status)
    job.cpu_s = usage.ru_utime + usage.ru_stime
    return True


def _record_attempt(job: Job, wall: float, code: dict) -> None:
    with open(job.run.dir / "attempts.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"kind": job.kind, "start": job.start, "wall_s": wall, "cpu_s": job.cpu_s,
                            "rc": job.proc.returncode,
                            "from_iteration": job.from_iteration, "to_iteration": latest_iteration(job.run),
                            "commit": code.get("commit"), "dirty_files": code.get("dirty_files"),
                            "argv": code.get("argv"), "machine": code.get("machine")}) + "\n")


def _record_invocation(cfg: StudyConfig, invocation: dict) -> None:
    """Appended when it starts (wall_s None) and again when it ends; readers keep the last line per start."""
    with open(cfg.output / "invocations.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"wall_s": None, **invocation}) + "\n")


def _report_failure(run: Run, log: str, rc: int) -> None:
    tail = (run.dir / log).read_text(encoding="utf-8", errors="replace").splitlines()[-25:]
    print(f"[study] {run.name}: {log.split('.')[0]} failed (exit {rc}); the end of {run.dir / log}:\n  "
          + "\n  ".join(tail), file=sys.stderr, flush=True)


def prepare_chat(data: Data) -> None:
    """The vendored chat data checked for Megatron-LM's SFTDataset, and the tokenizer with a chat template."""
    if (data.root / "chat.jsonl").exists() and (data.root / "chat_tokenizer").is_dir():
        return
    from megatron_jreg.cli import main as cli

    rc = cli(["prepare-chat", "--input", str(CHAT), "--output", str(data.root / "chat.jsonl"),
              "--tokenizer", data.tokenizer, "--tokenizer-output", str(data.root / "chat_tokenizer"),
              "--seq-length", str(SEQ_LENGTH)])
    if rc != 0:
        raise SystemExit(f"study.py: error: prepare-chat failed ({rc})")


# ----------------------------------------------------------------------------------------------------------
# command line


def git_state() -> dict:
    """The commit of the code that ran, and whether the study's files or megatron_jreg differ from it."""
    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return r.stdout.rstrip("\n") if r.returncode == 0 else ""

    dirty = git("status", "--porcelain", "--", "examples", "experiments", "megatron_jreg")
    return {"commit": git("rev-parse", "HEAD").strip() or None,
            "dirty_files": [line[3:] for line in dirty.splitlines()]}


def machine() -> dict:
    """What changes a run's rounding: the CPU model, torch's version and the threads each run uses."""
    from importlib.metadata import version

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo", encoding="utf-8")
                if line.startswith("model name")), None) if os.path.exists("/proc/cpuinfo") else None
    env = child_env()
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": version("torch"),
            "threads": {k: env.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}}


def build_parser() -> argparse.ArgumentParser:
    d = StudyConfig(output=Path("study_output"))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, default=None,
                   help="where everything is written (default: study_output, or study_quick with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke test of the pipeline: tiny model, a few steps")
    p.add_argument("--design", choices=("v2", "v3", "v4"), default="v2",
                   help="v2: the committed study of report_v2.md; v3: issue 30's (study_v3_analysis.py); v4: issue "
                        "43's (study_v4_analysis.py, docs/study.md)")
    p.add_argument("--fallback", action="store_true",
                   help="v4: the pre-registered fallback after a failed gate (3,000 steps, 8 seeds, no stage 2)")
    p.add_argument("--seeds", type=int, help=f"training seeds: this many from the design's first (default {d.seeds}"
                   " for v2, 12 from seed 9 for v3)")
    p.add_argument("--alphas", type=float, nargs="+",
                   help=f"α of the JREG arms at the small batch (default {' '.join(f'{a:g}' for a in d.alphas)})")
    p.add_argument("--large-steps", type=int,
                   help=f"steps of baseline-large; the small-batch arms take {d.large_batch // d.small_batch}× "
                        f"as many (default {d.large_steps})")
    p.add_argument("--jobs", type=int, help=f"processes at once, one core each (default {d.jobs})")
    p.add_argument("--gate", type=float, help=f"pilot gate: least ζ_L of baseline-small seed 1 (default {d.gate:g})")
    p.add_argument("--ignore-gate", action="store_true", help="go on after a failed pilot gate")
    p.add_argument("--sft-seeds", type=int, help=f"seeds fine-tuned in the SFT analogue (default {d.sft_seeds})")
    p.add_argument("--report", type=Path, help="write the report here, plots beside it (default OUTPUT/report.md)")
    p.add_argument("--report-only", action="store_true", help="no training: report from what is there")
    p.add_argument("--runs", nargs="+", metavar="ARM/seed-S",
                   help="train and measure only these runs and the runs they start from (an SFT run's "
                        "pretrained model), e.g. to complete a committed study: `study_report.py --merge` then "
                        "adds them to its raw files")
    p.add_argument("--stage1-raw", type=Path, metavar="DIR",
                   help="v4: stage 1's raw results (e.g. experiments/study/raw_v4) when its run folders are gone: "
                        "stage 2 alone, its arm chosen from them by the pre-registered rule")
    p.add_argument("--_post", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--_removal", action="store_true", help=argparse.SUPPRESS)
    return p


def config_from(args: argparse.Namespace) -> StudyConfig:
    stem = "study_output" if args.design == "v2" else f"study_{args.design}_output"
    base = StudyConfig(output=Path(stem.replace("output", "quick") if args.quick else stem))
    if args.design == "v3":
        base = replace(base, **V3)
    if args.design == "v4":
        base = replace(base, **V4)
        if args.fallback:
            base = replace(base, steps=V4A.STEPS_FALLBACK, seeds=len(V4A.FALLBACK_SEEDS), fallback=True)
    if args.quick:  # a tiny model and few steps; the design's arms, seeds and phases stay
        keep = ({k: getattr(base, k) for k in ("alphas", "first_seed", "gate", "sft_seeds")}
                if args.design != "v2" else {})
        base = replace(base, **{**QUICK, **keep}, **({"steps": 8} if args.design == "v4" else {}))
    chosen = {k: v for k, v in dict(seeds=args.seeds, large_steps=args.large_steps, jobs=args.jobs,
                                    gate=args.gate, sft_seeds=args.sft_seeds).items() if v is not None}
    if args.alphas is not None:
        chosen["alphas"] = tuple(dict.fromkeys(args.alphas))
    cfg = replace(base, **chosen, ignore_gate=args.ignore_gate, output=(args.output or base.output).resolve())
    for name in ("seeds", "large_steps", "jobs"):
        if getattr(cfg, name) < 1:
            raise SystemExit(f"study.py: error: --{name.replace('_', '-')} {getattr(cfg, name)}: must be at least 1")
    if not 0 <= cfg.sft_seeds <= cfg.seeds:
        raise SystemExit(f"study.py: error: --sft-seeds {cfg.sft_seeds}: must lie in 0..--seeds ({cfg.seeds})")
    if not all(math.isfinite(a) for a in cfg.alphas) or (cfg.gate is not None and not math.isfinite(cfg.gate)):
        raise SystemExit("study.py: error: --alphas and --gate must be finite numbers")
    if cfg.large_steps < cfg.checkpoints:
        raise SystemExit(f"study.py: error: --large-steps {cfg.large_steps}: at least {cfg.checkpoints} "
                         "(one per checkpoint)")
    if cfg.large_steps % cfg.checkpoints:
        raise SystemExit(f"study.py: error: --large-steps {cfg.large_steps}: must be a multiple of "
                         f"{cfg.checkpoints}, so every arm saves at the same fractions of its budget")
    return cfg


def select_runs(pretrain: list[Run], sft: list[Run], names: list[str]) -> tuple[list[Run], list[Run]]:
    """The named runs and their parents (--runs); an unknown name is refused with the known ones."""
    known = {r.name: r for r in pretrain + sft}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"study.py: error: --runs {' '.join(unknown)}: no such run in this study's settings "
                         f"(known: {', '.join(known)})")
    chosen = {n for n in names} | {known[n].parent.name for n in names if known[n].parent is not None}
    return [r for r in pretrain if r.name in chosen], [r for r in sft if r.name in chosen]


def gate_result(cfg: StudyConfig, pilot: Run) -> dict:
    """The pilot gate, from baseline-small seed 1's final held-out ζ_L (written to gate.json)."""
    measures = json.loads((pilot.dir / "measures.json").read_text())
    value = measures["series"][-1]["heldout"]["zeta_L"]
    result = {"run": pilot.name, "zeta_L": value, "threshold": cfg.gate, "passed": value >= cfg.gate,
              "ignored": cfg.ignore_gate and value < cfg.gate}
    (cfg.output / "gate.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def write_report(cfg: StudyConfig, report: Path) -> None:
    """The design's report from OUTPUT/raw (v3's and v4's: study_v<N>_report.py, on their pre-registered analysis)."""
    if cfg.design == "v2":
        import study_report

        study_report.write_report(cfg.output / "raw", report)
        return
    import importlib

    try:
        module = importlib.import_module(f"study_{cfg.design}_report")
    except ImportError:  # the analysis was fixed before the runs; its report came later
        print(f"[study] raw results in {cfg.output / 'raw'}; the {cfg.design} report: "
              f"experiments/study/study_{cfg.design}_report.py", flush=True)
        return
    module.write_report(cfg.output / "raw", report)


def final_records(runs: list[Run]) -> tuple[dict, frozenset]:
    """{(arm, seed): final held-out/train measures and layer removal} of the measured runs, and the failing ones."""
    finals, failed = {}, set()
    for run in runs:
        if (run.dir / "failed.json").exists():
            failed.add((run.arm, run.seed))
        elif (run.dir / "removal.done").exists():
            last = json.loads((run.dir / "measures.json").read_text())["series"][-1]
            finals[run.arm, run.seed] = {**last, "removal": json.loads((run.dir / "removal.json").read_text())}
    return finals, frozenset(failed)


def run_v4(cfg: StudyConfig, pretrain: list[Run], data: Data, code: dict, selected: bool,
           stage1_raw: Path | None = None) -> tuple[list[str], int]:
    """Study v4's stages (study_v4_analysis.py): the gate, stage 1, then stage 2 at depth 24 on the arm chosen by
    the pre-registered rule; with `stage1_raw` (stage 1's committed raw files) stage 2 alone, its arm chosen by
    the same rule from them. Returns (failed run names, exit status)."""
    if stage1_raw is not None:
        import study_v4_report

        _, _, finals, bad = study_v4_report.load(stage1_raw)
        return _stage2(cfg, {k: v for k, v in finals.items() if not k[0].startswith("d24-")}, bad, data, code)
    stage1 = [r for r in pretrain if not r.arm.startswith("d24-")]
    gate = [r for r in stage1 if r.arm == "baseline" and r.seed in V4A.GATE_SEEDS and not cfg.fallback]
    todo = [r for r in gate if not measured(cfg, r)]
    if todo:
        print(f"[study] gate: {len(todo)} run(s) to do", flush=True)
        failed = execute(cfg, todo, data, code)
        if failed:
            return failed, 1
    if gate and len(gate) == len(V4A.GATE_SEEDS):
        finals, _ = final_records(gate)
        passed = V4A.gate_passes(finals)
        rises = {s: V4A.top_rise(finals["baseline", s]["heldout"]["psi"]) for s in V4A.GATE_SEEDS}
        (cfg.output / "gate.json").write_text(json.dumps({"passed": passed, "R": rises}, indent=1) + "\n")
        print(f"[study] gate {'passed' if passed else 'failed'}: final R of baseline seeds "
              f"{', '.join(f'{s}: {r:+.2f}' for s, r in rises.items())} (both must be > 0)", flush=True)
        if not passed:
            print("[study] stopping: the rise does not form in one epoch; the pre-registered fallback is "
                  "`study.py --design v4 --fallback --output OTHER` (study_v4_analysis.py)", flush=True)
            return [], 3
    rest = [r for r in stage1 if r not in gate and not measured(cfg, r) and not (r.dir / "failed.json").exists()]
    if rest:
        print(f"[study] stage 1: {len(rest)} run(s) to do", flush=True)
        failed = execute(cfg, rest, data, code)
        if failed:
            return failed, 1
    if cfg.fallback or selected:
        return [], 0
    return _stage2(cfg, *final_records(pretrain_runs(cfg)), data, code)


def _stage2(cfg: StudyConfig, finals: dict, bad: frozenset, data: Data, code: dict) -> tuple[list[str], int]:
    arm = V4A.stage2_arm(V4A.analyse_stage1(finals, bad))
    (cfg.output / "stage2.json").write_text(json.dumps({"arm": arm}) + "\n")
    runs = stage2_runs(cfg, arm)
    for run in runs:
        check_spec(cfg, run)
    todo = [r for r in runs if not measured(cfg, r) and not (r.dir / "failed.json").exists()]
    if todo:
        print(f"[study] stage 2 (depth {2 * cfg.model.layers}, {arm} against the baseline): {len(todo)} run(s) to do",
              flush=True)
        return execute(cfg, todo, data, code), 0
    return [], 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args._post is not None:
        return post_process(args._post.resolve(), removal=args._removal)
    cfg = config_from(args)
    if args.stage1_raw is not None and (cfg.design != "v4" or cfg.fallback or args.runs
                                        or not (args.stage1_raw / "study.json").is_file()):
        raise SystemExit(f"study.py: error: --stage1-raw {args.stage1_raw}: give a folder of v4 raw results "
                         "(with study.json), with --design v4 and without --fallback or --runs")
    import study_report

    report = (args.report or cfg.output / "report.md").resolve()
    pretrain = pretrain_runs(cfg)
    stage2 = cfg.output / "stage2.json"
    if cfg.design == "v4" and stage2.exists():  # chosen when stage 1 ended
        pretrain += stage2_runs(cfg, json.loads(stage2.read_text())["arm"])
    sft = sft_runs(cfg, pretrain)
    if args.runs:
        pretrain, sft = select_runs(pretrain, sft, args.runs)
    argv_used = [Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]
    code = {**git_state(), "argv": argv_used, "machine": machine()}
    if args.report_only:
        study_report.export_raw(cfg, pretrain + sft)
        write_report(cfg, report)
        return 0
    cfg.output.mkdir(parents=True, exist_ok=True)
    ignore = cfg.output / ".gitignore"  # checkpoints (GBs) never end up in a commit, wherever --output is
    if not ignore.exists():
        ignore.write_text("*\n")
    lock = open(cfg.output / ".lock", "w")  # noqa: SIM115 - held until exit
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise SystemExit(f"study.py: error: another study is running in {cfg.output}") from None
    for run in pretrain + sft:
        check_spec(cfg, run)
    invocation = {"argv": argv_used, "start": time.time(),
                  "config": json.loads(json.dumps(asdict(cfg), default=str)), **git_state()}
    t0 = time.time()
    _record_invocation(cfg, invocation)  # at the start too: an invocation killed outright still shows
    data = prepare_data(cfg.output)
    (cfg.output / "data.json").write_text(json.dumps({k: str(v) for k, v in asdict(data).items()}, indent=1) + "\n")
    budget = pretrain[0].batch * pretrain[0].steps * SEQ_LENGTH
    print(f"[study] {len(pretrain)} pretraining runs ({cfg.seeds} seed(s) × {', '.join(a.name for a in cfg.arms())}; "
          f"{budget:,} tokens each) + {len(sft)} SFT runs, --jobs {cfg.jobs}", flush=True)
    pilot = [r for r in pretrain if r.seed == cfg.first_seed and r.arm.startswith("baseline")
             and cfg.gate is not None]
    phases = [("pilot", pilot), ("study", [r for r in pretrain if r not in pilot]), ("sft", sft)]
    failed: list[str] = []
    status = 0
    if cfg.design == "v4":
        try:
            failed, status = run_v4(cfg, pretrain, data, code, selected=bool(args.runs), stage1_raw=args.stage1_raw)
        except Stop:
            print("[study] stopped; the runs saved checkpoints. Run the same command again to resume.", flush=True)
            return 130
        finally:
            invocation["wall_s"] = time.time() - t0
            _record_invocation(cfg, invocation)
        phases = []
    try:
        for phase, runs in phases:
            todo = [r for r in runs if not measured(cfg, r)]
            if todo:
                print(f"[study] {phase}: {len(todo)} run(s) to do", flush=True)
                if phase == "sft":
                    prepare_chat(data)
                failed += execute(cfg, todo, data, code)
            if failed:
                break
            if phase == "pilot" and len(pilot) == 2:
                gate = gate_result(cfg, pilot[1])
                verdict = "passed" if gate["passed"] else ("failed, ignored (--ignore-gate)" if gate["ignored"]
                                                           else "failed")
                print(f"[study] pilot gate {verdict}: {gate['run']} final held-out ζ_L {gate['zeta_L']:.2f} "
                      f"(threshold {cfg.gate:g})", flush=True)
                if not gate["passed"] and not cfg.ignore_gate:
                    print("[study] stopping: this regime has no jump for JREG to remove; the report says so. "
                          "--ignore-gate goes on anyway.", flush=True)
                    status = 3
                    break
    except Stop:
        print("[study] stopped; the runs saved checkpoints. Run the same command again to resume.", flush=True)
        return 130
    finally:
        invocation["wall_s"] = time.time() - t0
        _record_invocation(cfg, invocation)
    if cfg.design == "v4" and stage2.exists():
        pretrain = list({r.name: r for r in pretrain + stage2_runs(cfg, json.loads(stage2.read_text())["arm"])}
                        .values())
    study_report.export_raw(cfg, pretrain + sft)
    if args.stage1_raw is None:
        write_report(cfg, report)
    else:
        report = f"`study_report.py --raw {args.stage1_raw} --merge {cfg.output / 'raw'}` for the report"
    print(f"[study] done in {_clock(time.time() - t0)}: {cfg.output / 'raw'}, {report}", flush=True)
    if failed:
        print(f"[study] failed: {', '.join(failed)} (logs above); run the same command again to retry them",
              file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
