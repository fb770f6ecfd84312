"""Compare groups of runs per arm (seeds): seed bands and the final validation-loss difference with a 95% interval.

    python scripts/compare_seeds.py --arm mamba_ssm=runs/m1,runs/m2,runs/m3 --arm helion=runs/h1,runs/h2,runs/h3 \\
        --reference-diff 0.0052 --smooth 50 --out runs/seeds_compare

The first --arm is the baseline (or --baseline NAME). Writes OUT/report.json, OUT/report.md (tables: per arm the
mean, std, min, max of the final validation loss; per arm against the baseline the difference, relative
difference, 95% Welch t interval over seeds, the paired interval when both arms ran the same seeds, and whether
--reference-diff (relative) is inside the Welch interval) and OUT/seed_bands.png (training and validation loss
bands per arm, and the per-step difference of arm means with its 95% band). The method is in
nano_hybrid/seedstudy.py. Bad input (a missing run, a run listed twice in an arm, runs whose tokens per step
differ, < 2 runs in an arm, no common validation step, an --out that is a file) stops with one `error: ...` line
and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nano_hybrid.errors import EXIT_BAD_INPUT
from nano_hybrid.seedstudy import StudyError, compare_arms, format_markdown, load_run, plot_study


def parse_arm(text: str) -> tuple[str, list[str]]:
    name, sep, runs = text.partition("=")
    paths = [p for p in runs.split(",") if p]
    if not sep or not name or not paths:
        raise StudyError(f"--arm {text!r}: expected NAME=RUN_DIR[,RUN_DIR...]")
    return name, paths


def run_dir_of(path: str) -> Path:
    """The resolved run directory of a RUN_DIR argument (a run folder or its metrics.jsonl, as load_run reads it)."""
    p = Path(path)
    return (p if p.is_dir() else p.parent).resolve()


def check_out(out: Path) -> None:
    """Refuse an --out that is an existing file or lies under one (the report folder is created there)."""
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                raise StudyError(f"--out {out}: {p} is an existing file, not a folder")
            return


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=RUN[,RUN...]", help="one arm's runs (repeat)")
    ap.add_argument("--baseline", default=None, help="the arm the others are compared with (default: the first)")
    ap.add_argument("--reference-diff", type=float, default=None,
                    help="a relative difference (e.g. 0.0052) to test against the interval")
    ap.add_argument("--smooth", type=int, default=50, help="trailing-mean window of the training loss (logged steps)")
    ap.add_argument("--out", type=Path, default=Path("seeds_compare"), help="folder for report.json/.md and the plot")
    ap.add_argument("--no-plots", action="store_true", help="tables only (e.g. on a host without matplotlib)")
    args = ap.parse_args(argv)
    try:
        if args.smooth < 1:
            raise StudyError(f"--smooth must be >= 1, got {args.smooth}")
        check_out(args.out)
        arms: dict = {}
        for text in args.arm:
            name, paths = parse_arm(text)
            if name in arms:
                raise StudyError(f"arm {name} given twice")
            seen: dict[Path, str] = {}
            for p in paths:
                d = run_dir_of(p)
                if d in seen:
                    raise StudyError(f"arm {name} lists the run {d} twice ({seen[d]} and {p}); each run is one seed")
                seen[d] = p
            arms[name] = [load_run(p) for p in paths]
        if len(arms) < 2:
            raise StudyError("give at least two --arm groups")
        result = compare_arms(arms, args.baseline or next(iter(arms)), smooth=args.smooth,
                              reference_rel=args.reference_diff)
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    args.out.mkdir(parents=True, exist_ok=True)
    md = format_markdown(result)
    if not args.no_plots:
        result["plot"] = str(plot_study(result, args.out))
        md += f"\n![seed bands]({Path(result['plot']).name})\n"
    (args.out / "report.md").write_text(md)
    (args.out / "report.json").write_text(json.dumps(result, indent=1) + "\n")
    print(md)
    print(f"report: {args.out / 'report.md'}, {args.out / 'report.json'}")
    return 0
