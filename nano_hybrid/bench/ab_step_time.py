"""Step-time A/B of kernel backends in ONE process, ONE model, the same batches.

    python scripts/ab_step_time.py                                   # nano30b_slice, mamba_ssm vs helion, data=mock
    python scripts/ab_step_time.py --backends mamba_ssm,helion,mamba_ssm model=nano30b_slice train.micro_batch_size=2
    torchrun --nproc-per-node 2 scripts/ab_step_time.py parallel=dp2 train.global_batch_size=4
    python scripts/ab_step_time.py --backends torch,torch model=tiny          # CPU A-vs-A smoke run
    python scripts/ab_step_time.py --backends mamba_ssm,helion:model.lm_head_loss=chunked:optim.fused=true,mamba_ssm
    python scripts/ab_step_time.py --backends mamba_ssm,mamba_ssm:train.fp8=rowwise,mamba_ssm   # bf16 vs fp8

Everything after the --flags is a Hydra override (defaults prepended: model=nano30b_slice data=mock
train.micro_batch_size=2 train.global_batch_size=2 train.seq_length=8192 on GPU).

Method:
- Builds the model, Megatron DDP, optimizer and data exactly as ``nano_hybrid.train`` does
  (``runconfig.validate`` -> ``Trainer.build``) and times ``Trainer.train_step`` (a full optimizer step); with
  ``--fwd-bwd-only`` no optimizer is built and forward+backward is timed (models whose Adam states do not fit).
- The kernel backend of every Mamba-2 mixer is switched in place with ``set_kernel_backend(model, name)``
  (the mixer's fused op and its gated-norm module; parameters, optimizer state and DDP hooks are kept).
- An arm is ``backend[:key=value...]``: keys that switch in place on the same model and optimizer
  (``SWITCHABLE``: model.lm_head_loss, model.lm_loss_chunk_tokens, model.mamba_fused_norm, optim.fused, train.fp8) may
  differ between arms;
  an arm without a key runs the composed config's value (``apply_arm``). A helion arm runs the composed
  ``kernels.helion`` settings plus its own ``kernels.helion.<setting>`` keys (``arms.arm_backends``), e.g.
  ``helion,helion:kernels.helion.save_conv_states=false``; the JSON's ``arm_settings`` names every resolved setting.
- Warm-up: --warmup steps per arm (compilation, autotuning, allocator). Then --blocks rounds; in each,
  every arm runs --block-steps steps, arm order alternating (ABBA...), so drift and thermal state hit
  all arms equally. The first --discard steps after each switch are not counted. Rank 0 prints one line per arm
  and round as it finishes (its timed steps, ms), so a run stopped at a time limit leaves its timings in the log.
- Same batches: --block-steps global batches are drawn once and replayed in the same order in every
  block of every arm.
- Per arm: median, mean and p90 step time, tokens/s/GPU and TFLOP/s/GPU (model FLOPs from nano_hybrid/flops.py).
  Speedup of each arm over the first as the ratio of medians and as the ratio of means, each with a 95% bootstrap
  CI. Listing the first backend twice (e.g. mamba_ssm,helion,mamba_ssm) adds an A-vs-A control. Where step times
  fall into two modes within an arm, in proportions that differ from arm to arm, the median follows whichever mode
  an arm drew more often and moves by the modes' distance when the proportion crosses one half, while the mean moves
  with the proportion: an A-vs-A pair whose medians differ by more than their means do may be seeing that.
- On CUDA, --profile-steps steps of each arm under torch.profiler give the share of the step's device
  time spent in the Mamba-2 SSD op (split-conv1d-scan incl. causal conv1d) and the gated RMSNorm: the
  bound on what any kernel backend can gain end to end (kernel names: mamba_ssm's Triton/CUDA kernels;
  Helion kernels are matched by their generated ``_helion_`` names).
- Under torchrun, step time is the max over ranks (every rank times the same steps) and rank 0 writes.
Writes ab_step_time_<model>_<arms>[_<world>gpu].json (+ .md) to $OUT (default runs/bench/<gpu>).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from nano_hybrid.bench import environment, profiling, reporting, stats, training
from nano_hybrid.bench.arms import (CPU_DEFAULTS, GPU_DEFAULTS, SWITCHABLE, apply_arm, arm_backends, arm_record,
                                    check_arms, compose_over_defaults, parse_arm)
from nano_hybrid.bench.mixer import MixerOp, MixerShape, make_params


# ------------------------------------------------------------------------------------ arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="mamba_ssm,helion",
                   help="comma-separated arms, each backend[:key=value...] (keys: " + ", ".join(SWITCHABLE)
                        + ", and kernels.helion.<setting> for helion arms"
                        + "); the first is the baseline; repeat it for an A-vs-A control")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per arm before timing (default 5)")
    p.add_argument("--blocks", type=int, default=8, help="alternation rounds (default 8)")
    p.add_argument("--block-steps", type=int, default=5, help="steps per arm per round (default 5)")
    p.add_argument("--discard", type=int, default=1, help="steps after each switch not counted (default 1)")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps per arm on CUDA (0: skip)")
    p.add_argument("--trace-dir", default=None,
                   help="also write the chrome trace of each arm's profiled steps there (CUDA)")
    p.add_argument("--isolated-op", action="store_true",
                   help="diagnostic (CUDA): after each arm's step profile, profile the mixer op alone "
                        "(scripts/bench_kernels.py MixerOp, fwd+bwd at the model's mixer shape) in this process")
    p.add_argument("--fwd-bwd-only", action="store_true",
                   help="time forward+backward only, with no optimizer built (no fp32 main weights, no Adam states): "
                        "for models whose optimizer states do not fit the GPU")
    p.add_argument("--n-boot", type=int, default=2000)
    p.add_argument("--out", default=None, help="output dir (default $OUT or runs/bench/<gpu>)")
    p.add_argument("--tag", default=None, help="extra name part for the output files")
    a = reporting.parse_args_with_overrides(p, argv)
    try:
        a.arm_specs = [parse_arm(x) for x in a.arms]
    except ValueError as e:
        p.error(str(e))
    if len(a.arms) < 2:
        p.error("--backends needs at least two arms (e.g. mamba_ssm,helion or torch,torch for A-vs-A)")
    for k in ("blocks", "block_steps"):
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    for k in ("warmup", "discard", "profile_steps"):
        if getattr(a, k) < 0:
            p.error(f"--{k.replace('_', '-')} must be >= 0")
    if a.discard >= a.block_steps:
        p.error(f"--discard ({a.discard}) must be smaller than --block-steps ({a.block_steps})")
    return a


def total_steps(a) -> int:
    return len(a.arms) * (a.warmup + a.blocks * a.block_steps + a.profile_steps)


def compose_cfg(a):
    """Compose the config: defaults, then the user's overrides; train_iters covers every step we run."""
    from omegaconf import open_dict

    cfg, user_keys = compose_over_defaults(GPU_DEFAULTS, CPU_DEFAULTS, a.overrides)
    with open_dict(cfg):
        if "train.train_iters" not in user_keys:
            cfg.train.train_iters = max(total_steps(a), int(cfg.optim.warmup_iters) + 1)
        cfg.kernels.backend = a.arm_specs[0].backend
        if cfg.run_dir is None:
            run_id = os.environ.get("TORCHELASTIC_RUN_ID") or str(os.getpid())
            cfg.run_dir = str(Path(tempfile.gettempdir()) / f"nano_hybrid_ab_{run_id}")
        cfg.logger.wandb.mode = "disabled"
    return cfg


