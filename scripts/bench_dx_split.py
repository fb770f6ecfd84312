"""ssd_bwd_dx split in two kernels (kernels/ssd_bwd_dx_split.py: dx_part2 = dx, ddt, dD and the state term with the state
part after the column loop; ddacs_part = the intra-chunk ddA terms) against the committed kernel at the Nano shape, one
process, alternated rounds, CUDA events; outputs compared; writes dx_split_exp.json to argv[1]. Run: PYTHONPATH=. python3 scripts/bench_dx_split.py OUT_DIR. ptxas on the CPU
(Triton 3.9, sm_90a): committed 255 registers at 4 and 8 warps; dx_part2 128 at 8 warps; ddacs_part 130 at 4, 80 at 8."""
import json, sys, time, statistics as st, copy, os
from pathlib import Path
import torch, helion
from kernels.ssd_bwd_dx_split import dx_part2, ddacs_part
from kernels import ssd_helion_bwd as sb, tuning

out_dir = Path(sys.argv[1]); out_dir.mkdir(parents=True, exist_ok=True)
md = dict(b=2, l=8192, h=64, p=64, g=8, n=128, c=128)
dev = torch.device("cuda")
name = "ssd_bwd_dx"
base = json.load(open(f"kernels/configs/sm90/{name}.json"))["entries"]["b2_l8192_h64_p64_g8_n128_c128"]["config"]
def var(**kw):
    c = copy.deepcopy(base); c.update(kw); return c
args, kd = sb._example_args(name, md, dev)
args = list(args)
V = {"A": (sb.ssd_bwd_dx, base), "A2": (sb.ssd_bwd_dx, copy.deepcopy(base)),
     "split_w8_w4": ("split", (var(num_warps=8), base)), "split_w8_w8": ("split", (var(num_warps=8), var(num_warps=8))),
     "split_w4_w4": ("split", (base, base)), "split_w8s2_w4s2": ("split", (var(num_warps=8, num_stages=2), var(num_stages=2))),
     "split_w8_w4_bk32": ("split", (var(num_warps=8), var(block_sizes=[64, 32]))),
     "split_w8bm32_w4": ("split", (var(num_warps=8, block_sizes=[32, 64]), base))}
def run(k):
    kern, cfg = V[k]
    dxb = args[9]
    if kern == "split":
        ca, cb = cfg
        ddt, stt, dD = tuning.run_with_config(dx_part2, tuple(args), helion.Config(**ca))
        x, dout_x, B, CB, dt, dac = args[0], args[1], args[2], args[3], args[4], args[5]
        row, col = tuning.run_with_config(ddacs_part, (x, dout_x, CB, dt, dac, stt), helion.Config(**cb))
        return (ddt, row, col, dD), dxb
    o = tuning.run_with_config(kern, tuple(args), helion.Config(**cfg))
    return o, dxb
outs, fns = {}, {}
for k in V:
    try:
        t0 = time.time()
        args[9].fill_(float("nan"))
        o, dxb = run(k)
        torch.cuda.synchronize()
        outs[k] = [dxb.clone(), o[0].clone(), o[1].sum(dim=3), o[2].clone(), o[3].sum(dim=2)]
        fns[k] = (lambda k=k: run(k))
        print(name, k, "compiled+ran", round(time.time() - t0, 1), "s", flush=True)
    except Exception as e:  # noqa
        print(name, k, "FAILED", type(e).__name__, str(e)[:300], flush=True)
eq = {}
for k in fns:
    eq[k] = {"bitwise": all(torch.equal(a, b) for a, b in zip(outs["A"], outs[k])),
             "max_rel": [float((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-30)) for a, b in zip(outs["A"], outs[k])]}
names = list(fns)
times = {k: [] for k in names}
iters = 20
for _ in range(3):
    for k in names: fns[k]()
torch.cuda.synchronize()
for r in range(20):
    order = names if r % 2 == 0 else names[::-1]
    for k in order:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); s.record()
        for _ in range(iters): fns[k]()
        e.record(); torch.cuda.synchronize()
        times[k].append(s.elapsed_time(e) * 1e3 / iters)
summ = {}
for k in names:
    ratios = sorted(a / b for a, b in zip(times["A"], times[k]))
    summ[k] = {"median_us": round(st.median(times[k]), 1), "ratio_vs_A_median": round(st.median(ratios), 4),
               "ratio_min": round(ratios[0], 4), "ratio_max": round(ratios[-1], 4), **eq[k], "config": V[k][1],
               "kernel": V[k][0] if isinstance(V[k][0], str) else V[k][0].fn.__name__}
    print(f"{k:10s} {summ[k]['median_us']:8.1f} us  A/this {summ[k]['ratio_vs_A_median']:.4f} "
          f"[{summ[k]['ratio_min']:.4f}, {summ[k]['ratio_max']:.4f}] bitwise={eq[k]['bitwise']} "
          f"max_rel={max(eq[k]['max_rel']):.2e}", flush=True)
summ["env"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "helion": __import__("importlib.metadata").metadata.version("helion"),
               "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "shape": md}
(out_dir / "dx_split_exp.json").write_text(json.dumps(summ, indent=1))
