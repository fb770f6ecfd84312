"""torchrun for nano-hybrid training, with one line per error.

    python -m nano_hybrid.launch --standalone --nproc-per-node 8 model=nano30b parallel=ep2 kernels.backend=helion
    python -m nano_hybrid.launch --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -- \\
        model=nano30b ...

Takes torchrun's options (``python -m torch.distributed.run --help``), then the training overrides (the first
argument with ``=`` that is not an option, or everything after ``--``). Before any worker starts it composes and
validates the config for the job's world size, so bad input is one ``error: ...`` line and exit code 2 with no
process group, no worker and nothing written. Then it runs torchrun in this process with ``-m nano_hybrid.train``;
when a worker fails, the worker's own one-line error is the report (no torchrun failure summary and traceback),
and the exit code is the failed worker's. A worker that dies without such a line (a crash, a signal) gets one
``error:`` line naming its rank, exit code or signal. A stop signal to the launcher (SIGTERM from a scheduler,
Ctrl-C) reaches the workers, which save and stop; the launcher then exits 0, or 1 with one line when torchrun had
to kill workers that did not stop within its grace period.
"""

from __future__ import annotations

import logging
import os
import sys

from nano_hybrid.errors import EXIT_BAD_INPUT, EXIT_FAILED, ConfigError, filter_startup_warnings, report_error

filter_startup_warnings()


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun options, training overrides)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    for i, a in enumerate(argv):
        if not a.startswith("-") and "=" in a and not (i and argv[i - 1] in ("--rdzv-conf", "--rdzv_conf")):
            return argv[:i], argv[i:]
    return argv, []


NPROC_WORDS = ("auto", "cpu", "gpu")  # torchrun's --nproc-per-node words


def _world_size(args) -> int | None:
    """Workers in the job when torchrun's options fix it (``--nnodes N`` or ``N:N``, ``--nproc-per-node N``)."""
    nnodes = str(args.nnodes)
    lo, _, hi = nnodes.partition(":")
    if hi and hi != lo:
        return None  # elastic: the size is known only at rendezvous
    try:
        nodes = int(lo)
    except ValueError:
        nodes = 0
    if nodes < 1:
        raise ConfigError(f"--nnodes={args.nnodes!r}: a positive number of nodes (or MIN:MAX)")
    value = str(args.nproc_per_node)
    bad = ConfigError(f"--nproc-per-node={value!r}: a positive number of workers, or one of {', '.join(NPROC_WORDS)}")
    try:
        nproc = int(value)
    except ValueError:  # "gpu", "cpu", "auto": counted on the node, as torchrun counts them
        if value not in NPROC_WORDS:
            raise bad from None
        import torch

        gpus = value == "gpu" or (value == "auto" and torch.cuda.is_available())
        nproc = torch.cuda.device_count() if gpus else os.cpu_count()
    if nproc < 1:
        raise bad
    return nodes * nproc


def validate_for(overrides: list[str], world_size: int | None) -> None:
    """The checks ``nano_hybrid.train`` runs on each rank, here once, for a job of ``world_size`` workers."""
    from nano_hybrid.config import compose, overrides_from_argv
    from nano_hybrid.layout import LaunchEnv
    from nano_hybrid.runconfig import validate

    validate(compose(overrides_from_argv(overrides)), LaunchEnv.planned(world_size or 1))


class _DropWorkerFailureLog(logging.Filter):
    """torchrun's agent logs each failed worker, the stop signal it got and the signal it sends the workers, as it
    stops a job; the launcher reports the failure itself, the workers say that they stop. It also notes whether
    the agent had to kill a worker that did not stop in time (``forced``)."""

    def __init__(self):
        super().__init__()
        self.forced = False

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if "Unable to shutdown process" in msg:
            self.forced = True
            return False
        return not any(s in msg for s in ("failed (exitcode", "closing signal", "death signal"))


def _failure_line(err) -> tuple[str | None, int]:
    """(the line to print, or None when a worker printed it; the exit code) for a ChildFailedError."""
    rank, failure = err.get_first_failure()
    code = failure.exitcode if isinstance(failure.exitcode, int) and failure.exitcode > 0 else 1
    ours = {}  # rank -> the error file nano_hybrid.errors.report_error left
    for r, f in err.failures.items():
        if isinstance(f.message, dict) and str(f.message.get("message", "")).startswith("error: "):
            ours[r] = f.message
    if ours:
        if any(m.get("extraInfo", {}).get("printed") for m in ours.values()):
            return None, code
        return ours[min(ours)]["message"].removeprefix("error: "), code
    sig = failure.signal_name()
    how = f"was killed by {sig}" if sig and sig != "<N/A>" else f"exited with code {failure.exitcode}"
    return f"rank {rank} (local rank {failure.local_rank}) {how}; its output is above", code


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from kernels.registry import BackendUnavailableError, UnknownBackendError
    from nano_hybrid.data import DataConfigError

    argv = sys.argv[1:] if argv is None else argv
    opts, overrides = split_argv(argv)
    parser = get_args_parser()
    try:
        args = parser.parse_args([*opts, "-m", "nano_hybrid.train", *overrides])
    except SystemExit as e:  # argparse printed its usage and message
        return EXIT_BAD_INPUT if e.code else 0
    try:
        validate_for(overrides, _world_size(args))  # torchrun's sizes first, then the run's config
    except (ConfigError, DataConfigError, UnknownBackendError, BackendUnavailableError) as e:
        report_error(str(e), rank=0)
        return EXIT_BAD_INPUT
    quiet = _DropWorkerFailureLog()
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(quiet)
    try:
        run(args)
    except ChildFailedError as err:
        line, code = _failure_line(err)
        if line is not None:
            report_error(line, rank=0)
        return code
    except SignalException as e:  # SIGTERM / SIGINT / SIGHUP to the launcher: torchrun passed it on to the workers,
        # which save and stop (nano_hybrid.signals), and waited for them
        if quiet.forced:
            report_error(f"the launcher got {_signal_name(e.sigval)} and the workers did not stop within "
                         f"{STOP_GRACE_S} s, so torchrun killed them; the last complete checkpoint stays the one that "
                         "loads", rank=0)
            return EXIT_FAILED
        return 0
    return 0


# torchrun's agent gives the workers this long to stop after passing a stop signal on, then kills them
STOP_GRACE_S = 30


def _signal_name(sig) -> str:
    import signal

    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


if __name__ == "__main__":
    sys.exit(main())
