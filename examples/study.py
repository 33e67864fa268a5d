"""`python examples/study.py`: the paper's experiments at laptop scale, in one resumable command.

For each seed s = 1..N it trains the baseline (λ = 0) and JREG (λ = 1) for each α of the sweep with
`megatron-jreg train` (Megatron-LM's loop; `make demo`'s 6 × 192 Llama on the bundled WikiText-2; with
`--init-mode layout-independent` and the same `--seed` every arm of a seed starts from the same weights and
reads the same batches), keeping a checkpoint series per run. Then, per run, `megatron-jreg analyze` on the
series (Ψ_ℓ and ζ on held-out WikiText-2 test paragraphs at every checkpoint) and `megatron-jreg evaluate`
(lm-eval's `wikitext` task over the local WikiText-2 test, LAMBADA top-1); per α, `megatron-jreg compare`
(one-sided paired t-test over the seeds, per metric). Writes results.json, report.md (the paper's
Tables 3, 5 and 13 at this scale) and study_*.png (study_report.py).

    python examples/study.py                          # the default study: about an hour on 2 cores
    python examples/study.py --quick                  # pipeline smoke test: tiny model, 1 seed, α ∈ {0, 1}
    python examples/study.py --seeds 5 --alphas 0 0.1 0.3 0.5 1 3 --steps 600 --jobs 4
    python examples/study.py --report-only --report docs/study.md   # tables and plots from what is there

Resumable: a finished run is skipped (train.done / post.done in its folder); an interrupted one continues
from its last checkpoint (`--load` = `--save`, Megatron-LM's exact resume). Ctrl-C or SIGTERM asks every
training to save a checkpoint and stop (Megatron-LM's exit-signal handler); run the same command to go on.
More seeds or α on an existing --output reuse the runs already there; other settings are refused.

Output folder:
    data/                      tokenizer and indexed datasets (examples/demo.py's prepare_data)
    tasks/                     the lm-eval task over the local WikiText-2 test
    runs/<arm>/seed-<s>/       spec.json, command.txt, train.log, metrics.jsonl, checkpoints/iter_*,
                               analysis/results.json, eval.json, post.log, train.done, post.done
    compare/<arm>/<metric>/    the score files given to `compare` and its output (compare.json)
    results.json, report.md, study_*.png, invocations.jsonl
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
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
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]  # this checkout's megatron_jreg and demo.py, whatever is installed

from demo import WIKITEXT, prepare_data, train_args  # noqa: E402

# the tiny model of --quick, as Megatron-LM flags appended to the demo's (later flags win)
QUICK_MODEL = ("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128")
TASK = "wikitext2_local"


@dataclass(frozen=True)
class StudyConfig:
    """What the study trains and measures. The defaults are the committed study (docs/study.md)."""

    output: Path
    seeds: int = 3
    alphas: tuple[float, ...] = (0.0, 0.3, 1.0, 3.0)
    steps: int = 300
    checkpoints: int = 10  # the series: one checkpoint every steps / checkpoints iterations
    jobs: int = 2
    lam: float = 1.0
    distance: str = "angular"  # JREG's training distance; Ψ and ζ are always reported angular
    batch_size: int = 16
    eval_iters: int = 20  # Megatron-LM's validation at the end: eval_iters × batch_size sequences
    log_interval: int = 10
    analysis_samples: int = 256  # WikiText-2 test paragraphs given to analyze per checkpoint
    eval_limit: int = 300  # evaluate --limit: LAMBADA passages (and wikitext articles, of which there are 62)
    model_flags: tuple[str, ...] = ()
    quick: bool = False

    @property
    def save_interval(self) -> int:
        return max(1, self.steps // self.checkpoints)

    def arms(self) -> list[tuple[str, float | None]]:
        """(name, α) of every arm; α None is the baseline."""
        return [("baseline", None)] + [(arm_name(a), a) for a in self.alphas]


QUICK = dict(seeds=1, alphas=(0.0, 1.0), steps=6, checkpoints=2, batch_size=4, eval_iters=2, log_interval=1,
             analysis_samples=16, eval_limit=8, model_flags=QUICK_MODEL, quick=True)


def arm_name(alpha: float) -> str:
    return f"jreg-a{alpha:g}"


@dataclass(frozen=True)
class Run:
    arm: str
    alpha: float | None
    seed: int
    dir: Path

    @property
    def name(self) -> str:
        return f"{self.arm}/seed-{self.seed}"


def plan(cfg: StudyConfig) -> list[Run]:
    """Every run, seed-major so that complete seed pairs finish early."""
    return [Run(arm, alpha, seed, cfg.output / "runs" / arm / f"seed-{seed}")
            for seed in range(1, cfg.seeds + 1) for arm, alpha in cfg.arms()]


def run_spec(cfg: StudyConfig, run: Run) -> dict:
    """Everything that makes a run's results; a run folder started with another spec is refused."""
    return {
        "arm": run.arm, "seed": run.seed, "lambda": 0.0 if run.alpha is None else cfg.lam, "alpha": run.alpha,
        "distance": None if run.alpha is None else cfg.distance, "steps": cfg.steps,
        "save_interval": cfg.save_interval, "batch_size": cfg.batch_size, "eval_iters": cfg.eval_iters,
        "log_interval": cfg.log_interval, "model_flags": list(cfg.model_flags),
        "analysis_samples": cfg.analysis_samples, "eval_limit": cfg.eval_limit,
    }


