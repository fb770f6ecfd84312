"""The seed study on one GPU (scripts/convergence_study.py is the command line): build the corpus if it is missing,
train every seed of every arm and one long run as separate processes side by side, stop them all before a wall-time
limit (they save a checkpoint and exit), and compare the arms' seed groups. The same command resumes every run.

Runs (each its own process and run directory under ``out``):
- ``<arm>_s<seed>`` for every arm and seed: ``recipe`` with the arm's kernel overrides, ``seed=<seed>`` (initial
  weights and training-data order; the validation samples are the same for every seed: ``data.valid_seed``),
  W&B group = the arm;
- ``long_helion``: the helion backend, seed 1, ``train.train_iters=<long_iters>`` plus ``long_overrides``
  (W&B group ``long``);
- with ``resume_check=K``, a bitwise check of resuming at the long run's settings, with ``train.deterministic`` and
  ``kernels.deterministic`` on (bitwise-repeatable steps), no W&B: ``long_helion_rc``, stopped with SIGTERM at step
  K, started again at once by the same command (it resumes from its checkpoint) and stopped at step
  ``K + resume_window``; and ``long_helion_ref``, the same run unbroken to step ``K + resume_window`` (no
  checkpoint). ``resume_continuity`` compares the two step by step.
A run whose checkpoint tracker already reaches its ``train.train_iters`` is complete and not started again, a run
with stop steps once its log reaches the last of them. Each start appends ``{"segment", "from_step"}`` to
``out/logs/<run>.segments.jsonl``: the resume points of the curves.

Time: the invocation ends within ``minutes`` (plus ``grace_s`` for the last saves): the corpus build counts.
``save_margin_s`` before the deadline every trainer still running gets SIGTERM, as a cluster's preemption sends it
(the trainer finishes its step, saves, exits 0); a trainer still alive ``grace_s`` after the deadline gets SIGKILL
(that run then resumes from its previous checkpoint). Every process runs in its own session, so a signal reaches
only the processes this launcher started.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

ARMS = {
    "mamba_ssm": ["kernels.backend=mamba_ssm"],
    "helion": ["kernels.backend=helion"],
    # the helion backward with mamba-ssm's fp32 recomputed states and state gradients (states recomputed, as
    # mamba-ssm does: the forward's kept states are in x's dtype)
    "helion_fp32": ["kernels.backend=helion", "kernels.helion.save_conv_states=false",
                    "kernels.helion.bwd_states_dtype=fp32", "kernels.helion.bwd_dstates_dtype=fp32"],
    # the linears in float8 (train.fp8=tensorwise, the default train.fp8_modules), either backend
    "mamba_ssm_fp8": ["kernels.backend=mamba_ssm", "train.fp8=tensorwise"],
    "helion_fp8": ["kernels.backend=helion", "train.fp8=tensorwise"],
}
RECIPE = "convergence_seeds_h200"
# The long run: one micro-batch of the seed runs' shape per step (4,096 tokens; the same tuned kernel shape), the
# same validation tokens per evaluation (16 x 4 x 1024), every 1000 steps; a checkpoint every 5000 steps besides
# the one on exit (a save takes about 8 s), so a segment killed before it could save loses at most 5000 steps.
LONG_OVERRIDES = ("train.global_batch_size=4", "train.eval_interval=1000", "train.eval_iters=16",
                  "optim.lr=3.0e-4", "optim.min_lr=3.0e-6", "checkpoint.interval=5000")
# Files under the default roots that are not a package's own text (compiled caches, metadata, nested envs).
STUDY_EXCLUDE = ("*__pycache__/*", "*.dist-info/*", "*.egg-info/*", "site-packages/*", "dist-packages/*")


class StudyConfigError(ValueError):
    """Bad launcher arguments, found before any process starts."""


@dataclass
class RunSpec:
    name: str
    arm: str  # a key of ARMS, or "long"
    seed: int
    run_dir: Path
    overrides: list[str]
    train_iters: int
    stops: tuple[int, ...] = ()  # SIGTERM once the run has logged each step; after all but the last, start it again
    resume_after_stops: bool = False  # start it again after the last stop too (the stops are resumes, not its end)

    def command(self, python: str) -> list[str]:
        return [python, "-m", "nano_hybrid.train", *self.overrides]


@dataclass
class StudyPlan:
    out: Path
    corpus: Path
    corpus_roots: list[str]
    runs: list[RunSpec] = field(default_factory=list)

    def arms(self) -> dict[str, list[RunSpec]]:
        groups: dict[str, list[RunSpec]] = {}
        for r in self.runs:
            if r.arm not in ("long", "long_rc", "long_ref"):
                groups.setdefault(r.arm, []).append(r)
        return groups


def default_corpus_roots() -> list[str]:
    """This interpreter's standard library and installed packages, a checkout's ./site (wheels installed by
    scripts/gpu_setup.sh) and the system's dist-packages folders: the existing ones, each once."""
    paths = sysconfig.get_paths()
    cands = [paths["stdlib"], paths["purelib"], paths["platlib"], "site",
             f"/usr/local/lib/python{sys.version_info.major}.{sys.version_info.minor}/dist-packages",
             "/usr/lib/python3/dist-packages"]
    out, seen = [], set()
    for c in cands:
        if c and Path(c).is_dir():
            real = os.path.realpath(c)
            if real not in seen:
                seen.add(real)
                out.append(os.path.abspath(c))
    return out


