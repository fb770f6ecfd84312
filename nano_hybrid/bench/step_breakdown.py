"""Where the training step goes: device time per category of a profiled ``train_step``, for one or more arms.

    python scripts/step_breakdown.py                                        # nano30b_slice, mamba_ssm and helion
    python scripts/step_breakdown.py --backends mamba_ssm,helion:model.lm_head_loss=chunked:optim.fused=true
    python scripts/step_breakdown.py --backends torch model=tiny train.seq_length=64    # CPU (CPU op time)

Everything after the --flags is a Hydra override, as for training (defaults prepended as in
``ab_step_time.py``: model=nano30b_slice data=mock, and on GPU mbs 2 x 8192).

Method:
- The model, Megatron DDP, optimizer and data are built by the training API (``runconfig.validate`` -> ``Trainer.build``);
  one model serves every arm. An arm is ``backend[:key=value...]`` and is switched in place with
  ``arms.apply_arm`` (kernel backend, ``model.lm_head_loss``, ``optim.fused``).
- Per arm: --warmup steps, then --steps steps of ``Trainer.train_step`` timed with a synchronized
  host clock (the measured step), then --profile-steps steps under torch.profiler.
- Ranges: forward pre/post hooks open a ``record_function("nhb::<category>")`` around the model's modules
  (embedding, Mamba in/out projections, the Mamba mixer, attention projections and core, MoE router,
  experts and shared expert, the MoE layer's own dispatch/permute, norms, output layer, the model's own
  loss code); the megatron optimizer's methods (zero_grad, prepare_grads, get_grad_norm, step_with_ready_grads,
  step) run in ``nhb::optimizer``, DDP's zero_grad_buffer and the schedule's finalize_model_grads in
  ``nhb::grad_accum``, each step in ``nhb::step``. Unattributed host-side work after the finalize (gradient
  clipping between the optimizer's methods) counts as ``optimizer``.
- Attribution of each device kernel (on CPU: each op's self time): its launching CPU op (kineto's linked
  correlation id; where several CPU events of the step share that id, the last launch call before the kernel that
  no earlier kernel took, else the last CPU op before it, never a CUDA call that launches nothing), then the
  innermost enclosing range on that thread. Backward work runs outside the
  forward ranges: an ``autograd::engine::evaluate_function: XBackward`` node is mapped through its
  sequence number (and forward thread) to the forward op that recorded it, and takes that op's range.
  Gradient accumulation into DDP's ``main_grad`` (AccumulateGrad nodes) is ``grad_accum``; NCCL/gloo
  kernels are ``communication``; the chunked LM head's range splits into GEMMs (``lm_head``) and the rest
  (``cross_entropy``); anything unattributed is ``other``.
- Concurrent kernels on several streams share their overlap equally, so the categories sum to the device's
  busy time; ``idle`` = step wall time (the profiled ``nhb::step`` range) - busy time. The table reports
  the profiled step next to the measured (unprofiled) step; their difference is the profiler's overhead.
- With ``--host-steps N``, N more steps per arm under cProfile: where the host's (Python) time goes, the functions
  with the most own and cumulative time per step. A step whose device is mostly idle is paced by this time.
Writes step_breakdown_<model>_<arms>.json/.md and .png (stacked bars) to --out (default runs/bench/<gpu>).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from nano_hybrid.bench import environment, profiling, reporting, stats, training
from nano_hybrid.bench.arms import CPU_DEFAULTS, GPU_DEFAULTS, apply_arm, arm_backends, check_arms, parse_arm


CATEGORIES = (
    "mamba_mixer", "mamba_proj", "attn_core", "attn_proj", "moe_router", "moe_dispatch", "expert_gemm",
    "shared_expert", "norms", "embedding", "lm_head", "cross_entropy", "residual", "grad_accum", "optimizer",
    "communication", "other", "idle",
)
DESCRIPTIONS = {
    "mamba_mixer": "Mamba-2 mixer kernels (conv1d, SSD scan, gated norm, gating)",
    "mamba_proj": "Mamba in_proj / out_proj",
    "attn_core": "attention core (SDPA / unfused)",
    "attn_proj": "attention QKV / output projections (and their layout copies)",
    "moe_router": "MoE router (scores, top-k, aux loss, expert bias)",
    "moe_dispatch": "MoE dispatch / permute / unpermute (the MoE layer outside router and experts)",
    "expert_gemm": "routed experts (grouped GEMMs + activation)",
    "shared_expert": "shared expert MLP",
    "norms": "layer RMSNorms (pre-mixer, pre-MLP, final)",
    "embedding": "input embedding",
    "lm_head": "LM head GEMMs",
    "cross_entropy": "cross-entropy (and the loss code around it)",
    "residual": "residual adds and layout work inside layers",
    "grad_accum": "gradients: accumulation into DDP main_grad, buffer zeroing, finalize (scaling, DP reduction)",
    "optimizer": "optimizer (zero_grad, grad copies, clip, AdamW, param copies)",
    "communication": "collectives (NCCL / gloo)",
    "other": "unattributed",
    "idle": "device idle within the step",
}
RANGE_PREFIX = "nhb::"
STEP_RANGE = "nhb::step"
CHUNKED_HEAD_RANGE = "nano_hybrid::lm_head_loss"  # nano_hybrid.model.lm_loss.PROFILE_RANGE
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
            "aten::_grouped_mm", "aten::_scaled_mm"}
_COMM = re.compile(r"(nccl|gloo|c10d::|allreduce|all_reduce|allgather|reduce_scatter)", re.I)
_BWD_NODE = "autograd::engine::evaluate_function: "


# ----------------------------------------------------------------------------------- module ranges
def module_category(name: str, module) -> str | None:
    """The category of a named submodule of the (unwrapped) MambaModel, or None (no range of its own)."""
    cls = type(module).__name__
    leaf = name.rsplit(".", 1)[-1]
    if cls in ("IdentityOp", "IdentityFuncOp"):
        return None
    if name == "":
        return "cross_entropy"  # MambaModel.forward outside its submodules: the loss after the output layer
    if name == "embedding":
        return "embedding"
    if name == "output_layer":
        return "lm_head"
    if name == "decoder" or re.fullmatch(r"decoder\.layers\.\d+", name):
        return "residual"
    if leaf == "final_norm" or re.fullmatch(r"decoder\.layers\.\d+\.(norm|input_layernorm|pre_mlp_layernorm)", name):
        return "norms"
    if re.fullmatch(r"decoder\.layers\.\d+\.mixer", name):
        return "mamba_mixer"
    if re.fullmatch(r"decoder\.layers\.\d+\.mixer\.(in_proj|out_proj)", name):
        return "mamba_proj"
    if re.fullmatch(r"decoder\.layers\.\d+\.self_attention(\.(linear_qkv|linear_proj))?", name):
        return "attn_proj"
    if re.fullmatch(r"decoder\.layers\.\d+\.self_attention\.core_attention", name):
        return "attn_core"
    if re.fullmatch(r"decoder\.layers\.\d+\.mlp", name):
        return "moe_dispatch" if hasattr(module, "router") else "shared_expert"  # a dense MLP layer: count as MLP
    if re.fullmatch(r"decoder\.layers\.\d+\.mlp\.router", name):
        return "moe_router"
    if re.fullmatch(r"decoder\.layers\.\d+\.mlp\.experts", name):
        return "expert_gemm"
    if re.fullmatch(r"decoder\.layers\.\d+\.mlp\.shared_experts", name):
        return "shared_expert"
    return None


class ModuleRanges:
    """Forward pre/post hooks that open/close ``record_function("nhb::<category>")`` around modules."""

    def __init__(self, model):
        import torch

        self._torch = torch
        self.handles = []
        self.named = {}
        for name, mod in model.named_modules():
            cat = module_category(name, mod)
            if cat is None:
                continue
            self.named[name] = cat
            stack: list = []
            self.handles.append(mod.register_forward_pre_hook(self._enter(cat, stack)))
            self.handles.append(mod.register_forward_hook(self._exit(stack), always_call=True))

    def _enter(self, cat, stack):
        def hook(_mod, _args):
            rf = self._torch.profiler.record_function(RANGE_PREFIX + cat)
            rf.__enter__()
            stack.append(rf)
        return hook

    @staticmethod
    def _exit(stack):
        def hook(_mod, _args, _out):
            if stack:
                stack.pop().__exit__(None, None, None)
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


OPTIMIZER_METHODS = ("zero_grad", "prepare_grads", "get_grad_norm", "step_with_ready_grads", "step")


def _ranged(fn, cat: str):
    import torch

    def wrapper(*a, **kw):
        with torch.profiler.record_function(RANGE_PREFIX + cat):
            return fn(*a, **kw)
    return wrapper


@contextlib.contextmanager
def optimizer_ranges(optimizer):
    """``nhb::optimizer`` around the megatron optimizer's (and its chained parts') step methods for the
    ``with`` block (instance attributes shadowing the methods; removed afterwards)."""
    objs = [optimizer, *getattr(optimizer, "chained_optimizers", [])]
    done = []
    try:
        for o in objs:
            for name in OPTIMIZER_METHODS:
                if callable(getattr(o, name, None)) and name not in vars(o):
                    setattr(o, name, _ranged(getattr(o, name), "optimizer"))
                    done.append((o, name))
        yield
    finally:
        for o, name in done:
            delattr(o, name)


@contextlib.contextmanager
def grad_ranges(ctx):
    """``nhb::grad_accum`` around DDP's ``zero_grad_buffer`` and the schedule's ``finalize_model_grads_func``
    (grad scaling by the token count, DP reduction, MoE expert-bias update) for the ``with`` block."""
    config = training.unwrap_model(ctx.model).config
    fin = config.finalize_model_grads_func
    ctx.model.zero_grad_buffer = _ranged(type(ctx.model).zero_grad_buffer.__get__(ctx.model), "grad_accum")
    config.finalize_model_grads_func = _ranged(fin, "grad_accum")
    try:
        yield
    finally:
        config.finalize_model_grads_func = fin
        del ctx.model.zero_grad_buffer


# ------------------------------------------------------------------------------------- attribution
@dataclass
class Ev:
    """A profiler event, as needed for attribution (times in ns)."""

    name: str
    start: int
    end: int
    thread: int = 0
    corr: int = 0  # CPU op: its correlation id
    linked: int = 0  # device event: the launching CPU op's correlation id
    seq: int = -1  # autograd sequence number
    fwd_thread: int = 0  # backward node: the forward thread (0 on forward ops)
    device: bool = False
    stream: int = 0
    kind: str = "cpu_op"  # kineto activity type: cpu_op, user_annotation, kernel, gpu_memcpy, ...
    parent: "Ev | None" = field(default=None, repr=False)
    child_ns: int = 0  # CPU: summed duration of direct children


def events_from_profiler(prof) -> list[Ev]:
    """Kineto events of a finished ``torch.profiler.profile`` as ``Ev`` (CPU ops, ranges and device events)."""
    return events_from_kineto(list(prof.profiler.kineto_results.events()))


def events_from_kineto(events: list) -> list[Ev]:
    """``Ev`` of kineto events. Their kind is kineto's activity type (``activity_type()``, torch >= 2.12); where
    torch lacks it, a device event named like a CPU-side event is that range's device-side copy
    (``gpu_user_annotation``, spanning the kernels launched inside it, not device work), ``Memcpy``/``Memset``
    events are copies and fills, and the rest are kernels."""
    def on_device(e) -> bool:
        return str(e.device_type()).rsplit(".", 1)[-1] != "CPU"

    cpu_names = {e.name() for e in events if not on_device(e)}
    out = []
    for e in events:
        dev = on_device(e)
        out.append(Ev(name=e.name(), start=int(e.start_ns()), end=int(e.start_ns() + e.duration_ns()),
                      thread=int(e.start_thread_id()), corr=int(e.correlation_id()),
                      linked=int(e.linked_correlation_id()), seq=int(e.sequence_nr()),
                      fwd_thread=int(e.fwd_thread_id()), device=dev,
                      stream=int(e.device_resource_id()) if dev else 0, kind=_activity_kind(e, dev, cpu_names)))
    return out


def _activity_kind(e, device: bool, cpu_names: set[str]) -> str:
    if hasattr(e, "activity_type"):
        return str(e.activity_type())
    name = e.name()
    if not device:
        return "user_annotation" if name.startswith(RANGE_PREFIX) else "cpu_op"
    if name in cpu_names:
        return "gpu_user_annotation"
    return "gpu_memcpy" if name.startswith("Memcpy") else "gpu_memset" if name.startswith("Memset") else "kernel"


def build_cpu_tree(cpu: list[Ev]) -> None:
    """Set ``parent`` (innermost enclosing event on the same thread) and ``child_ns`` of CPU events."""
    by_thread: dict[int, list[Ev]] = {}
    for e in cpu:
        by_thread.setdefault(e.thread, []).append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.start, -e.end))
        stack: list[Ev] = []
        for e in evs:
            while stack and stack[-1].end <= e.start:
                stack.pop()
            while stack and stack[-1].end < e.end:  # partial overlap (async ranges): not a parent
                stack.pop()
            e.parent = stack[-1] if stack else None
            if e.parent is not None:
                e.parent.child_ns += e.end - e.start
            stack.append(e)


def _ancestors(e: Ev):
    while e is not None:
        yield e
        e = e.parent


HEAD_LOSS = "lm_head_loss"  # the chunked head's range: split by the op that does the work


def _resolve(cat: str, leaf: Ev) -> str:
    if cat == HEAD_LOSS:
        return "lm_head" if leaf.name in GEMM_OPS else "cross_entropy"
    return cat


def _range_category(e: Ev) -> str | None:
    if e.name.startswith(RANGE_PREFIX) and e.name != STEP_RANGE:
        return e.name[len(RANGE_PREFIX):]
    if e.name == CHUNKED_HEAD_RANGE:
        return HEAD_LOSS
    if e.name.startswith("Optimizer.step#") or e.name.startswith("Optimizer.zero_grad#"):
        return "optimizer"
    return None


def forward_categories(cpu: list[Ev]) -> dict[tuple[int, int], str | None]:
    """(thread, sequence number) of each forward op that records an autograd node -> its innermost range."""
    fwd = {}
    for e in cpu:
        if e.seq >= 0 and e.fwd_thread == 0 and not e.name.startswith(_BWD_NODE):
            cat = None
            for a in _ancestors(e):
                cat = _range_category(a)
                if cat is not None:
                    break
            fwd.setdefault((e.thread, e.seq), cat)
    return fwd


def op_category(op: Ev, fwd: dict, device_name: str | None = None) -> tuple[str, bool]:
    """(category, in backward) of work launched by CPU op ``op``."""
    if device_name is not None and _COMM.search(device_name):
        return "communication", False
    in_bwd = False
    for a in _ancestors(op):
        if _COMM.search(a.name) and not a.name.startswith(RANGE_PREFIX):
            return "communication", in_bwd
        cat = _range_category(a)
        if cat is not None:
            return _resolve(cat, op), in_bwd
        node = a.name[len(_BWD_NODE):] if a.name.startswith(_BWD_NODE) else None
        if node is None and a.fwd_thread > 0 and a.seq >= 0:
            node = a.name  # the backward node itself (inside its evaluate_function)
        if node is not None:
            in_bwd = True
            if "AccumulateGrad" in node:
                return "grad_accum", True
            if a.seq >= 0 and a.fwd_thread > 0:
                cat = fwd.get((a.fwd_thread, a.seq))
                if cat is not None:
                    return _resolve(cat, op), True
    return "other", in_bwd


def _path(e: Ev, depth: int = 3) -> str:
    """'op < parent < grandparent' (for the report of unattributed work)."""
    names = []
    for a in _ancestors(e):
        if a.name == STEP_RANGE or len(names) == depth:
            break
        names.append(a.name)
    return " < ".join(names)


def _share_overlaps(intervals: list[tuple[int, int, int]]) -> tuple[dict[int, float], int]:
    """intervals (start, end, key) -> (time per key with concurrent intervals sharing equally, busy time)."""
    bounds = []
    for s, e, k in intervals:
        if e > s:
            bounds.append((s, 1, k))
            bounds.append((e, -1, k))
    bounds.sort(key=lambda b: (b[0], b[1]))
    active: dict[int, int] = {}
    share: dict[int, float] = {}
    busy = 0
    last = None
    for t, d, k in bounds:
        if last is not None and active and t > last:
            dt = t - last
            busy += dt
            n = sum(active.values())
            for kk, c in active.items():
                share[kk] = share.get(kk, 0.0) + dt * c / n
        if d > 0:
            active[k] = active.get(k, 0) + 1
        else:
            active[k] -= 1
            if active[k] == 0:
                del active[k]
        last = t
    return share, busy


# CUDA runtime / driver calls that put work on the device; the other runtime calls (occupancy queries, attribute
# reads, stream checks) never launch a kernel. A kernel launch, copy or fill call puts exactly one item on the device.
_LAUNCH_API = re.compile(r"^cu(da)?(LaunchKernel|LaunchCooperativeKernel|GraphLaunch|Memcpy|Memset)")
_ONE_ITEM_API = re.compile(r"^cu(da)?(LaunchKernel|LaunchCooperativeKernel|Memcpy|Memset)")


def launchers_by_correlation(cpu: list[Ev]) -> dict[int, list[Ev]]:
    """Correlation id -> the CPU events with that id that can launch device work (CPU ops and the launch calls of
    the CUDA API), by start time. kineto links a device event either to its CUDA launch call or, through the
    external correlation, to the CPU op; the two ids are counted apart, so one id can name several events."""
    out: dict[int, list[Ev]] = {}
    for e in cpu:
        if e.corr and (not e.name.startswith("cu") or _LAUNCH_API.match(e.name)):
            out.setdefault(e.corr, []).append(e)
    for evs in out.values():
        evs.sort(key=lambda e: e.start)
    return out


def launcher_of(k: Ev, candidates: list[Ev], step: Ev, used: set[int]) -> Ev | None:
    """The CPU event that launched device event ``k`` among those sharing its correlation id, all within ``k``'s
    step (every step ends with a device sync). Called for a step's device events in start order; ``used`` holds
    the one-item launch calls already matched to an earlier device event.
    - the last unused one-item launch call (kernel launch, copy, fill) starting before ``k``: a launch precedes its
      work, and launches one item;
    - else the last CPU op (or graph launch) starting before ``k``: an op can launch many;
    - else the first candidate of the step (the device clock can read slightly early against the host's)."""
    in_step = [e for e in candidates if step.start <= e.start < step.end]
    before = [e for e in in_step if e.start <= k.start]
    calls = [e for e in before if _ONE_ITEM_API.match(e.name) and id(e) not in used]
    if calls:
        used.add(id(calls[-1]))
        return calls[-1]
    ops = [e for e in before if not _ONE_ITEM_API.match(e.name)]
    if ops:
        return ops[-1]
    return in_step[0] if in_step else None


def _device_items(events: list[Ev], cpu: list[Ev], steps: list[Ev], step_of, fwd, opt_from) -> tuple[list, list]:
    """Per step: device work items (start, end, category, in backward) attributed through their launching CPU
    op, and their names."""
    items: list[list[tuple[int, int, str, bool]]] = [[] for _ in steps]
    names: list[list[str]] = [[] for _ in steps]
    by_corr = launchers_by_correlation(cpu)
    used: set[int] = set()
    # device work in start order: kernels, memcpy, memset (not the device-side copies of the ranges)
    work = sorted((e for e in events if e.device and e.kind in profiling.DEVICE_EVENT_CATS), key=lambda e: e.start)
    for k in work:
        i = step_of(k.start)
        if i is None:
            continue
        op = launcher_of(k, by_corr.get(k.linked, ()), steps[i], used)
        cat, bwd = op_category(op, fwd, k.name) if op is not None else (
            ("communication", False) if _COMM.search(k.name) else ("other", False))
        if cat == "other" and op is not None and op.thread == steps[i].thread and op.start >= opt_from[i]:
            cat = "optimizer"
        items[i].append((max(k.start, steps[i].start), min(k.end, steps[i].end), cat, bwd))
        names[i].append(k.name if op is None else f"{k.name} < {_path(op)}")
    return items, names


def _cpu_items(cpu: list[Ev], steps: list[Ev], step_of, fwd, opt_from) -> tuple[list, list]:
    """Per step: CPU ops' self times as items (0, self ns, category, in backward), and their names."""
    items: list[list[tuple[int, int, str, bool]]] = [[] for _ in steps]
    names: list[list[str]] = [[] for _ in steps]
    for e in cpu:
        if e.name.startswith(RANGE_PREFIX) or e.name == CHUNKED_HEAD_RANGE:
            continue
        i = step_of(e.start)
        if i is None:
            continue
        self_ns = (e.end - e.start) - e.child_ns
        cat, bwd = op_category(e, fwd)
        if cat == "other" and e.thread == steps[i].thread and e.start >= opt_from[i]:
            cat = "optimizer"
        items[i].append((0, self_ns, cat, bwd))
        names[i].append(_path(e))
    return items, names


def _sum_steps(steps: list[Ev], items: list, names: list, device: bool) -> dict:
    """The per-step means of ``attribute``'s result from the steps' work items."""
    total = {c: 0.0 for c in CATEGORIES}
    bwd_total = {c: 0.0 for c in CATEGORIES}
    busy_total = wall_total = 0
    by_name: dict[str, dict[str, float]] = {c: {} for c in CATEGORIES}  # category -> work item name -> ns
    for st, its, nms in zip(steps, items, names):
        wall = st.end - st.start
        if device:
            keyed = [(s, e, j) for j, (s, e, _, _) in enumerate(its)]
            share, busy = _share_overlaps(keyed)
            for j, ns in share.items():
                total[its[j][2]] += ns
                by_name[its[j][2]][nms[j]] = by_name[its[j][2]].get(nms[j], 0.0) + ns
                if its[j][3]:
                    bwd_total[its[j][2]] += ns
        else:
            busy = 0
            for (_, ns, cat, bwd), nm in zip(its, nms):
                total[cat] += ns
                by_name[cat][nm] = by_name[cat].get(nm, 0.0) + ns
                busy += ns
                if bwd:
                    bwd_total[cat] += ns
        busy = min(busy, wall)
        total["idle"] += wall - busy
        busy_total += busy
        wall_total += wall
    n = len(steps)
    by_cat = {c: v / n for c, v in total.items()}
    # CPU self times can exceed the wall by rounding; keep the parts summing to the step
    by_cat["idle"] = max(0.0, wall_total / n - sum(v for c, v in by_cat.items() if c != "idle"))
    def top(names_ns: dict[str, float], k: int) -> dict[str, float]:
        return dict(sorted(((nm, v / n) for nm, v in names_ns.items()), key=lambda kv: -kv[1])[:k])

    return {"steps": n, "step_ns": wall_total / n, "busy_ns": busy_total / n, "by_category_ns": by_cat,
            "backward_ns": {c: v / n for c, v in bwd_total.items() if v},
            "other_top_ns": top(by_name["other"], 15),
            # what each category's time is made of: its 5 largest work items (kernel < launching op path)
            "top_by_category_ns": {c: top(v, 5) for c, v in by_name.items() if v}}


def attribute(events: list[Ev], *, device: bool) -> dict:
    """Per-step time per category from profiler events containing ``nhb::step`` ranges.

    ``device=True``: work items are device events (kernels, memcpy, memset) attributed through their
    launching CPU op; ``False`` (CPU runs): items are CPU ops' self times. Returns ``{"steps": n,
    "step_ns": mean wall ns, "by_category_ns": {cat: mean ns}, "backward_ns": {cat: ns}, "busy_ns": ns}``,
    categories summing exactly to ``step_ns`` (``idle`` = wall - busy).
    """
    cpu = [e for e in events if not e.device]
    build_cpu_tree(cpu)
    steps = sorted((e for e in cpu if e.name == STEP_RANGE), key=lambda e: e.start)
    if not steps:
        raise ValueError(f"no {STEP_RANGE!r} ranges in the profile")
    fwd = forward_categories(cpu)
    starts = [s.start for s in steps]

    # after the schedule's finalize_model_grads (the last nhb::grad_accum range of a step) the gradients are
    # final: unattributed work from there to the step's end (clipping, norms, copies) is the optimizer's
    opt_from = []
    for st in steps:
        ends = [e.end for e in cpu if e.name == RANGE_PREFIX + "grad_accum" and e.thread == st.thread
                and st.start <= e.start < st.end]
        opt_from.append(max(ends) if ends else st.end)

    def step_of(t: int) -> int | None:
        i = bisect.bisect_right(starts, t) - 1
        return i if i >= 0 and t < steps[i].end else None

    if device:
        items, names = _device_items(events, cpu, steps, step_of, fwd, opt_from)
    else:
        items, names = _cpu_items(cpu, steps, step_of, fwd, opt_from)
    return _sum_steps(steps, items, names, device)


# ------------------------------------------------------------------------------------------- run
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="mamba_ssm,helion",
                   help="comma-separated arms, each backend[:key=value...] (see ab_step_time.py)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per arm (default 3)")
    p.add_argument("--steps", type=int, default=5, help="timed, unprofiled steps per arm (default 5)")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps per arm (default 3)")
    p.add_argument("--trace-dir", default=None, help="also write each arm's chrome trace there")
    p.add_argument("--out", default=None, help="output dir (default $OUT or runs/bench/<gpu>)")
    p.add_argument("--tag", default=None, help="extra name part for the output files")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--host-steps", type=int, default=0,
                   help="also run this many steps per arm under cProfile: the host's Python time per step by function "
                        "(default 0: none)")
    p.add_argument("--host-top", type=int, default=20, help="functions kept per host table (default 20)")
    a = reporting.parse_args_with_overrides(p, argv)
    try:
        a.arm_specs = [parse_arm(x) for x in a.arms]
    except ValueError as e:
        p.error(str(e))
    if not a.arms:
        p.error("--backends needs at least one arm")
    if a.steps < 1 or a.profile_steps < 1 or a.warmup < 0:
        p.error("--steps and --profile-steps must be >= 1, --warmup >= 0")
    if a.host_steps < 0 or a.host_top < 1:
        p.error("--host-steps must be >= 0, --host-top >= 1")
    return a


