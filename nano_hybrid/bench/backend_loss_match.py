"""Training-loss match of kernel backends: the same model, seed, initial weights and batches, one process.

    python scripts/backend_loss_match.py                                     # GPU: model=tiny, torch vs helion, 50 steps, bf16
    python scripts/backend_loss_match.py --backends torch,helion,mamba_ssm,torch   # + mamba-ssm and a torch A-vs-A control
    python scripts/backend_loss_match.py --backends torch,torch --steps 5    # CPU A-vs-A: must be bitwise equal
    python scripts/backend_loss_match.py model=nano30b_slice \
        --backends helion:model.lm_head_loss=plain:optim.fused=false,helion,helion   # settings arms (ab_step_time.py)
    python -m pytest tests/test_backend_loss_match.py                        # CPU torch vs helion (see below)

On CPU the helion arm runs in Helion's eager interpret mode (HELION_INTERPRET=1, slow: seconds per
step at seq 64), whose hl.dot needs aten::mm.dtype on CPU; CPU torch builds lack it and only the test
suite registers a (test-only) implementation, so here the CPU torch-vs-helion run is the pytest above
(the script itself stops with one error line instead).

Everything after the --flags is a Hydra override (defaults prepended: model=tiny; on CPU also
train.seq_length=64 train.micro_batch_size=2 train.global_batch_size=2 to keep Helion's interpret mode
workable). train.train_iters defaults to --steps (the LR schedule then spans the run) and
optim.warmup_iters to min(its config value, train_iters // 5).

Method:
- The config is validated and set up exactly as ``nano_hybrid.train`` does (``runconfig.validate`` -> ``Trainer.build``);
  then ``--steps x num_microbatches`` micro-batches are drawn once from the data iterator and replayed,
  in the same order, to every arm.
- Each arm (backend) trains its OWN model: megatron's seeds are re-applied
  (``nano_hybrid.parallel.initialize_parallel``, idempotent, re-seeds python/numpy/torch and megatron's
  model-parallel RNG streams) and model + Megatron DDP + optimizer + LR schedule are built with
  ``nano_hybrid.trainer.build_model_and_optimizer`` with ``kernels.backend=<arm>``. Its initial weights are
  checked to be bitwise equal to the first arm's (else the run stops). The seeds are applied again
  before the first step, then ``Trainer.train_step`` runs ``--steps`` full optimizer steps.
- Per step: loss (global-batch mean), grad norm, lr. Per arm vs the first arm (the reference): max/mean
  absolute and relative loss difference over the steps, the step of the largest one, whether the loss
  curves are bitwise equal, and the largest absolute difference of the final weights.
- Pass/fail per arm against a tolerance on the relative loss difference that depends on the training
  dtype (see TOLERANCES; override with --mean-rtol / --max-rtol). Listing the first backend twice
  (e.g. torch,helion,torch) adds an A-vs-A control: it shows what the harness / run-to-run
  nondeterminism alone gives (bitwise equal on CPU).
Writes backend_loss_match_<model>_<arms>_<dtype>.json (+ .md) to $OUT (default runs/bench/<gpu or cpu>).
Exit code: 0 all arms pass, 1 some arm fails the tolerance, 2 bad input.
"""

from __future__ import annotations

import argparse
import gc
import math

from nano_hybrid.bench import environment, reporting, stats, training
from nano_hybrid.bench.arms import arm_backends, arm_config, parse_arm


DEFAULTS = ["model=tiny"]
CPU_DEFAULTS = ["model=tiny", "train.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=2"]

# Relative loss difference |L_arm - L_ref| / |L_ref| per step, gated on its mean and max over the steps.
TOLERANCES = {
    "float32": {
        "mean_rtol": 1e-5, "max_rtol": 5e-5,
        "why": ("fp32: both backends compute the same math with fp32 accumulation and differ only in summation "
                "order (Helion tiles vs torch einsum/cumsum); measured on CPU (model=tiny, seq 64): torch vs helion "
                "<= 1.8e-7 relative over 10 steps (mean 4.5e-8), torch vs torch bitwise. The gap grows slowly under "
                "Adam, so mean 1e-5 / max 5e-5 leaves a wide margin for 50 steps. Sensitivity (measured, 3 steps): "
                "a fused Mamba op whose output is 1% too large gives max 1e-4 (fails), 0.1% gives 7e-7 (passes)."),
    },
    "bfloat16": {
        "mean_rtol": 1e-2, "max_rtol": 3e-2,
        "why": ("bf16: activations are rounded to bf16 (8-bit mantissa, 2^-8 = 3.9e-3 relative) at different "
                "places in each backend, so two correct backends start ~1e-3 apart and their trajectories "
                "decorrelate slowly; a mean of 1% and a max of 3% over 50 steps of model=tiny admits that. This gate "
                "catches gross errors only (a wrong gradient, NaN/divergence, broken chunking): on CPU fp32 a 10% "
                "error in the fused op's output moved the loss by only 7e-4 in 3 steps, so kernel accuracy proper is "
                "the job of the op-level tests and of the fp32 gate. Compare with the mamba_ssm arm and a torch "
                "A-vs-A control when run."),
    },
}