def train_iters_of(overrides: list[str], recipe_iters: int) -> int:
    for ov in reversed(overrides):
        if ov.startswith("train.train_iters="):
            value = ov.split("=", 1)[1]
            try:
                iters = int(value)
            except ValueError:
                iters = 0
            if iters < 1:
                raise StudyConfigError(f"override train.train_iters={value}: give a whole number of steps >= 1")
            return iters
    return recipe_iters


def recipe_train_iters(recipe: str) -> int:
    from nano_hybrid.config import compose

    return int(compose([f"recipe={recipe}"]).train.train_iters)


def make_plan(*, out: str | Path, arms: list[str], seeds: list[int], corpus: str | Path,
              corpus_roots: list[str] | None, long_iters: int | None, extra: list[str], long_extra: list[str],
              wandb: str, recipe: str = RECIPE, recipe_iters: int | None = None, resume_check: int | None = None,
              resume_window: int = 400, long_stops: tuple[int, ...] = ()) -> StudyPlan:
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise StudyConfigError(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    if long_iters is not None and long_iters < 1:
        raise StudyConfigError(f"--long-iters must be >= 1, got {long_iters}")
    if not arms and long_iters is None:
        raise StudyConfigError("no arms and no long run: give at least two arms, or --long-iters for the long run alone")
    if arms and (len(set(arms)) != len(arms) or len(arms) < 2):
        raise StudyConfigError(f"give at least two different arms (or none: the long run alone), got {arms}")
    if arms and (len(seeds) < 2 or len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds)):
        raise StudyConfigError(f"give at least two different seeds >= 0, got {seeds}")
    if resume_check is not None and (long_iters is None or not 1 <= resume_check < long_iters or resume_window < 1):
        raise StudyConfigError(f"--resume-check {resume_check}: give a step between 1 and the long run's steps "
                               f"({long_iters}), with a long run")
    if wandb not in ("offline", "disabled"):
        raise StudyConfigError(f"--wandb {wandb!r}: offline or disabled (the GPU host has no network)")
    for ov in extra + long_extra:
        key = ov.split("=", 1)[0]
        if "=" not in ov or key in ("seed", "run_dir", "kernels.backend", "logger.wandb.group", "logger.wandb.name"):
            raise StudyConfigError(f"override {ov!r}: give KEY=VALUE; seed, run_dir, kernels.backend and the W&B "
                                   "group/name are set by the launcher")
    out, corpus = Path(out).absolute(), Path(corpus).absolute()
    iters = recipe_train_iters(recipe) if recipe_iters is None else recipe_iters
    plan = StudyPlan(out, corpus, list(corpus_roots) if corpus_roots else default_corpus_roots())

    def spec(name, arm, seed, arm_ovs, more, mode=wandb):
        run_dir = out / name
        ovs = [f"recipe={recipe}", *arm_ovs, f"seed={seed}", f"run_dir={run_dir}", f"data.corpus_dir={corpus}",
               f"data.cache_dir={run_dir / 'data_cache'}", f"logger.wandb.mode={mode}",
               f"logger.wandb.group={arm}", f"logger.wandb.name={name}", *extra, *more]
        return RunSpec(name, arm, seed, run_dir, ovs, train_iters_of(ovs, iters))

    for arm in arms:
        for seed in seeds:
            plan.runs.append(spec(f"{arm}_s{seed}", arm, seed, ARMS[arm], []))
    if long_iters is not None:
        long_ovs = [*LONG_OVERRIDES, f"train.train_iters={long_iters}", *long_extra]
        long = spec("long_helion", "long", 1, ARMS["helion"], long_ovs)
        if long_stops:
            ordered = list(long_stops) == sorted(set(long_stops))
            if not ordered or not 0 < long_stops[0] or long_stops[-1] >= long.train_iters:
                raise StudyConfigError(f"--long-stops {','.join(map(str, long_stops))}: give increasing steps between 1 "
                                       f"and the long run's steps ({long.train_iters}), each once")
            long.stops, long.resume_after_stops = tuple(long_stops), True  # the same command again after each
        plan.runs.append(long)
        if resume_check is not None:
            det = [*long_ovs, "train.deterministic=true", "kernels.deterministic=true"]
            rc = spec("long_helion_rc", "long_rc", 1, ARMS["helion"], det, mode="disabled")
            ref = spec("long_helion_ref", "long_ref", 1, ARMS["helion"], [*det, "checkpoint.save_on_exit=false"],
                       mode="disabled")
            rc.stops, ref.stops = (resume_check, resume_check + resume_window), (resume_check + resume_window,)
            plan.runs += [rc, ref]
    return plan