def compose_cfg(a):
    import torch
    from omegaconf import open_dict

    from nano_hybrid.config import compose

    cfg = compose((GPU_DEFAULTS if torch.cuda.is_available() else CPU_DEFAULTS) + a.overrides)
    user_keys = {o.split("=", 1)[0].lstrip("+~") for o in a.overrides}
    n = len(a.arms) * (a.warmup + a.steps + a.profile_steps + 1)
    with open_dict(cfg):
        if "train.train_iters" not in user_keys:
            cfg.train.train_iters = max(n, int(cfg.optim.warmup_iters) + 1)
        cfg.kernels.backend = a.arm_specs[0].backend
    training.detach_from_run_state(cfg)
    return cfg


def profile_steps(step_fn, n: int, device, trace_path=None) -> list[Ev]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    stats.sync(device)
    with profile(activities=acts) as prof:
        for _ in range(n):
            with torch.profiler.record_function(STEP_RANGE):
                step_fn()
                stats.sync(device)
    if trace_path is not None:
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
    return events_from_profiler(prof)


def _function_label(key: tuple) -> str:
    """cProfile's (file, line, name) as ``package/relative/path.py:line(name)``: the path from the last
    ``site-packages`` (or the checkout) on, so labels read the same on every host."""
    path, line, name = key
    if path == "~":
        return name  # a C function, e.g. {method 'item' of 'torch._C.TensorBase' objects}
    parts = Path(path).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            parts = parts[len(parts) - parts[::-1].index(anchor):]
            break
    else:
        for i, part in enumerate(parts):
            if part in ("nano_hybrid", "kernels"):
                parts = parts[i:]
                break
    return f"{'/'.join(parts)}:{line}({name})"