# ------------------------------------------------------------------------------------ arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="torch,helion",  # each arm: backend[:key=value...] (arms.SWITCHABLE)
                   help="comma-separated arms; the first is the reference; repeat it for an A-vs-A control")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps per arm (default 50)")
    p.add_argument("--mean-rtol", type=float, default=None,
                   help="max allowed mean relative loss difference (default: by dtype, see TOLERANCES)")
    p.add_argument("--max-rtol", type=float, default=None,
                   help="max allowed largest relative loss difference (default: by dtype)")
    p.add_argument("--out", default=None, help="output dir (default $OUT or runs/bench/<gpu or cpu>)")
    p.add_argument("--tag", default=None, help="extra name part for the output files")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    a = reporting.parse_args_with_overrides(p, argv)
    if len(a.arms) < 2:
        p.error("--backends needs at least two arms (e.g. torch,helion, or torch,torch for A-vs-A)")
    try:  # backend[:key=value...]: the settings ab_step_time switches (LM head + loss, fused AdamW)
        a.arm_specs = [parse_arm(x) for x in a.arms]
    except ValueError as e:
        p.error(str(e))
    if a.steps < 1:
        p.error("--steps must be >= 1")
    for k in ("mean_rtol", "max_rtol"):
        v = getattr(a, k)
        if v is not None and not (v >= 0 and math.isfinite(v)):
            p.error(f"--{k.replace('_', '-')} must be a finite number >= 0")
    return a