def checkpointed_step(run_dir: Path) -> int:
    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        return int(tracker.read_text().strip())
    except (OSError, ValueError):
        return 0


def last_logged_step(run_dir: Path) -> int:
    f = run_dir / "metrics.jsonl"
    try:
        with open(f, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 8192))
            lines = fh.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def corpus_command(plan: StudyPlan, python: str, workers: int, tokenizer: str) -> list[str]:
    cmd = [python, "scripts/prepare_corpus.py", "--output", str(plan.corpus), "--tokenizer", tokenizer,
           "--workers", str(workers), "--valid-fraction", "0.01", "--exclude", *STUDY_EXCLUDE]
    for r in plan.corpus_roots:
        cmd += ["--root", r]
    return cmd


def build_corpus_if_missing(plan: StudyPlan, workers: int, tokenizer: str, log) -> None:
    from nano_hybrid.data.corpus import CorpusSettings, build_corpus
    from nano_hybrid.data.tokenizer import spec_from_arg

    if (plan.corpus / "manifest.json").is_file():
        m = json.loads((plan.corpus / "manifest.json").read_text())
        log(f"corpus {plan.corpus}: {m['splits']['train']['tokens']:,} train / {m['splits']['valid']['tokens']:,} "
            f"valid tokens, content_sha256 {m['content_sha256'][:16]}")
        return
    settings = CorpusSettings(roots=tuple(plan.corpus_roots), exclude=STUDY_EXCLUDE, valid_fraction=0.01)
    log(f"building the corpus {plan.corpus} from {', '.join(plan.corpus_roots)} ({workers} workers)")
    m = build_corpus(settings, plan.corpus, spec_from_arg(tokenizer), workers=workers, log=log)
    log(f"corpus: {m['splits']['train']['tokens']:,} train / {m['splits']['valid']['tokens']:,} valid tokens "
        f"in {m['build']['seconds']} s, content_sha256 {m['content_sha256'][:16]}")


@dataclass
class Proc:
    spec: RunSpec
    popen: subprocess.Popen
    log: Path
    stops: list[int] = field(default_factory=list)  # SIGTERM once each step is logged (the spec's, still ahead)
    restart: bool = False  # start the same command again once it has exited after a stop


