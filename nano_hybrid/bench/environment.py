"""The environment record of a benchmark result: package versions, GPU, host, git commit."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import subprocess
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[2]


def _pkg_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def gpu_slug(name: str | None) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100', None -> 'cpu'."""
    if not name:
        return "cpu"
    n = name.lower().replace("nvidia", "").strip()
    m = re.search(r"\b([a-z]+\d+[a-z]*)\b", n)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", n).strip("-") or "gpu"


def env_info() -> dict:
    import torch

    info = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _pkg_version("triton"),
        "helion": _pkg_version("helion"),
        "mamba_ssm": _pkg_version("mamba-ssm") or _pkg_version("mamba_ssm"),
        "causal_conv1d": _pkg_version("causal-conv1d") or _pkg_version("causal_conv1d"),
        "megatron_core": _pkg_version("megatron-core") or _pkg_version("megatron_core"),
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
        "git_tree": git_tree(),
        "kernels_dir": _kernels_dir(),
        "gpu": None,
        "gpu_count": 0,
        "sm_count": None,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_count=torch.cuda.device_count(), sm_count=p.multi_processor_count,
                    gpu_mem_gib=round(p.total_memory / 2**30, 1), capability=f"sm_{p.major}{p.minor}",
                    # the caching allocator's settings (e.g. expandable_segments): they move reserved memory and peaks
                    pytorch_cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    return info


def tree_env(*path_first: Path | str) -> dict:
    """The environment of a process that runs another tree's kernels: ``path_first`` ahead of the caller's
    PYTHONPATH, and no ``NANO_HELION_*`` / ``NANO_TUNE_*`` variable (each tree runs its own defaults)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NANO_HELION_", "NANO_TUNE_"))}
    rest = [q for q in os.environ.get("PYTHONPATH", "").split(os.pathsep) if q]
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in path_first] + rest)
    return env


def _git_dirty() -> bool | None:
    """True when files that git does not ignore differ from the commit ``git_commit`` names (the results are of
    another tree). ``--no-optional-locks``: many bench processes may ask at once."""
    try:
        r = subprocess.run(["git", "--no-optional-locks", "-C", str(REPO_ROOT), "status", "--porcelain"],
                           capture_output=True, text=True, timeout=30)
        return bool(r.stdout.strip()) if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def git_tree(root: Path | str = REPO_ROOT) -> str | None:
    """The git tree id (short) of the files of the checkout holding ``root`` that git does not ignore, as they are on
    disk: equal to ``git rev-parse <commit>^{tree}`` for the commit that holds exactly these files, whatever commit
    the checkout's git metadata names. Built in a temporary index (the checkout's index and HEAD stay as they are;
    the files' blobs go into the object store)."""
    import shutil
    import tempfile

    root = Path(root)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            index = Path(tmp) / "index"
            env = dict(os.environ, GIT_INDEX_FILE=str(index))
            git_dir = subprocess.run(["git", "-C", str(root), "rev-parse", "--absolute-git-dir"],
                                     capture_output=True, text=True, errors="replace", timeout=10)
            if git_dir.returncode != 0:
                return None
            own = Path(git_dir.stdout.strip()) / "index"
            if own.is_file():
                shutil.copyfile(own, index)  # its stat cache spares hashing unchanged files
            for cmd in (["add", "-A"], ["write-tree"]):
                r = subprocess.run(["git", "--no-optional-locks", "-C", str(root), *cmd], env=env,
                                   capture_output=True, text=True, errors="replace", timeout=60)
                if r.returncode != 0:
                    return None
            return r.stdout.strip()[:10] or None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def _kernels_dir() -> str | None:
    """The folder of the ``kernels`` package this process imports (another tree's, when one comes first on the path)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("kernels")
    except (ImportError, ValueError):
        return None
    return str(Path(spec.origin).parent) if spec is not None and spec.origin else None


def _git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
