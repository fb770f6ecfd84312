"""The benchmark library behind the tools in ``scripts/``.

Measurement method (the same in every benchmark):
- warm up first (Triton/Helion compilation and autotuning stay out of the numbers);
- time on the device with CUDA events (or a synchronized host clock), many repeats, report medians;
- when two implementations are compared, alternate them over rounds in one process, so drift and
  thermal state hit both equally, and run an A-vs-A control (the same arm twice): a difference
  between arms smaller than the control's spread is noise;
- ratios come with a bootstrap confidence interval.

Modules:
- ``stats``: percentiles, summaries, bootstrap ratio CIs, the ABBA alternation schedule, call timing;
- ``profiling``: torch.profiler traces -> per-kernel tables, device busy time and gaps, nvidia-smi sampling;
- ``environment``: the environment record (versions, GPU, git commit);
- ``reporting``: JSON + markdown output, the benchmark ``main`` (``bench_main``), argument helpers;
- ``training``: the one module that uses the training API (``nano_hybrid.runconfig``, ``nano_hybrid.trainer``: validate, build a Trainer, step, tear down);
- ``mixer``: the Mamba-2 mixer shapes, parameters and fused op under test; ``arms``: step-time A/B arms;
- one module per command line in ``scripts/`` (same name), holding its arguments, run and report.

Importing the package (or ``stats``, ``profiling``, ``environment``, ``reporting``) needs only the stdlib and torch and
never touches CUDA.
"""