def train_command(cfg: StudyConfig, run: Run, tokenizer: str, data: Path) -> list[str]:
    """`megatron-jreg train` with the demo's model and recipe, this run's seed, JREG setting and checkpoints."""
    demo = argparse.Namespace(batch_size=cfg.batch_size, train_iters=cfg.steps, eval_iters=cfg.eval_iters,
                              log_interval=cfg.log_interval)
    jreg = (["--jreg-lambda", "0"] if run.alpha is None else
            ["--jreg-lambda", f"{cfg.lam:g}", "--jreg-alpha", f"{run.alpha:g}", "--jreg-distance", cfg.distance])
    return [
        sys.executable, "-m", "megatron_jreg.train", *train_args(demo, tokenizer, data, run.dir), *cfg.model_flags,
        "--seed", str(run.seed), "--init-mode", "layout-independent",
        "--save-interval", str(cfg.save_interval), "--load", str(run.dir / "checkpoints"),
        # validation once, on the final weights (Megatron-LM's end-of-training evaluation)
        "--eval-interval", str(cfg.steps + 1), *jreg,
    ]


def latest_iteration(run: Run) -> int:
    tracker = run.dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        return int(tracker.read_text().strip())
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
# the lm-eval task over local files, and the per-run analysis/evaluation worker


def write_task(out: Path) -> Path:
    """lm-eval's own `wikitext` task (loglikelihood_rolling; word perplexity, byte perplexity, bits per byte)
    over the local WikiText-2 test articles, kept in the training text's format (the task's detokenizer
    would turn the text into a form the models never saw)."""
    from megatron_jreg.data.text import wikitext_articles

    tasks = out / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    docs = tasks / "wikitext2_test.jsonl"
    if not docs.exists():
        tmp = docs.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"page": a}) + "\n" for a in wikitext_articles(WIKITEXT / "test.txt")))
        tmp.replace(docs)
    spec = importlib.util.find_spec("lm_eval")
    base = Path(spec.origin).parent / "tasks" / "wikitext" / "wikitext.yaml"
    (tasks / f"{TASK}.yaml").write_text(
        f"include: {base}\ntask: {TASK}\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {docs}\n"
        "training_split: null\nvalidation_split: null\ndoc_to_target: \"{{page}}\"\n"
    )
    return tasks


