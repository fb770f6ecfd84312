"""Benchmark output: ``<stem>.json`` + ``<stem>.md`` under ``--out``, markdown tables, the benchmark
``main`` (``bench_main``) and the argument helper for Hydra overrides."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable, Sequence

from nano_hybrid.bench.environment import REPO_ROOT, gpu_slug
from nano_hybrid.errors import EXIT_BAD_INPUT


SCHEMA_VERSION = 1


def parse_args_with_overrides(parser, argv=None):
    """``parser``'s options, and every other argument as a Hydra override (``a.overrides``); an unknown
    ``-option`` is an error (a typo must not become an override). ``a.arms``: ``--backends`` split at commas."""
    a, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        parser.error(f"unknown option(s) {bad}; Hydra overrides look like key=value")
    a.overrides = overrides
    if isinstance(getattr(a, "backends", None), str):
        a.arms = [b.strip() for b in a.backends.split(",") if b.strip()]
    return a


def default_out_dir() -> Path:
    """$OUT if set, else runs/bench/<gpu> (h200 on an H200)."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return REPO_ROOT / "runs" / "bench" / gpu_slug(name)


def check_out_dir(out_dir: Path | str, what: str = "--out") -> Path:
    """``out_dir`` as a results folder, checked before any measuring: a ValueError (one line) when it is an
    existing file, lies under a file, or its nearest existing folder is not writable."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{what} {out} is an existing file, not a folder")
    above = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not above.is_dir():
        raise ValueError(f"{what} {out}: {above} is a file, not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {out}: {above} is not writable")
    return out


# the least number of bootstrap resamples stats.bootstrap_ratio_ci accepts
MIN_N_BOOT = 100


def check_args(a) -> None:
    """The checks of the arguments that the benchmark tools share (``--out``, ``$OUT``, ``--n-boot``), made
    before any measuring: a ValueError with one line. The default folder under the repository is not checked here
    (naming it asks the GPU for its name)."""
    if getattr(a, "out", None):
        check_out_dir(a.out)
    elif os.environ.get("OUT"):
        check_out_dir(os.environ["OUT"], "$OUT")
    n_boot = getattr(a, "n_boot", None)
    if n_boot is not None and n_boot < MIN_N_BOOT:
        raise ValueError(f"--n-boot must be >= {MIN_N_BOOT} for a meaningful interval, got {n_boot}")


def write_results(out_dir: Path | str, stem: str, data: dict, markdown: str) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"schema_version": SCHEMA_VERSION, **data}
    jp = out_dir / f"{stem}.json"
    mp = out_dir / f"{stem}.md"
    jp.write_text(json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")
    mp.write_text(markdown.rstrip() + "\n")
    return jp, mp


def bench_main(argv, parse_args: Callable, run: Callable, stem: Callable, markdown: Callable[[dict], str],
               exit_code: Callable[[dict], int] = lambda res: 0) -> int:
    """The benchmark scripts' ``main``: parse ``argv``, check the shared arguments (``check_args``), ``res =
    run(args)`` (a bad argument, config, data path or kernel backend is one line on stderr and exit code 2, before
    any measuring; ``None``, e.g. on a rank other than 0, writes nothing), then write ``<stem(res, args)>.json`` /
    ``.md`` under ``--out`` (default ``default_out_dir()``), print the markdown and return ``exit_code(res)``."""
    import sys
    import warnings

    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from kernels.registry import BackendUnavailableError, UnknownBackendError
    from nano_hybrid.config import ConfigError
    from nano_hybrid.data import DataConfigError

    a = parse_args(argv)
    try:
        check_args(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        res = run(a)
    except (ConfigError, DataConfigError, UnknownBackendError, BackendUnavailableError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if res is None:
        return 0
    out = Path(a.out) if a.out else default_out_dir()
    md = markdown(res)
    jp, mp = write_results(out, stem(res, a), res, md)
    print(md)
    print(f"\nwrote {jp} and {mp}")
    return exit_code(res)


def arms_stem(prefix: str, res: dict, tag: str | None, *parts: str) -> str:
    """``<prefix>_<model>_<arm>_vs_<arm>[_<parts>][_<N>gpu][_<tag>]``: the benchmark output file stem."""
    s = "_".join([prefix, str(res["config"]["model"]), "_vs_".join(res["arms"]).replace("#", ""), *parts])
    if res["world_size"] > 1:
        s += f"_{res['world_size']}gpu"
    return s + (f"_{tag}" if tag else "")


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON-serializable: {type(o).__name__}")


def md_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    def fmt(x):
        if isinstance(x, float):
            return f"{x:.3f}" if abs(x) < 100 else f"{x:.1f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def env_markdown(env: dict) -> str:
    keys = ["gpu", "sm_count", "torch", "cuda", "triton", "helion", "mamba_ssm", "causal_conv1d",
            "megatron_core", "git_commit", "date_utc"]
    parts = [f"{k} {env.get(k)}" for k in keys if env.get(k) is not None]
    if env.get("git_dirty"):
        tree = env.get("git_tree")
        parts.append("files differ from git_commit" + (f" (their git tree {tree})" if tree else ""))
    kd = env.get("kernels_dir")
    if kd and Path(kd).resolve() != (REPO_ROOT / "kernels").resolve():
        parts.append(f"kernels from {kd}")
    return ", ".join(parts)


def timing_cells(r: dict, arm: str) -> list[str]:
    """The timing cells of one arm of a per-shape result ``r`` (``times_ms``, ``device_us_per_call``,
    ``speedup_vs_mamba_ssm``): median ms, p10-p90, device us per call, speedup with its 95% interval."""
    t = r["times_ms"][arm]
    sp = r["speedup_vs_mamba_ssm"].get(arm)
    dev = r["device_us_per_call"].get(arm)
    return [f"{t['median']:.3f}", f"{t['p10']:.3f}-{t['p90']:.3f}", f"{dev:.1f}" if dev else "-",
            f"{sp['speedup']:.3f}x [{sp['ci_lo']:.3f}, {sp['ci_hi']:.3f}]" if sp else "1"]