def _stop_or_restart(procs: list[Proc], start, log) -> None:
    """SIGTERM to each run that has logged its next stop step; start again each run stopped before its last one."""
    for i, p in enumerate(procs):
        if p.stops and not p.restart and p.popen.poll() is None and last_logged_step(p.spec.run_dir) >= p.stops[0]:
            os.killpg(p.popen.pid, signal.SIGTERM)
            log(f"{p.spec.name}: SIGTERM at its stop step {p.stops.pop(0)}")
            p.restart = bool(p.stops) or p.spec.resume_after_stops
        elif p.restart and p.popen.poll() is not None:
            p.restart = False
            if p.popen.returncode == 0:  # saved on SIGTERM: the same command resumes it
                try:
                    procs[i] = start(p.spec, checkpointed_step(p.spec.run_dir))
                except StudyConfigError as e:  # too close to the deadline: the next invocation resumes it
                    log(f"{p.spec.name}: not restarted ({e})")


def launch(plan: StudyPlan, *, minutes: float, python: str, grace_s: float = 90.0, save_margin_s: float = 45.0,
           start_time: float | None = None, log=print, poll_s: float = 5.0,
           min_run_minutes: float = 0.5) -> dict[str, int | None]:
    """Start every unfinished run, stop them all by the deadline; returns run name -> exit code (None: complete
    before this invocation)."""
    t0 = time.monotonic() if start_time is None else start_time
    deadline = t0 + 60.0 * minutes
    stop_at = deadline - save_margin_s  # SIGTERM to every trainer still running
    results: dict[str, int | None] = {}
    procs: list[Proc] = []
    (plan.out / "logs").mkdir(parents=True, exist_ok=True)

    def start(r: RunSpec, done: int) -> Proc:
        left_min = (deadline - time.monotonic() - save_margin_s) / 60.0
        if left_min <= min_run_minutes:
            raise StudyConfigError(f"only {left_min * 60:.0f} s left before the deadline: raise --minutes")
        segment = len(list((plan.out / "logs").glob(f"{r.name}.part*.log"))) + 1
        logf = plan.out / "logs" / f"{r.name}.part{segment}.log"
        cmd = r.command(python)
        with open(plan.out / "logs" / f"{r.name}.segments.jsonl", "a") as fh:
            fh.write(json.dumps({"segment": segment, "from_step": done}) + "\n")
        with open(logf, "w") as fh:
            fh.write(shlex.join(cmd) + "\n")
            fh.flush()
            p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        log(f"{r.name}: started (pid {p.pid}, from step {done}, log {logf})")
        return Proc(r, p, logf, stops=[k for k in r.stops if k > done])

    for r in plan.runs:
        done = checkpointed_step(r.run_dir)
        if done >= r.train_iters or (r.stops and not r.resume_after_stops
                                     and last_logged_step(r.run_dir) >= r.stops[-1]):
            log(f"{r.name}: complete ({max(done, last_logged_step(r.run_dir))} steps)")
            results[r.name] = None
            continue
        procs.append(start(r, done))
    last_report = time.monotonic()
    stage = "run"

    while any(p.popen.poll() is None or (p.restart and p.popen.poll() is not None) for p in procs):
        now = time.monotonic()
        if stage == "run":
            _stop_or_restart(procs, start, log)
        if stage == "run" and now >= stop_at:
            running = [p for p in procs if p.popen.poll() is None]
            for p in procs:
                p.restart = False
            for p in running:
                os.killpg(p.popen.pid, signal.SIGTERM)
            log(f"{save_margin_s:.0f} s before the deadline: SIGTERM to {len(running)} run(s) "
                f"({', '.join(f'{p.spec.name} at step {last_logged_step(p.spec.run_dir)}' for p in running)})")
            stage = "term"
        elif stage == "term" and now >= deadline + grace_s:
            for p in procs:
                if p.popen.poll() is None:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                    log(f"{p.spec.name}: SIGKILL after {grace_s:.0f} s of grace (it resumes from its previous checkpoint)")
            stage = "kill"
        if now - last_report >= 60.0:
            log("progress: " + ", ".join(f"{p.spec.name} {last_logged_step(p.spec.run_dir)}/{p.spec.train_iters}"
                                         for p in procs))
            last_report = now
        time.sleep(poll_s)
    for p in procs:
        results[p.spec.name] = p.popen.returncode
        tail = p.log.read_text(errors="replace").strip().splitlines()[-1:] if p.log.is_file() else []
        log(f"{p.spec.name}: exit {p.popen.returncode}, step {last_logged_step(p.spec.run_dir)}/"
            f"{p.spec.train_iters}, checkpoint at {checkpointed_step(p.spec.run_dir)}"
            + (f" | {tail[0][:160]}" if p.popen.returncode and tail else ""))
    return results