def post_process(run_dir: Path) -> int:
    """Analyze the run's checkpoint series and evaluate its final checkpoint, in one process (one import
    of torch and megatron-core): analysis/results.json and eval.json, then post.done."""
    from megatron_jreg.cli import main as cli

    spec = json.loads((run_dir / "spec.json").read_text())
    out = run_dir.parent.parent.parent
    t0 = time.time()
    rc = cli(["analyze", "--checkpoints", str(run_dir / "checkpoints" / "iter_*"),
              "--data", f"text:{WIKITEXT / 'test.txt'}", "--num-samples", str(spec["analysis_samples"]),
              "--output", str(run_dir / "analysis"), "--no-progress"])
    if rc != 0:
        return rc
    rc = cli(["evaluate", "--load", str(run_dir / "checkpoints"), "--tasks", f"{TASK},lambada",
              "--limit", str(spec["eval_limit"]), "--include-path", str(out / "tasks"),
              "--seed", str(spec["seed"]), "--output", str(run_dir / "eval.json")])
    if rc != 0:
        return rc
    (run_dir / "post.done").write_text(json.dumps({"wall_s": time.time() - t0}) + "\n")
    return 0


# ----------------------------------------------------------------------------------------------------------
# scheduling: at most --jobs processes at once, analyses before new trainings


@dataclass
class Job:
    run: Run
    kind: str  # "train" | "post"
    proc: subprocess.Popen
    log: object
    start: float
    from_iteration: int = 0


@dataclass
class Progress:
    runs: list[Run]
    cfg: StudyConfig
    start: float = field(default_factory=time.time)
    train_walls: list[float] = field(default_factory=list)
    post_walls: list[float] = field(default_factory=list)

    def line(self, running: list[Job]) -> str:
        trained = sum((r.dir / "train.done").exists() for r in self.runs)
        posted = sum((r.dir / "post.done").exists() for r in self.runs)
        parts = [f"{_clock(time.time() - self.start)}  trained {trained}/{len(self.runs)}, "
                 f"analysed {posted}/{len(self.runs)}"]
        for job in running:
            if job.kind == "train":
                parts.append(f"{job.run.name} step {last_logged_iteration(job.run)}/{self.cfg.steps}")
            else:
                parts.append(f"{job.run.name} analyse+evaluate")
        eta = self.eta(running)
        if eta is not None:
            parts.append(f"ETA {_clock(eta)}")
        return "[study] " + " | ".join(parts)

    def eta(self, running: list[Job]) -> float | None:
        """Remaining work / jobs, from the walls measured so far in this invocation."""
        if not self.train_walls and not any(j.kind == "train" for j in running):
            return None
        per_step = None
        if self.train_walls:
            per_step = sum(self.train_walls) / len(self.train_walls) / self.cfg.steps
        else:
            job = next(j for j in running if j.kind == "train")
            done = last_logged_iteration(job.run) - job.from_iteration
            if done < max(2, self.cfg.log_interval):
                return None
            per_step = (time.time() - job.start) / done
        post = sum(self.post_walls) / len(self.post_walls) if self.post_walls else 0.3 * per_step * self.cfg.steps
        left = 0.0
        for run in self.runs:
            if not (run.dir / "train.done").exists():
                left += per_step * (self.cfg.steps - latest_iteration(run))
            if not (run.dir / "post.done").exists():
                left += post
        return left / max(1, self.cfg.jobs)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _child_env(cfg: StudyConfig) -> dict[str, str]:
    threads = str(max(1, (os.cpu_count() or 1) // max(1, cfg.jobs)))
    return {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1",
            "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


class Stop(Exception):
    pass


def execute(cfg: StudyConfig, runs: list[Run], tokenizer: str, data: Path) -> list[str]:
    """Train and post-process every run not done yet; returns the names of the runs that failed."""
    trains = deque(r for r in runs if not (r.dir / "train.done").exists())
    posts = deque(r for r in runs if (r.dir / "train.done").exists() and not (r.dir / "post.done").exists())
    running: list[Job] = []
    failed: list[str] = []
    progress = Progress(runs, cfg)
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum
        for job in running:  # trainings save a checkpoint and exit (Megatron-LM's exit-signal handler)
            if job.proc.poll() is None:
                job.proc.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    env = _child_env(cfg)
    interval = 5.0 if cfg.quick else 30.0
    last_print = 0.0
    try:
        while trains or posts or running:
            while stopping["signal"] is None and len(running) < cfg.jobs and (trains or posts):
                if posts:
                    run = posts.popleft()
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--_post", str(run.dir)]
                    log = open(run.dir / "post.log", "a", encoding="utf-8")  # noqa: SIM115 - closed on exit
                    kind, from_it = "post", 0
                else:
                    run = trains.popleft()
                    cmd = train_command(cfg, run, tokenizer, data)
                    (run.dir / "command.txt").write_text(" ".join(cmd) + "\n")
                    log = open(run.dir / "train.log", "a", encoding="utf-8")  # noqa: SIM115 - closed on exit
                    kind, from_it = "train", latest_iteration(run)
                    if from_it:
                        print(f"[study] {run.name}: resuming from its checkpoint at step {from_it}", flush=True)
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                        start_new_session=True)  # Ctrl-C reaches them through on_signal only
                running.append(Job(run, kind, proc, log, time.time(), from_it))
            time.sleep(0.5)
            for job in [j for j in running if j.proc.poll() is not None]:
                running.remove(job)
                job.log.close()
                wall = time.time() - job.start
                _record_attempt(job, wall)
                if job.kind == "train":
                    reached = latest_iteration(job.run)
                    if job.proc.returncode == 0 and reached >= cfg.steps:
                        (job.run.dir / "train.done").write_text(json.dumps({"wall_s": wall}) + "\n")
                        if job.from_iteration == 0:
                            progress.train_walls.append(wall)
                        posts.append(job.run)
                    elif stopping["signal"] is None:
                        failed.append(job.run.name)
                        _report_failure(job.run, "train.log", job.proc.returncode)
                elif job.proc.returncode == 0:
                    progress.post_walls.append(wall)
                elif stopping["signal"] is None:
                    failed.append(job.run.name)
                    _report_failure(job.run, "post.log", job.proc.returncode)
            if stopping["signal"] is not None and not running:
                raise Stop
            if time.time() - last_print >= interval and running:
                last_print = time.time()
                print(progress.line(running), flush=True)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return failed


def _record_attempt(job: Job, wall: float) -> None:
    with open(job.run.dir / "attempts.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"kind": job.kind, "start": job.start, "wall_s": wall, "rc": job.proc.returncode,
                            "from_iteration": job.from_iteration, "to_iteration": latest_iteration(job.run)}) + "\n")


