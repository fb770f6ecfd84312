"""The seed study on one GPU: corpus (built if missing), >= 2 seeds per arm and one long helion run side by side,
stopped before --minutes, resumed by the same command, then the grouped comparison (nano_hybrid/convergence_study.py).

    python scripts/convergence_study.py --out runs/convergence_seeds --minutes 8          # repeat until complete
    python scripts/convergence_study.py --dry-run                                         # print the commands
    python scripts/convergence_study.py --arms mamba_ssm,helion,helion_fp32 --seeds 1,2,3 train.train_iters=1500

Runs: OUT/<arm>_s<seed> (recipe convergence_seeds_h200, seed = initial weights and data order) and OUT/long_helion
(--long-iters steps; 0: none). Trailing KEY=VALUE arguments are Hydra overrides for every run (--long-override for
the long run only). After the runs stop: OUT/compare/report.{md,json} and seed_bands.png (scripts/compare_seeds.py's
method, at the last validation step all seed runs reached), with the long run's summary in report.json, and
long_run.png (its training loss, validation loss and gradient norm, resume steps marked). --resume-check K adds a
bitwise check of resuming at the long run's settings with deterministic steps: OUT/long_helion_rc stopped at step K
and resumed at once, beside OUT/long_helion_ref unbroken, both to step K + 400; the summary compares them step by
step (resume_check: first differing step, loss differences before/after the resume) and resume_check.png draws it.
--long-stops K1[,K2] stops the long run with SIGTERM once it has logged each step and starts the same command again
at once: resumes inside one invocation, besides the one that follows each invocation's deadline.
Exit code: 0 when every started run exited 0, 1 when one failed, 2 on bad arguments (one `error: ...` line).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from nano_hybrid.convergence_study import ARMS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides (KEY=VALUE) for every run")
    ap.add_argument("--out", default="runs/convergence_seeds", help="folder of the run directories and the report")
    ap.add_argument("--minutes", type=float, default=8.0, help="wall time of this invocation, corpus build included")
    ap.add_argument("--arms", default="mamba_ssm,helion",
                    help=f"comma-separated, first = baseline ({', '.join(ARMS)}); none: the long run alone")
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated seeds, the same for every arm")
    ap.add_argument("--long-iters", type=int, default=20000, help="steps of the long helion run (0: no long run)")
    ap.add_argument("--long-override", action="append", default=[], help="an override for the long run only")
    ap.add_argument("--long-stops", default="", metavar="STEP[,STEP]",
                    help="SIGTERM the long run once it has logged each step and start the same command at once "
                         "(resumes inside one invocation, besides the one after each invocation's deadline)")
    ap.add_argument("--resume-check", type=int, default=0, metavar="K",
                    help="a resume check beside the long run: its settings with deterministic steps, stopped at step "
                         "K and resumed, against the same run unbroken, both to step K + 400 (0: none)")
    ap.add_argument("--corpus", default="data/corpus/site", help="the corpus folder (built when missing)")
    ap.add_argument("--corpus-root", action="append", default=[],
                    help="source folder of a missing corpus (repeat; default: this Python's stdlib and packages, ./site)")
    ap.add_argument("--corpus-workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    ap.add_argument("--tokenizer", default="tekken131k", help="the corpus tokenizer (as prepare_corpus.py)")
    ap.add_argument("--wandb", default="offline", help="offline | disabled")
    ap.add_argument("--reference-diff", type=float, default=0.0052, help="relative difference tested against the interval")
    ap.add_argument("--grace", type=float, default=90.0, help="seconds between SIGTERM and SIGKILL at the deadline")
    ap.add_argument("--save-margin", type=float, default=45.0,
                    help="seconds before the deadline at which each trainer gets SIGTERM (it finishes its step and saves)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, start nothing")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    from nano_hybrid.convergence_study import (
        StudyConfigError,
        build_corpus_if_missing,
        corpus_command,
        launch,
        make_plan,
    )
    from nano_hybrid.data.corpus import CorpusError
    from nano_hybrid.data.tokenizer import TokenizerError, spec_from_arg

    args = parse_args(argv)
    args.out, args.corpus = os.path.abspath(args.out), os.path.abspath(args.corpus)
    args.corpus_root = [os.path.abspath(r) for r in args.corpus_root]
    os.chdir(REPO)  # recipes' relative paths (data/tokenizers/...) and scripts/ resolve from the checkout
    try:
        if not 1.0 <= args.minutes <= 600.0:
            raise StudyConfigError(f"--minutes {args.minutes}: give 1 to 600")
        if not 0.0 <= args.save_margin < 60.0 * args.minutes:
            raise StudyConfigError(f"--save-margin {args.save_margin}: give 0 to the --minutes in seconds")
        try:
            seeds = [int(s) for s in args.seeds.split(",") if s]
        except ValueError:
            raise StudyConfigError(f"--seeds {args.seeds!r}: comma-separated integers") from None
        try:
            long_stops = tuple(int(x) for x in args.long_stops.split(",") if x)
        except ValueError:
            raise StudyConfigError(f"--long-stops {args.long_stops!r}: comma-separated steps") from None
        plan = make_plan(out=args.out, arms=[a for a in args.arms.split(",") if a and args.arms != "none"], seeds=seeds, corpus=args.corpus,
                         corpus_roots=args.corpus_root or None,
                         long_iters=args.long_iters or None, extra=list(args.overrides),
                         long_extra=list(args.long_override), wandb=args.wandb,
                         resume_check=args.resume_check or None, long_stops=long_stops)
        for r in args.corpus_root:
            if not Path(r).is_dir():
                raise StudyConfigError(f"--corpus-root {r}: not a folder")
        corpus_missing = not (plan.corpus / "manifest.json").is_file()
        if corpus_missing and not plan.corpus_roots:
            raise StudyConfigError("the corpus is missing and no source folder exists (give --corpus-root)")
        spec_from_arg(args.tokenizer).check_files()
        from nano_hybrid.config import ConfigError, compose

        try:
            for r in plan.runs:
                compose(r.overrides)  # every override names a real key
        except ConfigError as e:
            raise StudyConfigError(str(e)) from None
        if args.dry_run:
            if corpus_missing:
                print(shlex.join(corpus_command(plan, "python3", args.corpus_workers, args.tokenizer)))
            for r in plan.runs:
                print(shlex.join(r.command("python3")))
            return 0
        if args.wandb == "offline" and importlib.util.find_spec("wandb") is None:
            raise StudyConfigError("--wandb offline needs the wandb package (the GPU host: install "
                                   "shared/wheelhouse/gpu-wandb-cp312 into ./site), or pass --wandb disabled")
        import torch

        if not torch.cuda.is_available():
            raise StudyConfigError("the study trains on a CUDA GPU and torch sees none (try --dry-run)")
    except (StudyConfigError, CorpusError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def say(msg: str) -> None:
        print(f"[study {time.monotonic() - t0:6.0f}s] {msg}", flush=True)

    try:
        build_corpus_if_missing(plan, args.corpus_workers, args.tokenizer, say)
        results = launch(plan, minutes=args.minutes, python=sys.executable, grace_s=args.grace,
                         save_margin_s=args.save_margin, start_time=t0, log=say)
    except (StudyConfigError, CorpusError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    compare(plan, args.reference_diff, say)
    failed = [n for n, rc in results.items() if rc not in (0, None)]
    if failed:
        say(f"failed: {', '.join(failed)} (logs in {plan.out / 'logs'})")
    return 1 if failed else 0


def compare(plan, reference: float, say) -> None:
    from nano_hybrid.convergence_study import long_run_summary, plot_long_run, resume_continuity
    from nano_hybrid.seedstudy import StudyError, compare_arms, format_markdown, load_run, plot_study

    out = plan.out / "compare"
    out.mkdir(parents=True, exist_ok=True)
    long = [r for r in plan.runs if r.arm == "long"]
    summary = {"long_run": long_run_summary(long[0].run_dir)} if long else {}
    plots = importlib.util.find_spec("matplotlib") is not None
    if not plots:
        say("matplotlib is not installed: reports without plots (scripts/compare_seeds.py draws them elsewhere)")
    if long and (long[0].run_dir / "metrics.jsonl").is_file() and plots:
        say(f"long run plot: {plot_long_run(long[0].run_dir, out)}")
    pair = [r.run_dir for r in plan.runs if r.arm in ("long_rc", "long_ref") and (r.run_dir / "metrics.jsonl").is_file()]
    if len(pair) == 2:
        try:
            summary["resume_check"] = resume_continuity(pair[0], pair[1])
            if plots:
                say(f"resume check plot: {plot_long_run(pair[0], out, pair[1], name='resume_check.png')}")
        except ValueError as e:
            say(f"resume check: not yet possible ({e})")
    if not plan.arms():  # the long run alone: its summary is the report
        (out / "long_run.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(json.dumps(summary), flush=True)
        say(f"long run: {out / 'long_run.json'}")
        return
    try:
        arms = {a: [load_run(r.run_dir) for r in runs] for a, runs in plan.arms().items()}
        result = compare_arms(arms, next(iter(arms)), smooth=50, reference_rel=reference)
    except StudyError as e:
        say(f"comparison: not yet possible ({e})")
        (out / "long_run.json").write_text(json.dumps(summary, indent=1) + "\n")
        return
    result.update(summary)
    md = format_markdown(result)
    if plots:
        md += f"\n![seed bands]({plot_study(result, out).name})\n"
    (out / "report.md").write_text(md)
    (out / "report.json").write_text(json.dumps(result, indent=1) + "\n")
    print(md, flush=True)
    if summary:
        print(json.dumps(summary["long_run"]), flush=True)
    say(f"report: {out / 'report.md'}")