# ------------------------------------------------------------------------------------------ run
def isolated_op_profile(cfg, plan, backend, iters: int) -> dict:
    """The mixer op (fused split-conv1d-scan + gated norm, fwd+bwd) alone at the model's mixer shape,
    profiled in the step's process: separates "the kernel is slow in this process" from "the kernel
    is slow inside the step". It runs the norm as a module after the gated op (``MixerOp``) for every arm, also one
    with ``model.mamba_fused_norm``; the record says so (``norm_in_op`` false)."""
    import torch

    m = cfg.model
    shape = MixerShape(batch=int(cfg.train.micro_batch_size), seqlen=int(plan.seq_length),
                       nheads=int(m.mamba_num_heads), headdim=int(m.mamba_head_dim),
                       ngroups=int(m.mamba_num_groups), d_state=int(m.mamba_state_dim),
                       d_conv=int(m.mamba_conv_width), chunk_size=int(m.mamba_chunk_size))
    params = make_params(shape, plan.device, plan.dtype, seed=0)
    op = MixerOp(backend, shape, params, plan.device, plan.dtype)
    for _ in range(3):
        op.mixer_fwdbwd()
    torch.cuda.synchronize()
    table = profiling.profile_device_table(op.mixer_fwdbwd, max(iters, 1), overlap_categories=("ssd", "norm"))
    del op, params
    torch.cuda.empty_cache()
    return {"shape": {k: getattr(shape, k) for k in ("batch", "seqlen", "nheads", "headdim", "ngroups", "d_state")},
            "norm_in_op": False,
            "device_us_per_iter": table["total_us_per_iter"],
            "kernels": [r for r in table["rows"] if r["us_per_iter"] > 1.0],
            "cross_stream_overlap": table.get("cross_stream_overlap")}


