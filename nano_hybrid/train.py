"""Pretrain the Nemotron-3 Nano hybrid (or a slice / tiny variant) with megatron-core.

    python -m nano_hybrid.train                                   # model=tiny on CPU, stdlib corpus
    python -m nano_hybrid.train recipe=tiny_cpu train.train_iters=50
    torchrun --nproc-per-node 2 -m nano_hybrid.train parallel=dp2 kernels.backend=mamba_ssm

Flow: compose the config -> validate everything (``nano_hybrid.runconfig``: config values, data, kernel
backend, parallel sizes) -> ``nano_hybrid.trainer.Trainer.build`` (process groups, model, Megatron DDP and
optimizer, LR schedule, data, checkpoint load) -> ``Trainer.fit`` (step, log, checkpoint save) -> shutdown.
Any bad input stops before work with one ``error: ...`` line and exit code 2.
"""

from __future__ import annotations

import sys
import time

from nano_hybrid.errors import EXIT_BAD_INPUT, RunError, filter_startup_warnings, report_error


def _launch_rank() -> int:
    """This process's rank from the launcher (0 when RANK is unset, or is itself the error being reported)."""
    from nano_hybrid.layout import LaunchEnv

    try:
        return LaunchEnv.read().rank
    except ValueError:
        return 0


def main(argv: list[str] | None = None) -> int:
    # imported here, not at module level: the checkpoint writer's spawned helper re-imports this module as its
    # __main__, and must not pay for megatron, the kernels and the trainer again
    filter_startup_warnings()  # known harmless megatron-core start-up warnings (no TE/Apex): nano_hybrid/errors.py
    from kernels.registry import BackendUnavailableError, UnknownBackendError
    from nano_hybrid.config import ConfigError, compose, help_requested, overrides_from_argv
    from nano_hybrid.data import DataConfigError, DataPreparationError
    from nano_hybrid.runconfig import validate
    from nano_hybrid.signals import ExitRequest
    from nano_hybrid.trainer import Trainer, release_refused_start, release_run_dir, shutdown

    t_start = time.monotonic()  # train.exit_after_minutes counts from here (start-up included)
    argv = sys.argv[1:] if argv is None else argv
    if help_requested(argv, __doc__):
        return 0
    try:
        cfg = compose(overrides_from_argv(argv))
        plan = validate(cfg)
    except (ConfigError, DataConfigError, UnknownBackendError, BackendUnavailableError) as e:
        # every rank validates the same config and finds the same error: rank 0 prints it, once per job; the
        # others give it a moment to, as torchrun stops the job at the first rank that exits
        if not report_error(str(e), rank=_launch_rank(), collective=True):
            time.sleep(5.0)
        return EXIT_BAD_INPUT
    trainer = None
    started = False  # a start refused before the first step leaves the run directory as it was
    try:
        trainer = Trainer.build(cfg, plan)  # resumes from the located checkpoint (a no-op on a fresh start)
        trainer.start_data()
        trainer.checkpointer.restore_rng()  # after start_data: creating the DataLoader iterator draws from the RNG
        started = True
        with ExitRequest(plan.run.train.exit_after_minutes, start_time=t_start) as stop:  # SIGTERM/SIGINT -> stop
            trainer.fit(stop)
            trainer.save_final()
        if plan.dims.is_main:
            trainer.logger.print(f"done: {trainer.state.step} steps, {trainer.state.consumed_tokens:,} tokens; "
                                 f"metrics in {trainer.run_dir}/metrics.jsonl")
    except (DataPreparationError, DataConfigError, ConfigError) as e:
        report_error(str(e), rank=plan.dims.rank, collective=plan.dims.multi_process)
        return EXIT_BAD_INPUT
    except RunError as e:  # checkpoint, storage, run-dir lock, divergence: one line (once per job if collective)
        report_error(str(e), rank=plan.dims.rank, collective=e.collective)
        return e.exit_code
    finally:
        if not started:
            release_refused_start()
        shutdown(trainer)
        release_run_dir()  # the run is over: the next trainer (also in this process) may take run_dir
    return 0


if __name__ == "__main__":
    sys.exit(main())