def _record_invocation(cfg: StudyConfig, invocation: dict) -> None:
    """Appended when it starts (wall_s None) and again when it ends; readers keep the last line per start."""
    with open(cfg.output / "invocations.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"wall_s": None, **invocation}) + "\n")


def _report_failure(run: Run, log: str, rc: int) -> None:
    tail = (run.dir / log).read_text(encoding="utf-8", errors="replace").splitlines()[-25:]
    print(f"[study] {run.name}: {log.split('.')[0]} failed (exit {rc}); the end of {run.dir / log}:\n  "
          + "\n  ".join(tail), file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------
# command line


def git_state() -> dict:
    """The commit of the code that ran, and whether the study's files or megatron_jreg differ from it."""
    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return r.stdout.rstrip("\n") if r.returncode == 0 else ""

    dirty = git("status", "--porcelain", "--", "examples/study.py", "examples/study_report.py",
                "examples/demo.py", "megatron_jreg")
    return {"commit": git("rev-parse", "HEAD").strip() or None,
            "dirty_files": [line[3:] for line in dirty.splitlines()]}


def build_parser() -> argparse.ArgumentParser:
    d = StudyConfig(output=Path("study_output"))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, default=None,
                   help="where everything is written (default: study_output, or study_quick with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test of the pipeline: tiny 4 × 64 model, 1 seed, α ∈ {0, 1}, 6 steps")
    p.add_argument("--seeds", type=int, help=f"training seeds 1..N (default {d.seeds})")
    p.add_argument("--alphas", type=float, nargs="+", help=f"JREG's α values (default {' '.join(map(str, d.alphas))})")
    p.add_argument("--steps", type=int, help=f"training iterations per run (default {d.steps})")
    p.add_argument("--checkpoints", type=int, help=f"checkpoints kept per run (default {d.checkpoints})")
    p.add_argument("--jobs", type=int, help="processes at once, one core each (default 2)")
    p.add_argument("--lam", type=float, help=f"JREG's λ (default {d.lam:g})")
    p.add_argument("--distance", choices=("angular", "cosine"), help=f"JREG's training distance (default {d.distance})")
    p.add_argument("--report", type=Path, help="write the report here, plots beside it (default OUTPUT/report.md)")
    p.add_argument("--report-only", action="store_true", help="no training: tables and plots from what is there")
    p.add_argument("--_post", type=Path, help=argparse.SUPPRESS)
    return p


def config_from(args: argparse.Namespace) -> StudyConfig:
    base = StudyConfig(output=Path("study_quick" if args.quick else "study_output"))
    if args.quick:
        base = replace(base, **QUICK)
    chosen = {k: v for k, v in dict(seeds=args.seeds, steps=args.steps, checkpoints=args.checkpoints,
                                    jobs=args.jobs, lam=args.lam, distance=args.distance).items() if v is not None}
    if args.alphas is not None:
        chosen["alphas"] = tuple(dict.fromkeys(args.alphas))
    cfg = replace(base, **chosen, output=(args.output or base.output).resolve())
    for name in ("seeds", "steps", "checkpoints", "jobs"):
        if getattr(cfg, name) < 1:
            raise SystemExit(f"study.py: error: --{name} {getattr(cfg, name)}: must be at least 1")
    if cfg.checkpoints > cfg.steps:
        raise SystemExit(f"study.py: error: --checkpoints {cfg.checkpoints} exceeds --steps {cfg.steps}")
    if not all(math.isfinite(a) for a in cfg.alphas) or not math.isfinite(cfg.lam) or cfg.lam <= 0:
        raise SystemExit("study.py: error: --alphas must be finite numbers and --lam a positive number")
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args._post is not None:
        return post_process(args._post.resolve())
    cfg = config_from(args)
    import study_report

    report = (args.report or cfg.output / "report.md").resolve()
    runs = plan(cfg)
    argv_used = [Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]
    if args.report_only:
        study_report.write_all(cfg, runs, report, code={**git_state(), "argv": argv_used})
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
    for run in runs:
        check_spec(cfg, run)
    invocation = {"argv": argv_used,
                  "start": time.time(), "config": {k: str(v) if isinstance(v, Path) else v
                                                   for k, v in asdict(cfg).items()}, **git_state()}
    t0 = time.time()
    _record_invocation(cfg, invocation)  # at the start too: an invocation killed outright still shows
    tokenizer, data = prepare_data(cfg.output, 4096)
    write_task(cfg.output)
    todo = [r for r in runs if not (r.dir / "post.done").exists()]
    alphas = ", ".join(f"{a:g}" for a in cfg.alphas)
    print(f"[study] {len(runs)} runs ({cfg.seeds} seed(s) × baseline + α ∈ {{{alphas}}}, {cfg.steps} steps, "
          f"--jobs {cfg.jobs}); {len(runs) - len(todo)} already done", flush=True)
    failed: list[str] = []
    try:
        failed = execute(cfg, todo, tokenizer, data)
    except Stop:
        print("[study] stopped; the runs saved checkpoints. Run the same command again to resume.", flush=True)
        return 130
    finally:
        invocation["wall_s"] = time.time() - t0
        _record_invocation(cfg, invocation)
    study_report.write_all(cfg, runs, report, code={**git_state(), "argv": argv_used})
    print(f"[study] done in {_clock(time.time() - t0)}: {cfg.output / 'results.json'}, {report}", flush=True)
    if failed:
        print(f"[study] failed: {', '.join(failed)} (logs above); run the same command again to retry them",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