def compose_cfg(a):
    """Defaults, then the user's overrides; train_iters = --steps unless given; no checkpoints, no W&B."""
    from omegaconf import open_dict

    from nano_hybrid.bench.arms import compose_over_defaults

    cfg, user_keys = compose_over_defaults(DEFAULTS, CPU_DEFAULTS, a.overrides)
    with open_dict(cfg):
        if "train.train_iters" not in user_keys:
            cfg.train.train_iters = a.steps
        if "optim.warmup_iters" not in user_keys:  # the schedule must fit a short run: warm up over the first 20%
            cfg.optim.warmup_iters = min(int(cfg.optim.warmup_iters), int(cfg.train.train_iters) // 5)
        cfg.kernels.backend = a.arm_specs[0].backend
    training.detach_from_run_state(cfg)
    if a.steps > int(cfg.train.train_iters):
        from nano_hybrid.config import ConfigError

        raise ConfigError(f"--steps {a.steps} exceeds train.train_iters={cfg.train.train_iters}")
    return cfg


def tolerances(a, dtype_name: str) -> dict:
    if dtype_name not in TOLERANCES:
        from nano_hybrid.config import ConfigError

        raise ConfigError(f"no default tolerance for dtype {dtype_name}; pass --mean-rtol and --max-rtol")
    t = dict(TOLERANCES[dtype_name])
    if a.mean_rtol is not None:
        t["mean_rtol"] = a.mean_rtol
    if a.max_rtol is not None:
        t["max_rtol"] = a.max_rtol
    if a.mean_rtol is not None or a.max_rtol is not None:
        t["why"] = "set on the command line; default reasoning: " + t["why"]
    return t


# ---------------------------------------------------------------------------------- comparison
def compare_losses(ref: list[float], other: list[float]) -> dict:
    """Per-step absolute / relative differences of two loss curves (same length)."""
    if len(ref) != len(other) or not ref:
        raise ValueError(f"loss curves must have the same non-zero length, got {len(ref)} and {len(other)}")
    absd = [abs(b - r) for r, b in zip(ref, other)]
    reld = [d / abs(r) if r != 0 else (0.0 if d == 0 else math.inf) for d, r in zip(absd, ref)]
    finite = all(math.isfinite(x) for x in ref + other)
    i_max = max(range(len(reld)), key=reld.__getitem__)
    return {
        "max_abs_diff": max(absd),
        "mean_abs_diff": sum(absd) / len(absd),
        "max_rel_diff": max(reld),
        "mean_rel_diff": sum(reld) / len(reld),
        "step_of_max_rel_diff": i_max + 1,
        "first_step_rel_diff": reld[0],
        "last_step_rel_diff": reld[-1],
        "bitwise_equal": all(r == b for r, b in zip(ref, other)),
        "all_finite": finite,
        "rel_diff_per_step": reld,
    }


def verdict(cmp: dict, tol: dict) -> bool:
    return bool(cmp["all_finite"] and cmp["mean_rel_diff"] <= tol["mean_rtol"] and cmp["max_rel_diff"] <= tol["max_rtol"])


def weights_snapshot(model) -> dict:
    """name -> CPU copy of every floating-point parameter and buffer (exact values, original dtype)."""
    import torch

    return {k: v.detach().to("cpu", copy=True) for k, v in training.unwrap_model(model).state_dict().items()
            if isinstance(v, torch.Tensor) and v.is_floating_point()}


def snapshot_diff(a: dict, b: dict) -> tuple[bool, float, str | None]:
    """(bitwise equal, max |a - b| over all tensors, name of the worst tensor)."""
    if a.keys() != b.keys():
        raise RuntimeError(f"models differ in their tensors: {sorted(a.keys() ^ b.keys())[:5]}")
    equal, worst, worst_name = True, 0.0, None
    for k in a:
        if a[k].shape != b[k].shape:
            raise RuntimeError(f"{k}: shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}")
        if not bool((a[k] == b[k]).all()):
            equal = False
            d = float((a[k].double() - b[k].double()).abs().max())
            if d > worst:
                worst, worst_name = d, k
    return equal, worst, worst_name


# ------------------------------------------------------------------------------------------ run
def check_arm_settings(cfg, specs) -> None:
    """Each arm's settings checked as ``nano_hybrid.runconfig.validate`` checks the composed config's (optim.fused a
    bool, a known LM head + loss with a positive chunk size and no TP for the chunked ones): ConfigError naming the
    arm, before any work."""
    from nano_hybrid.config import ConfigError
    from nano_hybrid.model.config import check_model_cfg, model_dict
    from nano_hybrid.model.lm_loss import check_lm_head_parallel

    for spec in specs:
        arm = arm_config(cfg, spec)
        try:
            training.validate_optim(arm.optim, int(arm.train.train_iters))
            m = model_dict(arm.model)
            check_model_cfg(m)
            check_lm_head_parallel(m, int(arm.parallel.tensor_model_parallel_size))
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"arm {spec.label}: {e}") from None


def run(a) -> dict | None:
    cfg = compose_cfg(a)
    with training.scratch_run_dir(cfg, "nano_hybrid_loss_match_"):
        return _run(a, cfg)


