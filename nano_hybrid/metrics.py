"""Per-step metrics: one console line and one ``metrics.jsonl`` record per step, optional W&B.

Only rank 0 writes (files, console, W&B). Record fields (all floats full precision):

    step, tokens (tokens seen after this step), consumed_samples, loss, lr, grad_norm, step_time_s,
    tokens_per_step, tokens_per_s (global), tokens_per_s_per_gpu, tflops_per_gpu, mem_gb (peak
    allocated on this rank's accelerator since the previous step; CPU: process max RSS), world_size,
    backend, skipped (1 if the update was skipped: non-finite loss or gradient norm), plus megatron's MoE auxiliary losses (e.g.
    ``seq_load_balancing_loss``, mean per MoE layer) when the model has MoE layers.

W&B (``logger.wandb.mode`` online|offline, default disabled): keys ``train/<field>``, x-axis
``train/tokens`` (``define_metric``; validation fields ``val_loss``, ``val_ppl``, ``val_tokens``,
``eval_time_s`` as ``val/...`` on the same axis), default tags kernel backend, GPU name, git commit. The run id is
exposed as ``MetricsLogger.wandb_run_id`` so a checkpoint can store it and a resume can pass it back
(``logger.wandb.id``; ``resume="allow"`` continues the same run).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

from nano_hybrid.schema import WandbSchema, defaults

WANDB_MODES = ("disabled", "online", "offline")


def git_commit(repo: Path | None = None) -> str:
    repo = repo or Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def peak_memory_gb() -> float:
    """Peak accelerator memory allocated since the last call (resets the peak); CPU: max RSS of the process."""
    import torch

    if torch.cuda.is_available():
        gb = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        return gb
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def truncate_records(path: str | Path, step: int) -> int:
    """Drop the records after ``step`` (and any partial line a crash left) from a ``metrics.jsonl``; keep the rest.

    A resumed run continues at the checkpoint's step; the records a crashed segment wrote after that
    step are re-run, so they leave the file first and every step appears once. The file is replaced
    atomically. Returns the number of lines dropped.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
            ok = isinstance(rec, dict) and int(rec["step"]) <= step
        except (ValueError, KeyError, TypeError):
            ok = False
        if ok:
            keep.append(line)
        elif line.strip():
            dropped += 1
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            f.write("".join(x + "\n" for x in keep))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


def wandb_key(field: str) -> str:
    """W&B key of a record field: ``val/loss``, ``val/ppl``, ... for the validation fields, else ``train/<field>``."""
    return f"val/{field[4:]}" if field.startswith("val_") else ("val/eval_time_s" if field == "eval_time_s" else f"train/{field}")


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def format_console_line(rec: dict[str, Any], train_iters: int, eta_s: float) -> str:
    width = len(str(train_iters))
    parts = [
        f"step {rec['step']:>{width}}/{train_iters}",
        f"loss {rec['loss']:.4f}",
        f"lr {rec['lr']:.3e}",
        f"grad_norm {rec['grad_norm']:.3f}",
        f"{rec['step_time_s'] * 1000:.0f} ms",
        f"{rec.get('tokens_per_s_per_gpu', rec['tokens_per_s']):,.0f} tok/s/gpu",
        f"{rec['tflops_per_gpu']:.2f} TFLOP/s/gpu",
        f"mem {rec['mem_gb']:.2f} GB",
        f"eta {_fmt_duration(eta_s)}",
    ]
    aux = [k for k in rec if k.endswith("_loss") and k != "val_loss" and isinstance(rec[k], float)]  # MoE aux losses
    parts[4:4] = [f"{k} {rec[k]:.4f}" for k in aux]
    if rec.get("skipped"):
        parts.insert(1, "SKIPPED (non-finite loss or grad norm: no update)")
    if "val_loss" in rec:  # a validation step (train.eval_interval)
        parts[2:2] = [f"val_loss {rec['val_loss']:.4f}", f"val_ppl {rec['val_ppl']:.2f}"]
    return " | ".join(parts)


class MetricsLogger:
    """Writes ``<run_dir>/metrics.jsonl`` and the console line on rank 0; owns the W&B run."""

    # Steps left out of the ETA's step-time estimate (start-up, compile, autotune-free warm-up).
    ETA_WARMUP_STEPS = 2

    def __init__(
        self,
        run_dir: str | Path,
        *,
        rank: int,
        train_iters: int,
        backend: str,
        wandb_cfg: Any = None,
        run_config: dict | None = None,
        print_fn=print,
        start_step: int | None = None,
    ) -> None:
        self.rank = rank
        self.train_iters = train_iters
        self.backend = backend
        self.print_fn = print_fn
        self.run_dir = Path(run_dir)
        self._step_times: list[float] = []
        self._file = None
        self._wandb_run = None
        if rank != 0:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Appending keeps the records of a resumed run's earlier segment; records after the step the run
        # continues from (``start_step``: a crashed segment's re-run steps) are dropped first.
        if start_step is not None:
            dropped = truncate_records(self.run_dir / "metrics.jsonl", start_step)
            if dropped:
                print_fn(f"metrics.jsonl: dropped {dropped} record(s) after step {start_step} "
                         "(they are re-run from the checkpoint)", flush=True)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        default_mode = defaults(WandbSchema)["mode"]
        mode = default_mode if wandb_cfg is None else str(wandb_cfg.get("mode", default_mode))
        if mode not in WANDB_MODES:
            raise ValueError(f"logger.wandb.mode must be one of {WANDB_MODES}, got {mode!r}")
        if mode != "disabled":
            self._wandb_run = self._init_wandb(wandb_cfg, mode, run_config or {})

    def _init_wandb(self, wcfg, mode: str, run_config: dict):
        import wandb

        tags = [f"backend:{self.backend}", f"gpu:{device_name()}", f"commit:{git_commit()}"]
        tags += [str(t) for t in (wcfg.get("tags") or [])]
        run = wandb.init(
            project=wcfg.get("project"),
            group=wcfg.get("group"),
            name=wcfg.get("name"),
            id=wcfg.get("id"),
            resume="allow",
            mode=mode,
            tags=tags,
            dir=str(self.run_dir),
            config=run_config,
        )
        run.define_metric("train/tokens")
        run.define_metric("train/*", step_metric="train/tokens")
        run.define_metric("val/*", step_metric="train/tokens")
        return run

    @property
    def wandb_run_id(self) -> str | None:
        return None if self._wandb_run is None else self._wandb_run.id

    def eta_seconds(self, step: int) -> float:
        times = self._step_times[self.ETA_WARMUP_STEPS :] or self._step_times
        if not times:
            return float("nan")
        recent = times[-50:]
        return (self.train_iters - step) * sum(recent) / len(recent)

    def log_step(self, rec: dict[str, Any], *, console: bool = True) -> None:
        """Record one step (called on every rank; only rank 0 writes)."""
        self._step_times.append(float(rec["step_time_s"]))
        if self.rank != 0:
            return
        rec = {"backend": self.backend, **rec}
        self._file.write(json.dumps(rec) + "\n")
        if console:
            self.print_fn(format_console_line(rec, self.train_iters, self.eta_seconds(rec["step"])), flush=True)
        if self._wandb_run is not None:
            self._wandb_run.log({wandb_key(k): v for k, v in rec.items() if isinstance(v, (int, float))})

    def print(self, msg: str) -> None:
        if self.rank == 0:
            self.print_fn(msg, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