def _metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """A run's metrics.jsonl by step (the last record of a step wins; unreadable lines are skipped)."""
    by_step: dict[int, dict] = {}
    f = run_dir / "metrics.jsonl"
    if f.is_file():
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
                by_step[int(rec["step"])] = rec
            except (ValueError, KeyError, TypeError):
                continue
    return by_step


def resume_steps(run_dir: Path) -> list[int]:
    """The checkpoint steps that later segments of the run resumed from (``logs/<run>.segments.jsonl``)."""
    f = run_dir.parent / "logs" / f"{run_dir.name}.segments.jsonl"
    steps = []
    if f.is_file():
        for line in f.read_text().splitlines():
            try:
                s = int(json.loads(line)["from_step"])
            except (ValueError, KeyError, TypeError):
                continue
            if s > 0 and s not in steps:
                steps.append(s)
    return steps


def resume_continuity(run_dir: Path, reference_dir: Path, window: int = 400) -> dict:
    """The resumed run against the unbroken reference of the same configuration, step by step, around the first
    resume that the reference covers: the first step whose training loss differs (none: bitwise equal throughout),
    and the mean |relative loss difference| over the steps before the resume and over ``window`` steps after it.
    On a backend whose steps are bitwise repeatable an exact resume keeps the two equal after the resume; where
    runs of one configuration already drift apart (non-deterministic reductions), the difference after the resume
    is to be read against the difference of two unbroken runs over the same steps."""
    run, ref = _metrics_by_step(run_dir), _metrics_by_step(reference_dir)
    common = sorted(set(run) & set(ref))
    if not common:
        raise ValueError(f"{run_dir} and {reference_dir} share no logged step")
    covered = [k for k in resume_steps(run_dir) if k < common[-1]]
    if not covered:
        raise ValueError(f"no resume of {run_dir} inside the reference's steps 1..{common[-1]}")
    k = covered[0]
    first_diff = next((s for s in common if run[s]["loss"] != ref[s]["loss"]), None)

    def mean_abs_rel(lo: int, hi: int) -> float | None:
        xs = [abs(run[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in common if lo <= s <= hi]
        return float(sum(xs) / len(xs)) if xs else None

    after_hi = min(common[-1], k + window)
    return {"resume_step": k, "reference_last_step": common[-1], "first_differing_step": first_diff,
            "bitwise_equal_after_resume": all(run[s]["loss"] == ref[s]["loss"] and run[s].get("grad_norm") ==
                                              ref[s].get("grad_norm") for s in common if k < s <= after_hi),
            "before": {"steps": [1, k], "mean_abs_rel_loss_diff": mean_abs_rel(1, k)},
            "after": {"steps": [k + 1, after_hi], "mean_abs_rel_loss_diff": mean_abs_rel(k + 1, after_hi)}}


def plot_long_run(run_dir: Path, out_dir: Path, reference_dir: Path | None = None, smooth: int = 50,
                  name: str = "long_run.png") -> Path:
    """Training loss (trailing mean of ``smooth`` steps over the raw curve), validation loss and gradient norm of
    the long run, the resume steps as dashed lines; with a reference, its curve and the relative loss difference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from nano_hybrid.seedstudy import smooth_trailing

    def curves(d: Path):
        by = _metrics_by_step(d)
        st = np.array(sorted(by), dtype=np.int64)
        loss = np.array([float(by[s]["loss"]) for s in st])
        gn = np.array([float(by[s].get("grad_norm", np.nan)) for s in st])
        vs = np.array([s for s in st if "val_loss" in by[s]], dtype=np.int64)
        return st, loss, gn, vs, np.array([float(by[s]["val_loss"]) for s in vs])

    def trailing(x):
        return smooth_trailing(x, smooth)

    st, loss, gn, vs, vl = curves(run_dir)
    ref = curves(reference_dir) if reference_dir is not None else None
    has_val = len(vs) > 0 or (ref is not None and len(ref[3]) > 0)  # no empty panel before the first evaluation
    titles = ["training loss", *(["validation loss (held-out packages)"] if has_val else []),
              f"gradient norm (trailing mean of {smooth})",
              *(["training loss difference to the unbroken reference"] if ref is not None else [])]
    fig, axes = plt.subplots(len(titles), 1, figsize=(11, 2.6 * len(titles)), sharex=True, constrained_layout=True)
    ax_loss, ax_gn = axes[0], axes[2 if has_val else 1]
    ax_val = axes[1] if has_val else None
    ax_loss.plot(st, loss, lw=0.3, alpha=0.35, color="tab:blue")
    ax_loss.plot(st, trailing(loss), lw=1.2, color="tab:blue", label=f"{run_dir.name} (trailing mean of {smooth})")
    if ax_val is not None:
        ax_val.plot(vs, vl, "o-", ms=3, color="tab:blue", label=run_dir.name)
    ax_gn.plot(st, trailing(gn), lw=1.0, color="tab:blue", label=run_dir.name)
    if ref is not None:
        rs, rl, rg, rvs, rvl = ref
        ax_loss.plot(rs, trailing(rl), lw=1.0, color="tab:orange", label=f"{reference_dir.name} (unbroken)")
        if ax_val is not None:
            ax_val.plot(rvs, rvl, "s", ms=4, color="tab:orange", label=reference_dir.name)
        ax_gn.plot(rs, trailing(rg), lw=0.8, color="tab:orange", label=reference_dir.name)
        ref_loss = dict(zip(rs.tolist(), rl.tolist()))
        both = np.array([s for s in st if s in ref_loss], dtype=np.int64)
        own = dict(zip(st.tolist(), loss.tolist()))
        rel = np.array([100 * (own[s] - ref_loss[s]) / ref_loss[s] for s in both])
        axes[-1].plot(both, rel, lw=0.3, alpha=0.35, color="tab:green")
        axes[-1].plot(both, trailing(rel), lw=1.2, color="tab:green", label=f"trailing mean of {smooth}")
        axes[-1].axhline(0.0, color="k", lw=0.6)
        axes[-1].set_ylabel("(run - ref) / ref, %")
    for ax, title in zip(axes, titles):
        ax.set_title(title)
    for ax in axes:
        for k in resume_steps(run_dir):
            ax.axvline(k, color="k", lw=0.7, ls="--")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1].set_xlabel("step (dashed: resumed after SIGTERM)")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def long_run_summary(run_dir: Path) -> dict:
    """Steps, validation points, skipped and non-finite steps, gaps and resume steps of the long run's metrics.jsonl."""
    by_step = _metrics_by_step(run_dir)
    steps = sorted(by_step)
    bad = [s for s in steps if not all(math.isfinite(float(by_step[s].get(k, 0.0))) for k in ("loss", "grad_norm"))]
    gaps = [s for s in range(1, (steps[-1] if steps else 0) + 1) if s not in by_step]
    segments = len(list((run_dir.parent / "logs").glob(f"{run_dir.name}.part*.log")))
    return {"run": str(run_dir), "steps": len(steps), "last_step": steps[-1] if steps else 0,
            "val_points": sum("val_loss" in by_step[s] for s in steps),
            "skipped_steps": sum(int(by_step[s].get("skipped", 0)) for s in steps), "non_finite_steps": bad[:10],
            "missing_steps": gaps[:10], "segments": segments, "resumed_from": resume_steps(run_dir),
            "last_val_loss": next((by_step[s]["val_loss"] for s in reversed(steps) if "val_loss" in by_step[s]), None)}
