"""Configs of one tunable Helion kernel timed side by side at a model shape.

    python scripts/bench_configs.py --kernel ssd_chunk_scan_cb16 --shape nano \\
        --variant 'rows_first={"loop_orders": [[1, 2, 0, 3, 4]]}' --variant 'bm128={"block_sizes": [128, 64, 64]}'

Arms: the config a run selects for the kernel at that shape (``selected``: the committed one, chosen as
``kernels.first_use.select_config`` chooses it without a search, as ``scripts/triton_source.py`` does), each
``--variant NAME=JSON`` (a partial config layered over the selected one) and the selected config again as the A-vs-A
control. The inputs are the kernel's search case (``TUNABLE_KERNELS``: the arguments its wrapper passes at that shape).
``--body NAME=FILE:FUNC`` adds another body of the kernel (a Helion kernel FUNC defined in FILE, taking the same
arguments, e.g. a variant kept in git history: ``git show <commit>:kernels/<file> > variant.py``) as the arm NAME with
the selected config, and NAME+VARIANT with each variant over it.

Method: every arm runs once and its outputs are compared with the selected config's (bitwise, and the largest
absolute difference; the search case's own comparison: results written into argument buffers included, per-program
partials reduced); then --warmup calls per arm and --rounds rounds in alternating order (ABBA...), each arm
--iters back-to-back calls per round timed with CUDA events (synchronized perf_counter on the CPU, where Helion's
interpret mode runs the kernels and the times mean nothing). Per arm the median time per call and, against the
selected config, the median ratio with a 95% bootstrap interval.

Output under --out: ``configs_<kernel>_<shape>.json`` and ``.md`` (env, shape, kernel dims, every arm's full config,
times, ratios, output checks).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nano_hybrid.bench import environment, stats
from nano_hybrid.errors import EXIT_BAD_INPUT

CONTROL = "selected#2"


class VariantError(ValueError):
    """A --variant the kernel's config space refuses, or a --body that is not a Helion kernel."""


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME=JSON`` -> (name, partial config dict)."""
    name, sep, body = text.partition("=")
    name = name.strip()
    if not sep or not name or name in ("selected", CONTROL):
        raise ValueError(f"--variant {text!r}: expected NAME=JSON with a NAME other than 'selected' and {CONTROL!r}")
    try:
        cfg = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"--variant {name}: its config is not JSON ({e.msg})") from None
    if not isinstance(cfg, dict) or not cfg:
        raise ValueError(f"--variant {name}: its config must be a non-empty JSON object of config keys")
    return name, cfg


def parse_body(text: str) -> tuple[str, str, str]:
    """``NAME=FILE:FUNC`` -> (name, file, function name)."""
    name, sep, rest = text.partition("=")
    path, sep2, func = rest.rpartition(":")
    name = name.strip()
    if not sep or not sep2 or not name or not path or not func or name in ("selected", CONTROL):
        raise ValueError(f"--body {text!r}: expected NAME=FILE:FUNC with a NAME other than 'selected' and {CONTROL!r}")
    return name, path, func


def load_body(name: str, path: str, func: str):
    """The Helion kernel ``func`` defined in the Python file ``path``."""
    import importlib.util

    p = Path(path)
    if not p.is_file():
        raise VariantError(f"--body {name}: no file {path}")
    spec = importlib.util.spec_from_file_location(f"bench_configs_body_{name}", p)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # Helion's compiler resolves the kernel's globals through sys.modules
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 - any import error of the user's file is reported in one line
        sys.modules.pop(spec.name, None)
        raise VariantError(f"--body {name}: {path} does not import: {type(e).__name__}: {e}") from None
    kernel = getattr(mod, func, None)
    if kernel is None or not hasattr(kernel, "bind"):
        raise VariantError(f"--body {name}: {path} defines no Helion kernel {func!r}")
    return kernel


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="a run's overrides (as for nano_hybrid.train): its mixer shape")
    ap.add_argument("--kernel", required=True, help="a tunable kernel (scripts/tune_kernels.py --list)")
    ap.add_argument("--shape", default=None, help="a preset or grid shape, as tune_kernels.py's --shapes (default nano)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help='a partial config over the selected one, e.g. \'heads_first={"loop_orders": [[2, 3, 4, 0, 1]]}\'')
    ap.add_argument("--body", action="append", default=[], metavar="NAME=FILE:FUNC",
                    help="another body of the kernel: a Helion kernel FUNC in the Python file FILE, same arguments")
    ap.add_argument("--arch", default=None, help="whose stored configs are selected (default: this GPU's)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="runs/bench_configs", help="output folder (made if missing)")
    return ap


def run(name: str, shape: str, md: dict, variants: dict[str, dict], a, bodies: dict | None = None) -> dict:
    import helion  # imported here, as torch, so --help needs no GPU stack
    from helion.autotuner.config_spec import VALID_KEYS
    import torch

    from kernels import first_use, tuner, tuning

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = tuner.discover_tunable_kernels()[name][1](dict(md), device)
    kernel = tuning.with_index_dtype_for(case.kernel, case.args)
    arch = a.arch or (tuning.current_arch() if device.type == "cuda" else "sm90")
    rt = tuning.Runtime(tuning.HelionSettings())
    selected, how = first_use.select_config(name, kernel, case.args, case.dims, case.default, arch=arch, rt=rt)
    base = tuning.config_to_dict(selected)
    bodies = {k: (spec, load_body(k, *spec)) for k, spec in (bodies or {}).items()}
    # arm -> (kernel, config, the partial config over the selected one): the selected config, the variants, each body
    # with the selected config and with each variant, the selected config again
    arms_run = {"selected": (kernel, base, {}), **{k: (kernel, {**base, **v}, v) for k, v in variants.items()}}
    for b, (_, body) in bodies.items():
        body = tuning.with_index_dtype_for(body, case.args)
        arms_run[b] = (body, dict(base), {})
        arms_run.update({f"{b}+{k}": (body, {**base, **v}, v) for k, v in variants.items()})
    arms_run[CONTROL] = (kernel, dict(base), {})
    configs = {arm: cfg for arm, (_, cfg, _) in arms_run.items()}
    bound = {}
    for arm, (k, cfg, partial) in arms_run.items():  # each arm's config is one of its kernel's space, checked first
        try:
            if tuning.kernel_in_ref_mode(k):  # interpret mode tunes nothing: only the key names can be checked
                unknown = sorted(set(partial) - VALID_KEYS)
                if unknown:
                    raise ValueError(f"unknown config keys {unknown}")
            else:
                b = bound.get(id(k))
                if b is None:
                    b = bound[id(k)] = k.bind(tuple(case.args))
                b.config_spec.normalized_config(tuning.fit_lists(b, helion.Config(**cfg)))
        except Exception as e:  # noqa: BLE001 - Helion raises several kinds for a bad key or value
            what = "--body" if arm in bodies else "--variant"
            raise VariantError(f"{what} {arm}: {type(e).__name__}: {e}") from None

    def call(k, cfg):
        return lambda: tuning.run_with_config(k, case.args, cfg)

    def outputs(fn) -> list:
        """One run's results as the search case compares them (argument buffers poisoned first, then read back)."""
        if case.prepare is not None:
            case.prepare(case.args)
        res = fn()
        res = res if case.finalize is None else case.finalize(res, case.args)
        res = res if isinstance(res, (tuple, list)) else (res,)
        return [t.detach().clone() for t in res if isinstance(t, torch.Tensor)]

    fns, checks = {}, {}
    ref = None
    for arm, (k, cfg, _) in arms_run.items():
        got = outputs(call(k, cfg))
        if ref is None:
            ref = got
        checks[arm] = {"bitwise_equal": all(torch.equal(x, y) for x, y in zip(ref, got)),
                       "max_abs_diff": max((float((x.float() - y.float()).abs().max()) for x, y in zip(ref, got)
                                            if x.numel()), default=0.0)}
        fns[arm] = call(k, cfg)
    for f in fns.values():
        for _ in range(a.warmup):
            f()
    stats.sync(device)
    arms = list(fns)
    times = {arm: [] for arm in arms}
    for order in stats.alternating_order(len(arms), a.rounds):
        for i in order:
            # the mean of --iters back-to-back calls per round: one sample per arm and round
            per_call = stats.time_calls(fns[arms[i]], a.iters, device)
            times[arms[i]].append(sum(per_call) / len(per_call) * 1e3)
    return {
        "benchmark": "bench_configs",
        "env": environment.env_info(),
        "kernel": name, "shape": shape, "model_dims": md, "kernel_dims": dict(case.dims),
        "arch": arch, "selected_from": how,
        "method": f"{a.warmup} warm-up calls per arm; {a.rounds} rounds in alternating order, each arm {a.iters} "
                  "back-to-back calls per round (their mean is the round's sample); CUDA events on a GPU",
        "configs": configs,
        "bodies": {b: f"{spec[0]}:{spec[1]}" for b, (spec, _) in bodies.items()},
        "checks": checks,
        "times_us": {arm: stats.summarize(t) for arm, t in times.items()},
        "vs_selected": {arm: stats.ratio_summary(times["selected"], times[arm]) for arm in arms if arm != "selected"},
    }