def host_profile(step_fn, n: int, device, top: int) -> dict:
    """Run ``step_fn`` ``n`` times under cProfile, the device synced around them: the wall time per step and the
    functions with the most own time and the most cumulative time (ms per step). cProfile adds its own cost per
    Python call, so the figures rank where the host's time goes rather than time it exactly."""
    import cProfile
    import pstats

    stats.sync(device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(n):
        step_fn()
    stats.sync(device)
    prof.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)

    def table(col: int) -> list[dict]:
        rows = sorted(st.items(), key=lambda kv: kv[1][col], reverse=True)[:top]
        return [{"function": _function_label(k), "calls_per_step": v[1] / n, "own_ms": v[2] / n * 1e3,
                 "cumulative_ms": v[3] / n * 1e3} for k, v in rows]

    return {"steps": n, "wall_ms_per_step": wall / n * 1e3, "top_own": table(2), "top_cumulative": table(3)}


def run(a) -> dict | None:
    import torch

    cfg = compose_cfg(a)
    with training.scratch_run_dir(cfg, "nano_hybrid_breakdown_"):
        plan = training.validate(cfg)
        backends = arm_backends(cfg, a.arm_specs)
        check_arms(cfg, a.arm_specs, with_optimizer=True)
        labels = stats.arm_labels([x.label for x in a.arm_specs])
        ctx = training.setup(cfg, plan)
        ranges = None
        try:
            replay = training.replay(ctx, training.draw_batches(ctx, plan.num_microbatches))
            dev = plan.device
            ranges = ModuleRanges(training.unwrap_model(ctx.model))
            per_arm = {}
            for spec, lab in zip(a.arm_specs, labels):
                apply_arm(ctx, spec, backends)
                replay.reset()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                for _ in range(a.warmup):
                    training.train_step(ctx)
                times, losses = [], []
                for _ in range(a.steps):
                    dt, out = training.timed_step(training.train_step, ctx, dev)
                    times.append(dt)
                    losses.append(out["loss"])
                trace = None if a.trace_dir is None else Path(a.trace_dir) / f"step_breakdown_{lab}.json"
                with grad_ranges(ctx), optimizer_ranges(ctx.optimizer):
                    events = profile_steps(lambda: training.train_step(ctx), a.profile_steps, dev, trace)
                r = attribute(events, device=dev.type == "cuda")
                host = host_profile(lambda: training.train_step(ctx), a.host_steps, dev, a.host_top) \
                    if a.host_steps else None
                per_arm[lab] = {
                    "arm": {"backend": spec.backend, **dict(spec.overrides)},
                    "measured_step_ms": stats.summarize([t * 1e3 for t in times]),
                    "profiled_step_ms": r["step_ns"] / 1e6,
                    "busy_ms": r["busy_ns"] / 1e6,
                    "by_category_ms": {c: v / 1e6 for c, v in r["by_category_ns"].items()},
                    "backward_ms": {c: v / 1e6 for c, v in r["backward_ns"].items()},
                    "other_top_ms": {k: v / 1e6 for k, v in r["other_top_ns"].items()},
                    "top_by_category_ms": {c: {k: v / 1e6 for k, v in top.items()}
                                           for c, top in r["top_by_category_ns"].items()},
                    "profiled_steps": r["steps"],
                    "losses": losses,
                    # from this arm's warm-up to its profiled steps (the model and optimizer state included)
                    "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
                    **({"host_profile": host} if host else {}),
                }
        finally:
            if ranges is not None:
                ranges.remove()
            training.shutdown(ctx)
    if plan.dims.rank != 0:
        return None
    return {
        "benchmark": "step_breakdown",
        "env": environment.env_info(),
        "args": {k: v for k, v in vars(a).items() if k != "arm_specs"},
        "config": {"model": str(cfg.model.name), "pattern": str(cfg.model.hybrid_override_pattern),
                   "micro_batch_size": int(cfg.train.micro_batch_size),
                   "global_batch_size": int(cfg.train.global_batch_size), "seq_length": plan.seq_length,
                   "dtype": str(plan.dtype).removeprefix("torch."), "device": plan.device.type,
                   "data": str(cfg.data.kind)},
        "world_size": plan.dims.world_size,
        "arms": labels,
        "categories": list(CATEGORIES),
        "descriptions": DESCRIPTIONS,
        "unit": "device time (CUDA kernels) per step" if plan.device.type == "cuda" else "CPU op self time per step",
        "per_arm": per_arm,
    }