def train_arm(a, ctx, plan, cfg, label: str, spec, batches: list, ref: dict, say) -> dict:
    """Arm ``spec`` trains its own model (seeded as at start-up) ``a.steps`` steps on ``batches``: its per-step
    record. ``ref`` holds the first arm's initial and final weights (set by the first arm); a later arm's
    initial weights must equal them bitwise, and its final weights are compared with them."""
    from nano_hybrid.parallel import initialize_parallel

    arm_cfg = arm_config(cfg, spec)
    initialize_parallel(arm_cfg)  # re-seed (same seeds as at start-up) -> identical initial weights
    model, optimizer, scheduler = training.build_arm(plan, arm_cfg)
    init = weights_snapshot(model)
    if "init" not in ref:
        ref["init"], ref["label"] = init, label
        ref["n_params"] = sum(p.numel() for p in training.unwrap_model(model).parameters())
    else:
        equal, worst, where = snapshot_diff(ref["init"], init)
        if not equal:
            raise RuntimeError(f"arm {label}: initial weights differ from arm {ref['label']}'s "
                               f"(max |diff| {worst:.3e} in {where}); the comparison would be meaningless")
    del init
    initialize_parallel(arm_cfg)  # the same RNG state at step 1 for every arm
    arm_ctx = training.with_parts(ctx, batches, cfg=arm_cfg, model=model, optimizer=optimizer, scheduler=scheduler)
    rec = {"backend": spec.backend, "settings": dict(spec.overrides), "loss": [], "grad_norm": [], "lr": [],
           "skipped": [], "step_time_s": []}
    say(f"--- arm {label} (kernels.backend={spec.backend}" + "".join(f", {k}={v}" for k, v in spec.overrides) + ") ---")
    for s in range(1, a.steps + 1):
        dt, out = training.timed_step(training.train_step, arm_ctx, plan.device)
        rec["step_time_s"].append(dt)
        for k in ("loss", "grad_norm", "lr", "skipped"):
            rec[k].append(out[k])
        if not a.quiet:
            say(f"{label:>12} step {s:3d}/{a.steps} | loss {out['loss']:.6f} | grad_norm {out['grad_norm']:.4f} "
                f"| lr {out['lr']:.3e} | {1e3 * dt:.0f} ms")
    final = weights_snapshot(model)
    if "final" not in ref:
        ref["final"] = final
    else:
        equal, worst, where = snapshot_diff(ref["final"], final)
        rec["final_weights_bitwise_equal"] = equal
        rec["final_weights_max_abs_diff"] = worst
        rec["final_weights_max_abs_diff_tensor"] = where
    return rec


def comparisons(per_arm: dict, labels: list[str], tol: dict) -> dict:
    """Each later arm against the first: loss and grad-norm differences, final weights, the verdict."""
    ref = labels[0]
    out = {}
    for lab in labels[1:]:
        c = compare_losses(per_arm[ref]["loss"], per_arm[lab]["loss"])
        g = compare_losses(per_arm[ref]["grad_norm"], per_arm[lab]["grad_norm"])
        c["grad_norm_max_rel_diff"] = g["max_rel_diff"]
        c["grad_norm_mean_rel_diff"] = g["mean_rel_diff"]
        c["final_weights_bitwise_equal"] = per_arm[lab].pop("final_weights_bitwise_equal")
        c["final_weights_max_abs_diff"] = per_arm[lab].pop("final_weights_max_abs_diff")
        c["final_weights_max_abs_diff_tensor"] = per_arm[lab].pop("final_weights_max_abs_diff_tensor")
        c["pass"] = verdict(c, tol)
        out[f"{lab}_vs_{ref}"] = c
    return out


def _run(a, cfg) -> dict | None:
    import torch

    plan = training.validate(cfg)  # config, data, first backend, parallel sizes: fails early
    check_arm_settings(cfg, a.arm_specs)
    arm_backends(cfg, a.arm_specs)  # every arm must be usable, with its settings, before any work
    dtype_name = str(plan.dtype).removeprefix("torch.")
    tol = tolerances(a, dtype_name)
    labels = stats.arm_labels([x.label for x in a.arm_specs])
    say = (lambda msg: print(msg, flush=True)) if plan.dims.rank == 0 else (lambda msg: None)

    ctx = training.setup(cfg, plan)
    try:
        batches = training.draw_batches(ctx, plan.num_microbatches * a.steps)  # the same batches for every arm
        sample = batches[0]["tokens"]
        training.drop_model(ctx)  # setup()'s own model is not used: every arm builds its own
        gc.collect()
        ref, per_arm = {}, {}
        for label, spec in zip(labels, a.arm_specs):
            per_arm[label] = train_arm(a, ctx, plan, cfg, label, spec, batches, ref, say)
            gc.collect()
            if plan.device.type == "cuda":
                torch.cuda.empty_cache()
        comps = comparisons(per_arm, labels, tol)
        if plan.dims.rank != 0:
            return None
        return result(a, cfg, plan, ref["n_params"], sample, labels, tol, per_arm, comps)
    finally:
        training.shutdown(ctx)