def step_timer(step_fn, ctx, device):
    """``() -> (seconds, loss)`` of one step; under torchrun the time is the max over ranks."""
    import torch
    import torch.distributed as dist

    def step_time() -> tuple[float, float]:
        dt, out = training.timed_step(step_fn, ctx, device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([dt], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            dt = float(t.item())
        return dt, out["loss"]

    return step_time


def measure_arms(a, use, step_time, labels: list[str], device,
                 verbose: bool = False) -> tuple[dict, dict, dict, dict]:
    """Warm-up per arm, then ``a.blocks`` ABBA rounds of ``a.block_steps`` steps per arm: (times, losses, peak
    allocated GiB) per arm label and the process's memory; the first ``a.discard`` steps after each switch are not
    timed. The process's memory (CUDA; GiB, the largest at the end of any block; the arms share one allocator, so
    these are not per arm): ``reserved`` by the caching allocator, ``outside_allocator`` (device memory in use beyond
    what the allocator reserves: ``nano_hybrid.plan.outside_allocator_gib``). ``verbose``: one line per arm and round
    as it finishes (a run stopped at its time limit still leaves its timings in the log)."""
    import torch

    from nano_hybrid.plan import outside_allocator_gib

    losses = {lab: [] for lab in labels}
    for i in range(len(a.arms)):  # warm-up
        use(i)
        for _ in range(a.warmup):
            step_time()
    times = {lab: [] for lab in labels}
    peak_gb = {lab: 0.0 for lab in labels}  # peak allocated memory within each arm's blocks (CUDA)
    process = {"reserved": 0.0, "outside_allocator": 0.0}
    for r, order in enumerate(stats.alternating_order(len(a.arms), a.blocks)):
        for i in order:
            use(i)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            block = []
            for k in range(a.block_steps):
                dt, loss = step_time()
                if k >= a.discard:
                    times[labels[i]].append(dt)
                    block.append(dt)
                losses[labels[i]].append(loss)
            if verbose:
                print(f"round {r + 1}/{a.blocks} {labels[i]}: " + " ".join(f"{t * 1e3:.1f}" for t in block) + " ms",
                      flush=True)
            if device.type == "cuda":
                peak_gb[labels[i]] = max(peak_gb[labels[i]], torch.cuda.max_memory_allocated(device) / 2**30)
                process["reserved"] = max(process["reserved"], torch.cuda.memory_reserved(device) / 2**30)
                process["outside_allocator"] = max(process["outside_allocator"], outside_allocator_gib(device))
    return times, losses, peak_gb, process


def arm_profile(table: dict, median_s: float) -> dict:
    """One arm's profiled steps: device time per step, the SSD op's and the gated norm's share, their kernels."""
    by_cat = table["by_category"]
    return {
        "device_ms_per_step": table["total_us_per_iter"] / 1e3,
        "ssd_ms_per_step": by_cat.get("ssd", 0.0) / 1e3,
        "norm_ms_per_step": by_cat.get("norm", 0.0) / 1e3,
        "share_of_device_time": {c: v / table["total_us_per_iter"] for c, v in by_cat.items()},
        "ssd_plus_norm_share_of_step": (by_cat.get("ssd", 0.0) + by_cat.get("norm", 0.0)) / 1e3 / (median_s * 1e3),
        "top_kernels": table["rows"][:25],
        "ssd_norm_kernels": [r for r in table["rows"] if r["category"] in ("ssd", "norm")],
        "cross_stream_overlap": table.get("cross_stream_overlap"),
        "streams": table.get("streams"),
    }


def profile_arms(a, use, step_time, step_fn, ctx, plan, labels: list[str], backends: dict, times: dict) -> dict:
    """On CUDA, ``a.profile_steps`` steps of each arm (A-vs-A repeats skipped) under torch.profiler."""
    profile = {}
    if a.profile_steps and plan.device.type == "cuda":
        for i, lab in enumerate(labels):
            if lab in profile or "#" in lab:
                continue
            use(i)
            step_time()  # re-warm after the switch
            trace = None if a.trace_dir is None else Path(a.trace_dir) / f"step_trace_{lab}.json"
            table = profiling.profile_device_table(lambda: step_fn(ctx), a.profile_steps, trace_path=trace,
                                                   overlap_categories=("ssd", "norm"))
            profile[lab] = arm_profile(table, stats.median(times[lab]))
            if a.isolated_op:
                profile[lab]["isolated_op"] = isolated_op_profile(ctx.cfg, plan, backends[a.arm_specs[i]],
                                                                  a.profile_steps)
    elif a.profile_steps:
        profile = {"skipped": "profiling needs CUDA"}
    return profile


def run(a) -> dict | None:
    cfg = compose_cfg(a)
    plan = training.validate(cfg)  # config, data, first backend, parallel sizes: fails early
    backends = arm_backends(cfg, a.arm_specs)  # every arm must be usable, with its settings
    check_arms(cfg, a.arm_specs, with_optimizer=not a.fwd_bwd_only)
    labels = stats.arm_labels([x.label for x in a.arm_specs])
    ctx = training.setup(cfg, plan, with_optimizer=not a.fwd_bwd_only)
    step_fn = training.fwd_bwd_step if a.fwd_bwd_only else training.train_step
    try:
        # the same global batches for every block of every arm
        replay = training.replay(ctx, training.draw_batches(ctx, plan.num_microbatches * a.block_steps))
        step_time = step_timer(step_fn, ctx, plan.device)

        def use(i):
            apply_arm(ctx, a.arm_specs[i], backends)
            replay.reset()

        times, losses, peak_gb, process = measure_arms(a, use, step_time, labels, plan.device,
                                                       verbose=plan.dims.rank == 0)
        profile = profile_arms(a, use, step_time, step_fn, ctx, plan, labels, backends, times)
        if plan.dims.rank != 0:
            return None
        return result(a, cfg, plan, ctx.flops_per_token, labels, times, losses, peak_gb, profile, process)
    finally:
        training.shutdown(ctx)


def result(a, cfg, plan, flops_per_token: float, labels, times, losses, peak_gb, profile, process: dict) -> dict:
    """The JSON record: per arm step times, throughput, losses, peak memory; the process's memory
    (``measure_arms``); speedups over the first arm."""
    tokens_per_step = int(cfg.train.global_batch_size) * plan.seq_length
    cuda = plan.device.type == "cuda"
    per_arm = {}
    for lab in labels:
        s = stats.summarize(times[lab])
        per_arm[lab] = {
            "step_time_s": s,
            "tokens_per_s_per_gpu": tokens_per_step / s["median"] / plan.dims.world_size,
            "tflops_per_gpu": flops_per_token * tokens_per_step / s["median"] / plan.dims.world_size / 1e12,
            "losses": losses[lab],
            "peak_mem_gb": peak_gb[lab] if cuda else None,
        }
    base = labels[0]
    ratios = {f"{lab}_vs_{base}": stats.ratio_summary(times[base], times[lab], n_boot=a.n_boot) for lab in labels[1:]}
    ratios_mean = {f"{lab}_vs_{base}": stats.ratio_summary(times[base], times[lab], n_boot=a.n_boot, stat=stats.mean)
                   for lab in labels[1:]}
    return {
        "benchmark": "ab_step_time",
        "env": environment.env_info(),
        "args": {k: v for k, v in vars(a).items() if k != "arm_specs"},
        "arm_settings": {lab: arm_record(cfg, x) for lab, x in zip(labels, a.arm_specs)},
        "config": {
            "model": str(cfg.model.name), "pattern": str(cfg.model.hybrid_override_pattern),
            "parallel": {k: cfg.parallel[k] for k in cfg.parallel},
            "micro_batch_size": int(cfg.train.micro_batch_size),
            "global_batch_size": int(cfg.train.global_batch_size),
            "seq_length": plan.seq_length, "data": str(cfg.data.kind),
            "dtype": str(plan.dtype).removeprefix("torch."), "device": plan.device.type,
        },
        "world_size": plan.dims.world_size,
        "tokens_per_step": tokens_per_step,
        "flops_per_token": flops_per_token,
        "arms": labels,
        "method": (f"{a.warmup} warm-up steps per arm; {a.blocks} rounds x {a.block_steps} steps per arm, ABBA order, "
                   f"first {a.discard} step(s) after each switch discarded; same {a.block_steps} global batches "
                   "replayed per block; step time = max over ranks, synchronized host clock around "
                   + ("forward+backward (no optimizer built)" if a.fwd_bwd_only else "train_step")),
        "per_arm": per_arm,
        # the arms' shared allocator and the device memory outside it (what nano_hybrid.plan's CONTEXT_GIB stands for)
        "process_memory_gb": ({"reserved_max": process["reserved"], "outside_allocator_max": process["outside_allocator"]}
                              if cuda else None),
        "speedup_vs_first": ratios,
        "speedup_vs_first_mean": ratios_mean,
        "profile": profile,
    }


def markdown(res: dict) -> str:
    c = res["config"]
    lines = [f"# Step-time A/B: {', '.join(res['arms'])} on {c['model']} ({res['world_size']} x {res['env'].get('gpu') or 'cpu'})",
             "", reporting.env_markdown(res["env"]), "",
             f"{c['pattern']}, mbs {c['micro_batch_size']}, gbs {c['global_batch_size']}, seq {c['seq_length']}, "
             f"{c['dtype']}, data {c['data']}. {res['method']}.", ""]
    rows = []
    for lab in res["arms"]:
        r = res["per_arm"][lab]
        s = r["step_time_s"]
        key = f"{lab}_vs_{res['arms'][0]}"
        sp = res["speedup_vs_first"].get(key)
        spm = (res.get("speedup_vs_first_mean") or {}).get(key)  # records before it have no ratio of means
        rows.append([lab, f"{1e3 * s['median']:.1f}", "-" if s.get("mean") is None else f"{1e3 * s['mean']:.1f}",
                     f"{1e3 * s['p90']:.1f}", s["n"], f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['tflops_per_gpu']:.1f}",
                     "1 (baseline)" if sp is None else f"{sp['speedup']:.3f}x [{sp['ci_lo']:.3f}, {sp['ci_hi']:.3f}]",
                     ("1 (baseline)" if sp is None else "-") if spm is None
                     else f"{spm['speedup']:.3f}x [{spm['ci_lo']:.3f}, {spm['ci_hi']:.3f}]",
                     "-" if r.get("peak_mem_gb") is None else f"{r['peak_mem_gb']:.1f}"])
    lines.append(reporting.md_table(["arm", "median ms", "mean ms", "p90 ms", "n", "tokens/s/GPU", "TFLOP/s/GPU",
                                     "speedup of medians (95% CI)", "speedup of means (95% CI)", "peak GiB"], rows))
    pm = res.get("process_memory_gb")
    if pm:
        conf = res["env"].get("pytorch_cuda_alloc_conf") or "unset"
        lines += ["", f"Process (all arms): at most {pm['reserved_max']:.1f} GiB reserved by PyTorch's allocator and "
                  f"{pm['outside_allocator_max']:.1f} GiB of the device in use outside it (PYTORCH_CUDA_ALLOC_CONF "
                  f"{conf})."]
    prof = res.get("profile") or {}
    if prof and "skipped" not in prof:
        lines += ["", "Share of the step in the Mamba-2 SSD op (incl. causal conv1d) and the gated RMSNorm (torch.profiler):", ""]
        lines.append(reporting.md_table(
            ["arm", "device ms/step", "SSD ms", "norm ms", "SSD+norm share of median step"],
            [[lab, f"{p['device_ms_per_step']:.1f}", f"{p['ssd_ms_per_step']:.2f}", f"{p['norm_ms_per_step']:.2f}",
              f"{100 * p['ssd_plus_norm_share_of_step']:.1f}%"] for lab, p in prof.items()]))
        for lab, p in prof.items():
            ov = p.get("cross_stream_overlap") or {}
            iso = {r["kernel"]: r for r in (p.get("isolated_op") or {}).get("kernels", [])}
            n_layers = max(1, str(c["pattern"]).count("M"))
            rows = []
            for r in p.get("ssd_norm_kernels", []):
                k = r["kernel"]
                o = ov.get(k, {})
                rows.append([f"`{k}`", f"{r['us_per_iter'] / n_layers:.1f}",
                             f"{o.get('overlapped_us_per_iter', 0.0) / n_layers:.1f}",
                             f"{iso[k]['us_per_iter']:.1f}" if k in iso else "-"])
            if rows:
                lines += ["", f"{lab}: SSD/norm kernels, us per Mamba layer in the step (of which overlapped by "
                          f"another stream) vs the op alone in this process ({len(p.get('streams') or [])} streams "
                          "in the step):", ""]
                lines.append(reporting.md_table(["kernel", "in step", "overlapped", "op alone"], rows))
    elif prof:
        lines += ["", f"Profile: {prof['skipped']}"]
    return "\n".join(lines)


def output_stem(res: dict, tag: str | None) -> str:
    return reporting.arms_stem("ab_step_time", res, tag)


def main(argv=None) -> int:
    return reporting.bench_main(argv, parse_args, run, lambda res, a: output_stem(res, a.tag), markdown)