def markdown(res: dict) -> str:
    c = res["config"]
    arms = res["arms"]
    lines = [f"# Step breakdown: {', '.join(arms)} on {c['model']} ({res['env'].get('gpu') or 'cpu'})", "",
             reporting.env_markdown(res["env"]), "",
             f"{c['pattern']}, mbs {c['micro_batch_size']}, gbs {c['global_batch_size']}, seq {c['seq_length']}, "
             f"{c['dtype']}. {res['unit']}, ms per step (share of the profiled step); bwd: of which in backward.", ""]
    head = ["category"] + [f"{lab} ms" for lab in arms] + [f"{lab} bwd" for lab in arms]
    rows = []
    for cat in res["categories"]:
        vals = [res["per_arm"][lab]["by_category_ms"].get(cat, 0.0) for lab in arms]
        if not any(v > 0.0005 for v in vals):
            continue
        row = [cat]
        for lab, v in zip(arms, vals):
            row.append(f"{v:.2f} ({100 * v / res['per_arm'][lab]['profiled_step_ms']:.1f}%)")
        row += [f"{res['per_arm'][lab]['backward_ms'].get(cat, 0.0):.2f}" for lab in arms]
        rows.append(row)
    total = ["**sum = profiled step**"] + [f"**{sum(res['per_arm'][lab]['by_category_ms'].values()):.2f}**"
                                           for lab in arms] + [""] * len(arms)
    rows.append(total)
    rows.append(["measured step (median, unprofiled)"]
                + [f"{res['per_arm'][lab]['measured_step_ms']['median']:.2f}" for lab in arms] + [""] * len(arms))
    if any(res["per_arm"][lab].get("peak_mem_gb") for lab in arms):
        rows.append(["peak memory allocated (GiB)"] + [f"{res['per_arm'][lab]['peak_mem_gb']:.1f}" for lab in arms]
                    + [""] * len(arms))
    lines.append(reporting.md_table(head, rows))
    lines += ["", "Categories: " + "; ".join(f"`{k}`: {v}" for k, v in res["descriptions"].items()) + "."]
    for lab in arms:
        h = res["per_arm"][lab].get("host_profile")
        if not h:
            continue
        lines += ["", f"Host (Python) time of `{lab}`, {h['steps']} steps under cProfile, "
                      f"{h['wall_ms_per_step']:.1f} ms per step with the profiler on; ms per step:", ""]
        lines.append(reporting.md_table(
            ["function (most cumulative time)", "calls", "cumulative ms", "own ms"],
            [[f"`{r['function']}`", f"{r['calls_per_step']:.0f}", f"{r['cumulative_ms']:.2f}", f"{r['own_ms']:.2f}"]
             for r in h["top_cumulative"]]))
        lines += [""]
        lines.append(reporting.md_table(
            ["function (most own time)", "calls", "own ms", "cumulative ms"],
            [[f"`{r['function']}`", f"{r['calls_per_step']:.0f}", f"{r['own_ms']:.2f}", f"{r['cumulative_ms']:.2f}"]
             for r in h["top_own"]]))
    return "\n".join(lines)