def result(a, cfg, plan, n_params: int, sample, labels, tol, per_arm, comps) -> dict:
    """The JSON record: config, shapes, per-arm curves, comparisons with the first arm, overall pass."""
    m = cfg.model
    return {
        "benchmark": "backend_loss_match",
        "env": environment.env_info(),
        "args": {k: v for k, v in vars(a).items() if k != "arm_specs"},
        "config": {
            "model": str(m.name), "pattern": str(m.hybrid_override_pattern), "n_params": n_params,
            "parallel": {k: cfg.parallel[k] for k in cfg.parallel},
            "micro_batch_size": int(cfg.train.micro_batch_size),
            "global_batch_size": int(cfg.train.global_batch_size),
            "num_microbatches": plan.num_microbatches,
            "seq_length": plan.seq_length, "data": str(cfg.data.kind),
            "data_paths": [str(p) for p in (cfg.data.paths or [])],
            "dtype": str(plan.dtype).removeprefix("torch."), "device": plan.device.type, "seed": int(cfg.seed),
            "train_iters": int(cfg.train.train_iters),
            "optim": {k: cfg.optim[k] for k in ("lr", "min_lr", "warmup_iters", "decay_style", "clip_grad",
                                                 "weight_decay")},
            "kernels": {"deterministic": bool(cfg.kernels.deterministic)},
        },
        "shapes": {
            "tokens_per_microbatch": list(sample.shape),
            "mamba": {"nheads": int(m.mamba_num_heads), "headdim": int(m.mamba_head_dim),
                      "d_state": int(m.mamba_state_dim), "ngroups": int(m.mamba_num_groups),
                      "chunk_size": int(m.mamba_chunk_size), "conv_width": int(m.mamba_conv_width),
                      "d_inner": int(m.mamba_num_heads) * int(m.mamba_head_dim)},
            "hidden_size": int(m.hidden_size), "vocab_size": int(m.vocab_size),
        },
        "world_size": plan.dims.world_size,
        "steps": a.steps,
        "arms": labels,
        "reference": labels[0],
        "method": ("same seed, bitwise-equal initial weights (checked), same replayed batches, separate "
                   "model/optimizer/schedule per arm, RNG re-seeded before step 1; "
                   "rel diff = |loss_arm - loss_ref| / |loss_ref| per step"),
        "tolerance": tol,
        "per_arm": per_arm,
        "comparisons": comps,
        "pass": all(c["pass"] for c in comps.values()),
    }


def markdown(res: dict) -> str:
    c, t = res["config"], res["tolerance"]
    lines = [f"# Training-loss match: {', '.join(res['arms'])} on {c['model']} ({res['env'].get('gpu') or 'cpu'})", "",
             reporting.env_markdown(res["env"]), "",
             f"{c['pattern']}, {c['n_params'] / 1e6:.2f}M params, mbs {c['micro_batch_size']}, gbs {c['global_batch_size']}, "
             f"seq {c['seq_length']}, {c['dtype']}, data {c['data']}, {res['steps']} steps, seed {c['seed']}. "
             f"{res['method']}.", "",
             f"Tolerance ({c['dtype']}): mean rel diff <= {t['mean_rtol']:g} and max rel diff <= {t['max_rtol']:g}. {t['why']}", ""]
    rows = []
    for key, r in res["comparisons"].items():
        rows.append([key, f"{r['max_abs_diff']:.3e}", f"{r['mean_abs_diff']:.3e}", f"{r['max_rel_diff']:.3e}",
                     f"{r['mean_rel_diff']:.3e}", r["step_of_max_rel_diff"], f"{r['first_step_rel_diff']:.3e}",
                     "yes" if r["bitwise_equal"] else "no", f"{r['final_weights_max_abs_diff']:.3e}",
                     "PASS" if r["pass"] else "FAIL"])
    lines.append(reporting.md_table(["arm vs reference", "max abs", "mean abs", "max rel", "mean rel", "step of max",
                              "step-1 rel", "bitwise", "final weights max abs", "verdict"], rows))
    lines += ["", "Loss per step:", ""]
    arms = res["arms"]
    show = sorted(set(range(0, res["steps"], max(1, res["steps"] // 10))) | {res["steps"] - 1})
    lines.append(reporting.md_table(["step"] + arms,
                             [[s + 1] + [f"{res['per_arm'][lab]['loss'][s]:.6f}" for lab in arms] for s in show]))
    lines += ["", f"Overall: {'PASS' if res['pass'] else 'FAIL'}"]
    return "\n".join(lines)


def output_stem(res: dict, tag: str | None) -> str:
    return reporting.arms_stem("backend_loss_match", res, tag, str(res["config"]["dtype"]))


def main(argv=None) -> int:
    return reporting.bench_main(argv, parse_args, run, lambda res, a: output_stem(res, a.tag), markdown,
                         exit_code=lambda res: 0 if res["pass"] else 1)