def markdown(res: dict) -> str:
    env = res["env"]
    lines = [f"# {res['kernel']} at {res['shape']}: configs side by side", "",
             ", ".join(f"{k} {env[k]}" for k in ("gpu", "torch", "triton", "helion", "git_commit", "date_utc")
                       if env.get(k) is not None), "",
             f"Kernel dims {res['kernel_dims']}; the selected config comes from `{res['selected_from']}` "
             f"({res['arch']}). {res['method']}.", "",
             "| arm | median us | selected / arm [95%] | outputs |", "|---|---|---|---|"]
    for arm, t in res["times_us"].items():
        r = res["vs_selected"].get(arm)
        ratio = "1" if r is None else f"{r['speedup']:.3f}x [{r['ci_lo']:.3f}, {r['ci_hi']:.3f}]"
        c = res["checks"][arm]
        out = "bitwise equal" if c["bitwise_equal"] else f"max abs diff {c['max_abs_diff']:.2e}"
        lines.append(f"| {arm} | {t['median']:.1f} | {ratio} | {out} |")
    lines += ["", "Configs (the variants over the selected one):", ""]
    lines += [f"- body {b}: `{where}` (arms {b} and {b}+VARIANT)" for b, where in res.get("bodies", {}).items()]
    lines += [f"- {arm}: `{json.dumps(cfg)}`" for arm, cfg in res["configs"].items() if arm != CONTROL]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from nano_hybrid.bench.tune_kernels import kernels_and_shapes

    ap = build_parser()
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.iters < 1 or a.warmup < 0:
        ap.error("--rounds and --iters must be >= 1, --warmup >= 0")
    try:
        variants = dict(parse_variant(v) for v in a.variant)
    except ValueError as e:
        ap.error(str(e))
    if len(variants) != len(a.variant):
        ap.error("--variant names must be distinct")
    try:
        bodies = {n: (path, func) for n, path, func in (parse_body(b) for b in a.body)}
    except ValueError as e:
        ap.error(str(e))
    if len(bodies) != len(a.body) or set(bodies) & set(variants):
        ap.error("--body names must be distinct, and distinct from the --variant names")
    names, shapes = kernels_and_shapes(ap, a.kernel, a.overrides, a.shape)
    if len(names) != 1 or len(shapes) != 1:
        ap.error("give one --kernel and one shape")
    (shape, md), = shapes.items()
    try:
        res = run(names[0], shape, md, variants, a, bodies)
    except VariantError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"configs_{names[0]}_{shape}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    md_text = markdown(res)
    stem.with_suffix(".md").write_text(md_text)
    print(md_text)
    print(f"wrote {stem}.json and {stem}.md")
    return 0