def plot(res: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = res["arms"]
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(arms), 6))
    bottom = [0.0] * len(arms)
    cmap = plt.get_cmap("tab20")
    for i, cat in enumerate(res["categories"]):
        vals = [res["per_arm"][lab]["by_category_ms"].get(cat, 0.0) for lab in arms]
        if not any(vals):
            continue
        color = "#dddddd" if cat == "idle" else cmap(i % 20)
        ax.bar(range(len(arms)), vals, bottom=bottom, label=cat, color=color, edgecolor="white", linewidth=0.4)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for j, lab in enumerate(arms):
        ax.plot([j - 0.4, j + 0.4], [res["per_arm"][lab]["measured_step_ms"]["median"]] * 2, "k--", linewidth=1)
    ax.set_xticks(range(len(arms)), [lab.replace("+", "\n+") for lab in arms], fontsize=8)
    ax.set_ylabel("ms per step" + (" (device time)" if res["config"]["device"] == "cuda" else " (CPU op time)"))
    ax.set_title(f"{res['config']['model']} step breakdown (dashed: measured step)", fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def output_stem(res: dict, tag: str | None) -> str:
    return reporting.arms_stem("step_breakdown", res, tag)


def main(argv=None) -> int:
    holder = {}

    def stem(res, a):
        holder["a"], holder["res"] = a, res
        return output_stem(res, a.tag)

    rc = reporting.bench_main(argv, parse_args, run, stem, markdown)
    if rc == 0 and "res" in holder and not holder["a"].no_plot:
        a, res = holder["a"], holder["res"]
        out = Path(a.out) if a.out else reporting.default_out_dir()
        print(f"wrote {plot(res, out / (output_stem(res, a.tag) + '.png'))}")
    return rc
