"""Gradient match of kernel backends at a trained state: the same weights and batches, one process.

    python scripts/grad_match.py recipe=convergence_ab_h200_2000_lowlr                # GPU, the defaults below
    python scripts/grad_match.py --backends torch,mamba_ssm,helion,mamba_ssm --train-backend mamba_ssm \\
        --train-steps 300 --batches 2 recipe=convergence_ab_h200_2000_lowlr

Why: the loss curves of two backends can drift apart for two reasons, chaos (tiny differences amplified by
training: two runs of one backend drift too) and a systematic difference in what a kernel computes. This
script looks for the second one where the first cannot hide it: every arm computes the gradient of the SAME
weights on the SAME batches, so nothing is amplified.

Method:
- The config is validated and set up as ``nano_hybrid.train`` does. One model with ``--train-backend``
  trains ``--train-steps`` optimizer steps (a trained state: at initialisation the Mamba layers barely
  matter); its weights and buffers (router expert bias included) are the probe state.
- Each arm (``--backends``; the first is the reference, ideally ``torch``: the pure-PyTorch kernels, which
  compute the SSD in fp32) builds its model with ``kernels.backend=<arm>``, loads the probe state, and runs
  forward + backward (no optimizer step) over the next ``--batches`` global batches; the gradients (megatron
  DDP's fp32 ``main_grad``) are summed over them.
- Per parameter and arm against the reference arm and against the second arm: relative L2 error
  ``|g - g_ref| / |g_ref|``, cosine, and ``scale = <g, g_ref> / |g_ref|^2`` (1 when g has no component
  along g_ref beyond g_ref itself: a systematic over- or under-estimate shows as scale != 1). Parameters are
  grouped by role (mixer A_log / D / dt_bias / conv1d / in_proj / out_proj / norm, layer norms, attention,
  experts, router, embedding, output layer); per group the worst and the norm-weighted values.
- A backend listed twice gives an A-vs-A control (run-to-run nondeterminism of its kernels).

Writes grad_match_<arms>.json to $OUT (default runs/bench/<gpu or cpu>).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import re
import sys
from pathlib import Path

from nano_hybrid.bench import reporting, stats, training
from nano_hybrid.errors import EXIT_BAD_INPUT


# (group, regex on the parameter name), first match wins
GROUPS = [
    ("mixer.A_log", r"mixer\.A_log$"),
    ("mixer.D", r"mixer\.D$"),
    ("mixer.dt_bias", r"mixer\.dt_bias$"),
    ("mixer.conv1d", r"mixer\.conv1d\."),
    ("mixer.in_proj", r"mixer\.in_proj\."),
    ("mixer.out_proj", r"mixer\.out_proj\."),
    ("mixer.norm", r"mixer\.norm\."),
    ("layer_norms", r"(norm|layernorm)\.weight$"),
    ("attention", r"self_attention\."),
    ("router", r"router\."),
    ("experts", r"mlp\.(experts|shared_experts)\."),
    ("embedding", r"embedding\."),
    ("output_layer", r"output_layer\."),
]


def group_of(name: str) -> str:
    for g, pat in GROUPS:
        if re.search(pat, name):
            return g
    return "other"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="torch,mamba_ssm,helion,mamba_ssm",
                   help="comma-separated arms; the first is the reference; repeat one for an A-vs-A control")
    p.add_argument("--train-backend", default="mamba_ssm", help="backend of the model that trains to the probe state")
    p.add_argument("--train-steps", type=int, default=300, help="optimizer steps before the probe (0: initial weights)")
    p.add_argument("--batches", type=int, default=2, help="global batches whose gradients are summed per arm")
    p.add_argument("--out", default=None, help="output dir (default $OUT or runs/bench/<gpu or cpu>)")
    p.add_argument("--tag", default=None, help="extra name part for the output file")
    a = reporting.parse_args_with_overrides(p, argv)
    if len(a.arms) < 2:
        p.error("--backends needs at least two arms (the first is the reference)")
    if a.train_steps < 0 or a.batches < 1:
        p.error("--train-steps must be >= 0 and --batches >= 1")
    return a


def compare(g: dict, ref: dict) -> dict:
    """Per-parameter and per-group rel. L2 error, cosine and scale of gradients g against ref (name -> tensor)."""
    per_param, groups = {}, {}
    for name, r in ref.items():
        x = g[name]
        rd, xd = r.double(), x.double()
        rsq, xsq, dsq = float((rd * rd).sum()), float((xd * xd).sum()), float(((xd - rd) ** 2).sum())
        dot = float((xd * rd).sum())  # == rsq exactly when x == r
        rr, dd = math.sqrt(rsq), math.sqrt(dsq)
        rec = {"ref_norm": rr, "rel_err": dd / rr if rr > 0 else (0.0 if dd == 0 else math.inf),
               "cos": dot / math.sqrt(rsq * xsq) if rsq > 0 and xsq > 0 else float(rsq == xsq),
               "scale": dot / rsq if rsq > 0 else float("nan")}
        per_param[name] = rec
        grp = groups.setdefault(group_of(name), {"params": 0, "ref_sq": 0.0, "diff_sq": 0.0, "dot": 0.0,
                                                 "worst_rel_err": 0.0, "worst_param": None})
        grp["params"] += 1
        grp["ref_sq"] += rsq
        grp["diff_sq"] += dsq
        grp["dot"] += dot
        if rec["rel_err"] > grp["worst_rel_err"]:
            grp["worst_rel_err"], grp["worst_param"] = rec["rel_err"], name
    for grp in groups.values():
        ref_sq = grp.pop("ref_sq")
        grp["rel_err"] = math.sqrt(grp.pop("diff_sq") / ref_sq) if ref_sq > 0 else 0.0
        grp["scale"] = grp.pop("dot") / ref_sq if ref_sq > 0 else float("nan")
    return {"groups": dict(sorted(groups.items())), "params": per_param}


def grads(model) -> dict:
    """name -> fp32 copy of each parameter's gradient (megatron DDP's main_grad, else .grad)."""
    out = {}
    for name, p in training.unwrap_model(model).named_parameters():
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        if g is not None:
            out[name] = g.detach().float().clone()
    return out


def run(a) -> dict:
    from omegaconf import open_dict

    from nano_hybrid.config import compose

    cfg = compose(a.overrides)
    with open_dict(cfg):
        cfg.kernels.backend = a.train_backend
    training.detach_from_run_state(cfg)
    with training.scratch_run_dir(cfg, "nano_hybrid_grad_match_"):
        return _run(a, cfg)


def _run(a, cfg) -> dict:
    import torch
    from omegaconf import open_dict

    from kernels.registry import configure_backend
    from nano_hybrid.parallel import initialize_parallel

    plan = training.validate(cfg)
    for name in dict.fromkeys([a.train_backend, *a.arms]):  # every backend must be usable before any work
        configure_backend(name)
    labels = stats.arm_labels(a.arms)
    ctx = training.setup(cfg, plan)
    n_train = plan.num_microbatches * a.train_steps
    batches = training.draw_batches(ctx, n_train + plan.num_microbatches * a.batches)
    train_batches, probe_batches = batches[:n_train], batches[n_train:]
    res = {"script": "scripts/grad_match.py", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "versions": {"torch": torch.__version__}, "overrides": a.overrides, "train_backend": a.train_backend,
           "train_steps": a.train_steps, "probe_batches": a.batches, "arms": labels,
           "model": str(cfg.model.name), "pattern": str(cfg.model.hybrid_override_pattern),
           "micro_batch": int(cfg.train.micro_batch_size), "global_batch": int(cfg.train.global_batch_size),
           "seq": int(plan.seq_length), "dtype": str(plan.dtype).removeprefix("torch."), "train_loss": []}
    try:
        import triton

        res["versions"]["triton"] = triton.__version__
    except ImportError:
        pass

    # the probe state: the train backend's model after train_steps steps
    model, optimizer, scheduler = ctx.model, ctx.optimizer, ctx.scheduler
    tctx = training.with_parts(ctx, train_batches)
    for _ in range(a.train_steps):
        res["train_loss"].append(training.train_step(tctx)["loss"])
    state = {k: v.detach().clone() for k, v in training.unwrap_model(model).state_dict().items() if isinstance(v, torch.Tensor)}
    training.drop_model(ctx)
    del model, optimizer, scheduler, tctx
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print(f"probe state after {a.train_steps} steps of {a.train_backend}"
          + (f": loss {res['train_loss'][-1]:.4f}" if res["train_loss"] else ""), flush=True)

    per_arm, res["probe_loss"] = {}, {}
    for label, name in zip(labels, a.arms):
        with open_dict(cfg):
            cfg.kernels.backend = name
        initialize_parallel(cfg)
        m, opt, sch = training.build_arm(plan, cfg)
        missing, unexpected = training.unwrap_model(m).load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"arm {label}: state mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})")
        initialize_parallel(cfg)
        actx = training.with_parts(ctx, probe_batches, model=m, optimizer=opt, scheduler=sch)
        total, losses = None, []
        for _ in range(a.batches):
            reports = training.forward_backward(actx)
            acc = sum(r["lm loss"].double() for r in reports)
            losses.append(float(acc[0] / acc[1]))
            g = grads(m)
            total = g if total is None else {k: total[k] + g[k] for k in total}
        per_arm[label] = total
        res["probe_loss"][label] = losses
        print(f"arm {label}: probe loss {losses}", flush=True)
        del m, opt, sch, actx
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None

    res["vs"] = {}
    for ref_label in labels[:2]:
        for label in labels:
            if label == ref_label:
                continue
            c = compare(per_arm[label], per_arm[ref_label])
            res["vs"][f"{label} vs {ref_label}"] = c["groups"]
            res.setdefault("worst_params", {})[f"{label} vs {ref_label}"] = sorted(
                ({"param": k, **v} for k, v in c["params"].items()), key=lambda r: -r["rel_err"])[:8]
    return res


def markdown(res: dict) -> str:
    lines = [f"# Gradient match at a trained state ({res['gpu']}, {res['date']})", "",
             (f"`scripts/grad_match.py`: {res['model']} pattern {res['pattern']}, mbs {res['micro_batch']} x seq "
              f"{res['seq']}, {res['dtype']}; probe state after {res['train_steps']} steps of {res['train_backend']}; "
              f"gradients summed over {res['probe_batches']} global batches. Per group: rel. L2 error / scale "
              "(<g, g_ref> / |g_ref|^2)."), ""]
    pairs = list(res["vs"])
    groups = sorted({g for v in res["vs"].values() for g in v})
    lines.append("| group | " + " | ".join(pairs) + " |")
    lines.append("|---|" + "---|" * len(pairs))
    for g in groups:
        cells = []
        for p in pairs:
            r = res["vs"][p].get(g)
            cells.append(f"{r['rel_err']:.2e} / {r['scale']:.4f}" if r else "")
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines += ["", "Probe losses per arm: " + ", ".join(f"{k}: {v}" for k, v in res["probe_loss"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse_args(argv)
    from kernels.registry import BackendUnavailableError, KernelSwitchError, UnknownBackendError
    from nano_hybrid.config import ConfigError
    from nano_hybrid.data import DataConfigError

    try:
        reporting.check_args(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        res = run(a)
    except (ConfigError, DataConfigError, UnknownBackendError, BackendUnavailableError, KernelSwitchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    out = Path(a.out) if a.out else reporting.default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    stem = "grad_match_" + "_vs_".join(a.arms) + (f"_{a.tag}" if a.tag else "")
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(res))
    print(markdown(res))
    print(f"wrote {out / stem}.json")
    return 0
