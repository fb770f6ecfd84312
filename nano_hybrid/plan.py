"""Memory planner: per-GPU memory of a training run from the config alone (no GPU, no model build).

    python -m nano_hybrid.plan model=nano30b parallel=ep2 plan.gpus=8 train.micro_batch_size=1
    python -m nano_hybrid.plan recipe=nano30b_slice_h200 model.recompute=selective plan.format=json
    python -m nano_hybrid.plan model=nano30b model.num_moe_experts=32 plan.optimizer=false   # fwd+bwd only

Same Hydra config as ``nano_hybrid.train`` (model, parallel, train, plus the ``plan`` group: ``gpus``,
``format``, ``optimizer``). It prints, per GPU (the fullest pipeline stage): parameters, gradients, optimizer states,
activations per layer kind for every recompute choice, the LM-head logits, the peak, the checkpoint
size on disk and a verdict for 80 / 141 / 192 GB GPUs. ``train.memory_check`` (on by default, CUDA
only) makes training refuse to start when ``must_not_fit`` says the run cannot fit the GPU.

What is counted (bytes; a = bytes of the training dtype: 2 for bf16, 4 for fp32)
----------------------------------------------------------------------------------
Static, per parameter held by this GPU (its TP/EP shard of its pipeline stage), as ``train.py`` sets
up megatron (DDP with ``grad_reduce_in_fp32=True``; Adam):

- weights: a; gradients: 4 (DDP's fp32 main-grad buffer);
- optimizer: bf16: 12 (fp32 main weights + Adam m, v), fp32: 8 (m, v); with
  ``use_distributed_optimizer`` divided by the data-parallel size (experts: expert-data-parallel size);
- optimizer step transient: torch's foreach AdamW allocates one fp32 temporary per state tensor of
  the larger of the dense / expert optimizers (4 bytes per main parameter of that optimizer).

Activations: what the backward keeps of one micro-batch, per layer, from the modules' saved tensors
(T = micro_batch_size x seq_length tokens; T_sp = T / TP with sequence parallelism, else T; widths
are per TP rank; ``h`` hidden, ``di`` = mamba heads x head dim, ``D_in`` = 2 di + 2 groups x state +
heads, ``k`` top-k, ``f`` expert FFN, ``fs`` shared-expert FFN, ``E`` experts, ``V`` padded vocab):

- every layer: its input (saved by its pre-norm: a T_sp h + 4 T_sp for the fp32 rstd) and the norm
  output (saved by the next projection: a T_sp h);
- Mamba (M): ``zxBCdt`` and ``out_x`` (saved by the fused split-conv1d-scan op: a T D_in + a T di), the
  gated output before the gated norm and that norm's output (saved by the norm and by out_proj: 2 a T di;
  with ``model.mamba_fused_norm`` the op's norm reads out_x and z, so only the norm's output)
  and the norm's fp32 rstd per group; the helion backend also keeps two fp32 (b, heads, l) tensors
  (``kernels.helion.save_cumsum``) and, with ``kernels.helion.save_conv_states`` (the default), the conv
  output (a T (di + 2 groups x state)) and the states entering each chunk (a T / chunk x di x state), and with
  ``kernels.helion.save_cb`` the forward's C.B^T (a T chunk x groups);
- attention (*): the fused QKV projection output, which the SDPA backward keeps (q, k, v are views:
  a T (heads + 2 groups) kv), the attention output (a T heads kv, saved by the output projection) and the
  fp32 log-sum-exp (4 T heads); ``model.attention_impl=unfused`` (megatron's DotProductAttention) keeps the
  softmax probabilities instead, in fp32 and cast to the training dtype for the product with V
  ((4 + a) mbs heads s^2; 4 mbs heads s^2 in fp32);
- MoE (E), all-gather dispatch (tokens stay local up to EP): the router's fp32 logits / scores / probs
  (~5 x 4 T E), each token's k copies in expert order (a T k h, saved by the first grouped GEMM), the expert
  FFN before and after the activation (2 a T k f), the fp32 routing weights and int64 permutation indices
  (4 + 16 bytes per copy), the shared expert's FFN before and after its activation (2 a T fs);
- dense MLP (-): the FFN before and after the activation (2 a T ffn);
- LM head (last stage): final norm input and output (2 a T_sp h), the fp32 logits the cross-entropy
  keeps (4 T V) and, while the loss is formed and again at the start of the backward, the logits in the
  training dtype beside them (a T V, transient). With ``model.lm_head_loss=chunked``: the kept
  ``softmax - onehot`` in the model dtype (a T V) and, transient, one chunk's logits (chunk x V x (a + 8);
  a + 4 for ``chunked_compiled``) or the output layer's weight gradient (a V h).

Recompute: ``full`` keeps only each layer's input (a T_sp h) and, during one layer's backward, holds that
layer's activations again; ``selective`` drops the pieces its modules rebuild: ``layernorm`` the norm
outputs, ``moe`` everything of an MoE layer except its input and norm output (only its input with
``layernorm`` too), ``shared_experts`` the shared expert's two FFN tensors, ``ssd`` out_x, the gated
output, the rstd (Mamba keeps zxBCdt and the norm output), ``core_attn`` the log-sum-exp (the SDPA
output stays as out-projection input), ``mlp`` the dense FFN tensors.

Peak per GPU = static + in-flight micro-batches x (sum of the stage's layer activations + head) + the
largest backward transient (the LM-head logits in the training dtype, or one layer's backward work
space, taken as that layer's activations, plus whatever of them recompute rebuilds). Pipeline stage
``r`` of ``PP`` holds up to ``min(PP - r, micro-batches)`` micro-batches (1F1B). The allocator's
fragmentation and the CUDA context are not in ``torch.cuda.max_memory_allocated``; the verdict keeps a
margin for them (``FIT_MARGIN``, ``CONTEXT_GIB``).

Accuracy: the peaks agree within 5% with ``torch.cuda.max_memory_allocated`` of six training runs on
H200s (``tests/test_plan.py``: 5 and 13 Nano-width layers, micro-batch 1-4, seq 1024-8192, one GPU and
DP2 / EP2 / TP2+SP, no recompute); ``scripts/plan_vs_measured.py`` measures more layouts and the
recompute choices on a GPU.

Checkpoint on disk (:mod:`nano_hybrid.checkpoint`, megatron dist_checkpointing): the weights in the training dtype
plus the optimizer states (fp32 main weights for bf16 and Adam m, v) of the whole model.
"""

from __future__ import annotations

import json
import math
import sys
import warnings

# megatron-core (imported through the parallel-layout checks) warns that TE/Apex are absent; not relevant here
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
from dataclasses import asdict, dataclass, field
from typing import Any

from omegaconf import DictConfig

from nano_hybrid.arch import HybridArch
from nano_hybrid.config import ConfigError
from nano_hybrid.errors import EXIT_BAD_INPUT
from nano_hybrid.layout import LaunchEnv, ParallelDims
from nano_hybrid.model.config import MODEL_DEFAULTS, RECOMPUTE_CHOICES, check_model_cfg, model_dict, recompute_settings
from nano_hybrid.schema import check_numbers, positive_int

GIB = 1024**3
# GPUs of the verdict: name -> memory torch reports as total_memory (GiB)
GPUS = {"80 GB (H100/A100)": 79.2, "141 GB (H200)": 139.8, "192 GB (B200)": 178.4}
# The verdict's margins, from the out-of-memory errors of a 52-layer 16-expert forward+backward A/B (both backends in
# one process, the default allocator) on two 80 GB H100 machines, once each (benchmarks/step_h100_202612.md): the
# allocator held 2.5-3.5 GiB reserved but unallocated (fragmentation) and 7.8 GiB of the card was in use outside the
# allocator (not attributed; the CUDA context and loaded kernel modules are in it). That run's plan, 70.7 GiB, is
# "tight" with these margins; the nano30b_slice step with helion (planned 67.9 GiB, measured 67.0 GiB) is "tight" too,
# 0.4 GiB past them, and runs on the same card. The same 7.8 GiB is kept on every card and layout.
FIT_MARGIN = 0.05  # fraction of the GPU kept for allocator fragmentation
CONTEXT_GIB = 7.8  # device memory outside PyTorch's allocator (outside max_memory_allocated)
SURE_FACTOR = 0.9  # must_not_fit: even 90% of the planned peak exceeds the GPU's memory


@dataclass
class Shape:
    """The planner's input: the architecture (its vocabulary padded for ``tp``) and the run's layout,
    micro-batch, dtype and LM-head loss."""

    arch: HybridArch
    seq: int
    mbs: int
    a: int  # bytes per activation / weight element
    dims: ParallelDims  # the layout planned for (training's own record in its memory check)
    num_microbatches: int
    backend: str
    optimizer: bool  # plan.optimizer=false: forward+backward only (no optimizer states, no step)
    lm_head_loss: str  # plain | chunked | chunked_compiled (model.lm_head_loss)
    lm_chunk: int  # model.lm_loss_chunk_tokens
    helion_keeps: tuple[str, ...] = ()  # what the helion op keeps beyond mamba-ssm's: "cumsum", "conv_states", "cb"
    attention_impl: str = "sdpa"  # model.attention_impl: unfused keeps the (s x s) softmax probabilities
    mamba_fused_norm: bool = False  # model.mamba_fused_norm: the op keeps the norm's rstd; no gated output is kept

    tp = property(lambda self: self.dims.tp)
    pp = property(lambda self: self.dims.pp)
    ep = property(lambda self: self.dims.ep)
    etp = property(lambda self: self.dims.etp)
    dp = property(lambda self: self.dims.dp)
    edp = property(lambda self: self.dims.edp)
    sp = property(lambda self: self.dims.sp)
    dist_opt = property(lambda self: self.dims.dist_opt)


# ------------------------------------------------------------------------------------------ params
def layer_params(s: Shape, kind: str) -> tuple[int, int]:
    """(dense, expert) parameter counts of one layer of ``kind`` for the whole model (unsharded)."""
    ar = s.arch
    h = ar.hidden_size
    if kind == "M":
        conv_ch, di, heads = ar.conv_channels, ar.d_inner, ar.mamba_num_heads
        return h + h * ar.in_proj_width + conv_ch * ar.mamba_conv_width + conv_ch + 3 * heads + di + di * h, 0
    if kind == "*":
        heads, kv = ar.num_attention_heads, ar.kv_channels
        return h + h * (heads + 2 * ar.num_query_groups) * kv + heads * kv * h, 0
    if kind == "E":
        experts = ar.num_moe_experts
        shared = 2 * h * ar.moe_shared_expert_intermediate_size
        return h + experts * h + shared, experts * 2 * h * ar.moe_ffn_hidden_size
    if kind == "-":
        return h + 2 * h * ar.ffn_hidden_size, 0
    raise ValueError(kind)


def local_layer_params(s: Shape, kind: str) -> tuple[float, float]:
    """(dense, expert) parameters of one layer held by one GPU (its TP / EP x ETP shard)."""
    dense, expert = layer_params(s, kind)
    h = s.arch.hidden_size
    replicated = h  # the pre-norm
    if kind == "E":
        replicated += s.arch.num_moe_experts * h  # router
    return replicated + (dense - replicated) / s.tp, expert / (s.ep * s.etp)


def stage_layers(s: Shape) -> list[str]:
    pattern = s.arch.hybrid_override_pattern
    n = len(pattern) // s.pp
    return [pattern[i * n:(i + 1) * n] for i in range(s.pp)]


def stage_params(s: Shape, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters on one GPU of pipeline stage ``stage``."""
    dense = expert = 0.0
    for kind in stage_layers(s)[stage]:
        d, e = local_layer_params(s, kind)
        dense, expert = dense + d, expert + e
    vocab, h = s.arch.padded_vocab_size, s.arch.hidden_size
    if stage == 0:
        dense += vocab * h / s.tp
    if stage == s.pp - 1:
        dense += h  # final norm
        if not s.arch.tied_embeddings or s.pp > 1:
            dense += vocab * h / s.tp
    return dense, expert


def total_params(s: Shape) -> tuple[int, int]:
    ar = s.arch
    dense = ar.padded_vocab_size * ar.hidden_size * (1 if ar.tied_embeddings else 2) + ar.hidden_size
    expert = 0
    for kind in ar.hybrid_override_pattern:
        d, e = layer_params(s, kind)
        dense, expert = dense + d, expert + e
    return dense, expert


# ------------------------------------------------------------------------------------- activations
def layer_activations(s: Shape, kind: str, modules: tuple[str, ...] = ()) -> dict[str, float]:
    """Bytes one layer keeps for the backward of one micro-batch, by piece (``modules``: the selective
    recompute list; pieces it rebuilds are left out)."""
    a, t = s.a, s.mbs * s.seq
    tsp = t / s.tp if s.sp else t
    ar = s.arch
    h = ar.hidden_size
    rec = set(modules)
    out: dict[str, float] = {"input": a * tsp * h + 4 * tsp}
    if "layernorm" not in rec:
        out["norm_out"] = a * tsp * h
    if kind == "M":
        di, d_in = ar.d_inner / s.tp, ar.in_proj_width / s.tp
        out["zxBCdt"] = a * t * d_in
        if "ssd" not in rec:
            out["out_x"] = a * t * di
            # the gated output (the norm module's input) and the norm's fp32 rstd; with the norm in the op, the rstd
            out["gated_y"] = (0 if s.mamba_fused_norm else a * t * di) + 4 * t * max(1, ar.mamba_num_groups // s.tp)
            if "cumsum" in s.helion_keeps:
                out["cumsum"] = 2 * 4 * t * ar.mamba_num_heads / s.tp
            if "conv_states" in s.helion_keeps:  # conv output and the states entering each chunk, x's dtype
                c = ar.mamba_chunk_size
                tc = s.mbs * math.ceil(s.seq / c) * c
                out["conv_states"] = (a * tc * (ar.d_inner + 2 * ar.mamba_num_groups * ar.mamba_state_dim) / s.tp
                                      + a * tc / c * ar.d_inner * ar.mamba_state_dim / s.tp)
            if "cb" in s.helion_keeps:  # the forward's C.B^T, (b, nc, g, c, c) in x's dtype
                c = ar.mamba_chunk_size
                tc = s.mbs * math.ceil(s.seq / c) * c
                out["cb"] = a * tc * c * max(1, ar.mamba_num_groups // s.tp)
        out["y_norm"] = a * t * di
    elif kind == "*":
        heads, groups = ar.num_attention_heads / s.tp, max(1, ar.num_query_groups // s.tp)
        out["qkv"] = a * t * (heads + 2 * groups) * ar.kv_channels
        out["attn_out"] = a * t * heads * ar.kv_channels
        if "core_attn" not in rec:
            if s.attention_impl == "unfused":  # softmax in fp32 (kept), cast to the training dtype for probs x V
                out["attn_probs"] = (4 + (a if a != 4 else 0)) * s.mbs * heads * s.seq * s.seq
            else:
                out["lse"] = 4 * t * heads
    elif kind == "E":
        if "moe" in rec:
            if "layernorm" not in rec:
                out["norm_out"] = a * tsp * h  # the MoE checkpoint's input
        else:
            # tokens of this rank's experts: T k on average (EP spreads them; all-gather at TP/SP)
            copies = t * ar.moe_router_topk
            out["router"] = 5 * 4 * t * ar.num_moe_experts
            out["expert_in"] = a * copies * h
            out["expert_ffn"] = 2 * a * copies * ar.moe_ffn_hidden_size / s.etp
            out["probs_idx"] = (4 + 16) * copies
            if "shared_experts" not in rec:
                out["shared_ffn"] = 2 * a * t * ar.moe_shared_expert_intermediate_size / s.tp
    elif kind == "-":
        if "mlp" not in rec:
            out["ffn"] = 2 * a * t * ar.ffn_hidden_size / s.tp
    return out


def head_activations(s: Shape) -> dict[str, float]:
    a, t = s.a, s.mbs * s.seq
    tsp = t / s.tp if s.sp else t
    vocab = s.arch.padded_vocab_size
    out = {"final_norm": 2 * a * tsp * s.arch.hidden_size + 4 * tsp}
    if s.lm_head_loss.startswith("chunked"):  # chunked | chunked_compiled
        out["softmax_minus_onehot"] = a * t * vocab  # D = softmax - onehot in the model dtype
    else:
        out["logits_fp32"] = 4 * t * vocab / s.tp
    return out


def head_transient(s: Shape) -> float:
    """plain: the logits in the training dtype beside the fp32 ones (none in fp32: .float() is a no-op);
    chunked: one chunk's logits in the model dtype plus two fp32 copies (one for chunked_compiled), or the
    output-layer weight gradient in the model dtype in the backward, whichever is larger."""
    t, vocab = s.mbs * s.seq, s.arch.padded_vocab_size
    if s.lm_head_loss.startswith("chunked"):  # chunked | chunked_compiled
        # eager: the chunk's logits, their fp32 copy and logsumexp's fp32 work space; compiled: fused
        per_logit = s.a + (4 if s.lm_head_loss == "chunked_compiled" else 8)
        return max(min(s.lm_chunk, t) * vocab * per_logit, s.a * vocab * s.arch.hidden_size)
    return 0.0 if s.a == 4 else s.a * t * vocab / s.tp


@dataclass
class StagePlan:
    stage: int
    layers: str
    in_flight: int
    params_dense: float
    params_expert: float
    weights: float
    grads: float
    optimizer: float
    optimizer_step_transient: float
    activations_by_kind: dict = field(default_factory=dict)  # kind -> bytes per micro-batch (all layers of that kind)
    head: float = 0.0
    transient: float = 0.0
    activations: float = 0.0  # in-flight micro-batches x (layers + head)
    fwd_bwd_peak: float = 0.0  # static + activations + backward transient
    step_peak: float = 0.0  # static + optimizer-step transient
    peak: float = 0.0  # the larger of the two


def plan_stage(s: Shape, stage: int, choice: str, modules: tuple[str, ...]) -> StagePlan:
    dense, expert = stage_params(s, stage)
    p = dense + expert
    weights, grads = s.a * p, 4 * p
    per_param_opt = (12 if s.a == 2 else 8) if s.optimizer else 0
    opt_dense = per_param_opt * dense / (s.dp if s.dist_opt else 1)
    opt_expert = per_param_opt * expert / (s.edp if s.dist_opt else 1)
    step_transient = 4 * max(dense / (s.dp if s.dist_opt else 1), expert / (s.edp if s.dist_opt else 1)) \
        if s.optimizer else 0.0
    layers = stage_layers(s)[stage]
    in_flight = min(s.pp - stage, s.num_microbatches)
    by_kind: dict[str, float] = {}
    workspace = 0.0
    for kind in layers:
        full_set = sum(layer_activations(s, kind).values())
        if choice == "full":
            kept = s.a * (s.mbs * s.seq / (s.tp if s.sp else 1)) * s.arch.hidden_size
        else:
            kept = sum(layer_activations(s, kind, modules).values())
        # during this layer's backward: the activations recompute rebuilds plus the gradient work space
        # (taken as large as the layer's activations)
        workspace = max(workspace, full_set + (full_set - kept))
        by_kind[kind] = by_kind.get(kind, 0.0) + kept
    head = sum(head_activations(s).values()) if stage == s.pp - 1 else 0.0
    transient = max(head_transient(s) if stage == s.pp - 1 else 0.0, workspace)
    acts = in_flight * (sum(by_kind.values()) + head)
    train_peak = weights + grads + opt_dense + opt_expert + acts + transient
    step_peak = weights + grads + opt_dense + opt_expert + step_transient
    return StagePlan(
        stage=stage, layers=layers, in_flight=in_flight, params_dense=dense, params_expert=expert,
        weights=weights, grads=grads, optimizer=opt_dense + opt_expert, optimizer_step_transient=step_transient,
        activations_by_kind=by_kind, head=head, transient=transient, activations=acts,
        fwd_bwd_peak=train_peak, step_peak=step_peak, peak=max(train_peak, step_peak),
    )


# ------------------------------------------------------------------------------------------ config
def shape_from_cfg(cfg: DictConfig, world_size: int | None = None, *, optimizer: bool | None = None,
                   dims: ParallelDims | None = None) -> tuple[Shape, int]:
    """The planner's view of a composed config (validated like training's) and the world size it plans for:
    ``dims`` (a run's own layout record), else the layout of ``cfg.parallel`` on ``world_size`` GPUs (default
    ``plan.gpus``, else the smallest world the layout fills)."""
    m = model_dict(cfg.model)
    check_model_cfg(m)
    _check_plan_numbers(cfg)
    if dims is None:
        if world_size is None:
            p = cfg.parallel
            tp, pp, cp = int(p.tensor_model_parallel_size), int(p.pipeline_model_parallel_size), int(p.context_parallel_size)
            ep, etp = int(p.expert_model_parallel_size), int(p.expert_tensor_parallel_size)
            gpus = cfg.plan.gpus
            world_size = int(gpus) if gpus is not None else _lcm(tp * pp * cp, etp * ep * pp)
        dims = ParallelDims.build(cfg, LaunchEnv.planned(world_size))
    mbs, gbs = int(cfg.train.micro_batch_size), int(cfg.train.global_batch_size)
    if gbs % (mbs * dims.dp):
        raise ConfigError(f"train.global_batch_size={gbs} must be a multiple of train.micro_batch_size={mbs} "
                          f"x data-parallel size {dims.dp}")
    if optimizer is None:
        optimizer = cfg.plan.optimizer
        if not isinstance(optimizer, bool):
            raise ConfigError(f"plan.optimizer={optimizer!r} must be true or false")
    precision = str(cfg.train.precision)
    if precision == "auto":
        device = str(cfg.train.device)
        precision = "fp32" if device == "cpu" else "bf16"
    return Shape(
        arch=HybridArch.from_model_cfg(m, dims.tp),
        seq=int(cfg.train.seq_length), mbs=mbs, a=2 if precision == "bf16" else 4, dims=dims,
        num_microbatches=gbs // (mbs * dims.dp), backend=str(cfg.kernels.backend),
        optimizer=optimizer, lm_head_loss=m["lm_head_loss"], lm_chunk=m["lm_loss_chunk_tokens"],
        helion_keeps=_helion_keeps(cfg), attention_impl=str(m["attention_impl"]),
        mamba_fused_norm=bool(m["mamba_fused_norm"]),
    ), dims.world_size


PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                  "expert_tensor_parallel_size", "context_parallel_size")


def _check_plan_numbers(cfg) -> None:
    """The numbers the planner reads, checked as training checks them (ConfigError naming the key)."""
    check_numbers(cfg)
    for key in ("train.micro_batch_size", "train.global_batch_size", "train.seq_length",
                *(f"parallel.{k}" for k in PARALLEL_SIZES)):
        positive_int(cfg, key)
    gpus = cfg.plan.gpus
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus <= 0):
        raise ConfigError(f"plan.gpus={gpus!r} must be a positive integer or null")
    if str(cfg.train.precision) not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"train.precision={cfg.train.precision!r}; choose auto, bf16 or fp32")


def _helion_keeps(cfg) -> tuple[str, ...]:
    """The helion op's extra saved tensors under the run's ``kernels.helion`` settings (none for other backends)."""
    if str(cfg.kernels.backend) != "helion":
        return ()
    from kernels.settings import HelionSettings, HelionSettingsError

    try:
        st = HelionSettings.from_mapping(cfg.kernels.get("helion") or {})
    except HelionSettingsError as e:
        raise ConfigError(str(e)) from None
    return tuple(k for k, on in (("cumsum", st.save_cumsum), ("conv_states", st.save_conv_states),
                                 ("cb", st.save_cb)) if on)


def _lcm(x: int, y: int) -> int:
    return x * y // math.gcd(x, y)


def make_plan(cfg: DictConfig, world_size: int | None = None, *, optimizer: bool | None = None,
              dims: ParallelDims | None = None) -> dict[str, Any]:
    """The full plan as a dict: per recompute choice the fullest stage's memory, the configured choice's
    stages, checkpoint size, verdicts. ``optimizer``: None takes ``plan.optimizer`` (default true); ``dims`` and
    ``world_size`` as for ``shape_from_cfg``."""
    s, world = shape_from_cfg(cfg, world_size, optimizer=optimizer, dims=dims)
    m = model_dict(cfg.model)
    choice, modules = recompute_settings(m)
    selective_modules = modules or tuple(m["recompute_modules"] or MODEL_DEFAULTS["recompute_modules"])
    choices = {"none": ("none", ()), "selective": ("selective", selective_modules), "full": ("full", ())}
    by_choice = {}
    for name in RECOMPUTE_CHOICES:
        c, mods = choices[name]
        stages = [plan_stage(s, r, c, mods) for r in range(s.pp)]
        worst = max(stages, key=lambda x: x.peak)
        by_choice[name] = {"modules": list(mods), "peak_gib": worst.peak / GIB, "stage": worst.stage,
                           "activations_gib": worst.activations / GIB}
    stages = [plan_stage(s, r, choice, modules) for r in range(s.pp)]
    worst = max(stages, key=lambda x: x.peak)
    dense, expert = total_params(s)
    ckpt = (dense + expert) * (s.a + (12 if s.a == 2 else 8))
    verdict = {name: fit_verdict(worst.peak, cap) for name, cap in GPUS.items()}
    return {
        "model": str(m["name"]), "pattern": s.arch.hybrid_override_pattern, "world_size": world,
        "layout": {"tp": s.tp, "pp": s.pp, "ep": s.ep, "etp": s.etp, "dp": s.dp, "edp": s.edp, "sp": s.sp,
                   "distributed_optimizer": s.dist_opt},
        "micro_batch_size": s.mbs, "seq_length": s.seq, "num_microbatches": s.num_microbatches,
        "dtype": "bf16" if s.a == 2 else "fp32", "optimizer": s.optimizer, "recompute": choice, "recompute_modules": list(modules),
        "params_total": dense + expert, "params_expert_total": expert,
        "stages": [_stage_dict(x) for x in stages],
        "peak_gib": worst.peak / GIB, "peak_stage": worst.stage,
        "by_recompute": by_choice,
        "checkpoint_gib": ckpt / GIB,
        "verdict": verdict,
    }


def _stage_dict(x: StagePlan) -> dict:
    d = asdict(x)
    for k in ("weights", "grads", "optimizer", "optimizer_step_transient", "head", "transient", "activations",
              "fwd_bwd_peak", "step_peak", "peak"):
        d[k + "_gib"] = d.pop(k) / GIB
    d["activations_by_kind_gib"] = {k: v / GIB for k, v in d.pop("activations_by_kind").items()}
    return d


def outside_allocator_gib(device=None) -> float:
    """GiB of the CUDA device ``device`` in use but not reserved by PyTorch's caching allocator, now: what
    ``CONTEXT_GIB`` stands for (the CUDA context, loaded kernel modules, library workspaces outside the allocator), plus
    any other process's memory on the same device. Benchmarks record it beside their peaks, to check the margin."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return ((total - free) - torch.cuda.memory_reserved(device)) / GIB


def fit_verdict(peak_bytes: float, capacity_gib: float) -> str:
    need = peak_bytes / GIB
    usable = capacity_gib * (1 - FIT_MARGIN) - CONTEXT_GIB
    if need <= usable:
        return "fits"
    if need <= capacity_gib:
        return "tight"
    return "does not fit"


def must_not_fit(plan: dict, capacity_bytes: float) -> bool:
    """True when even ``SURE_FACTOR`` of the planned peak is above the GPU's total memory."""
    return SURE_FACTOR * plan["peak_gib"] * GIB > capacity_bytes


def check_memory(cfg: DictConfig, dims: ParallelDims, capacity_bytes: float) -> None:
    """Training's start-up check (``train.memory_check``) for the run's layout ``dims``: ``ConfigError`` when the
    run cannot fit."""
    plan = make_plan(cfg, optimizer=True, dims=dims)
    if must_not_fit(plan, capacity_bytes):
        st = plan["stages"][plan["peak_stage"]]
        raise ConfigError(
            f"the memory planner puts this run at {plan['peak_gib']:.1f} GiB per GPU (pipeline stage {st['stage']}: "
            f"weights+grads+optimizer {st['weights_gib'] + st['grads_gib'] + st['optimizer_gib']:.1f}, activations "
            f"{st['activations_gib']:.1f}, backward transient {st['transient_gib']:.1f}), above this GPU's "
            f"{capacity_bytes / GIB:.1f} GiB; see python -m nano_hybrid.plan with the same overrides for layouts "
            f"that fit (more GPUs, recompute, a smaller micro-batch), or set train.memory_check=false to start anyway")


def format_text(plan: dict) -> str:
    lay = plan["layout"]
    lines = [
        f"model {plan['model']} ({plan['params_total'] / 1e9:.2f}B params, {len(plan['pattern'])} layers) on "
        f"{plan['world_size']} GPU(s): TP{lay['tp']} PP{lay['pp']} EP{lay['ep']} ETP{lay['etp']} DP{lay['dp']}"
        f"{' SP' if lay['sp'] else ''}{' dist-opt' if lay['distributed_optimizer'] else ''}; "
        f"micro-batch {plan['micro_batch_size']} x {plan['seq_length']} tokens, {plan['num_microbatches']} "
        f"micro-batch(es) per step, {plan['dtype']}, recompute={plan['recompute']}"
        + ("" if plan["optimizer"] else ", forward+backward only (plan.optimizer=false)")
        + (f" {plan['recompute_modules']}" if plan["recompute_modules"] else ""),
        "",
        f"{'per GPU (GiB)':<20}" + "".join(f"{'stage ' + str(x['stage']):>12}" for x in plan["stages"]),
    ]

    def row(label, key, fmt="{:>12.2f}"):
        lines.append(f"{label:<20}" + "".join(fmt.format(x[key]) for x in plan["stages"]))

    def counts(layers: str) -> str:
        return " ".join(f"{layers.count(k)}{k}" for k in "ME*-" if k in layers)

    lines.append(f"{'layers':<20}" + "".join(f"{counts(x['layers']):>12}" for x in plan["stages"]))
    lines.append(f"{'params (M)':<20}" + "".join(f"{(x['params_dense'] + x['params_expert']) / 1e6:>12.1f}"
                                                 for x in plan["stages"]))
    row("weights", "weights_gib")
    row("gradients (fp32)", "grads_gib")
    row("optimizer states", "optimizer_gib")
    kinds = sorted({k for x in plan["stages"] for k in x["activations_by_kind_gib"]}, key="ME*-".index)
    names = {"M": "act Mamba", "*": "act attention", "E": "act MoE", "-": "act MLP"}
    for k in kinds:
        lines.append(f"{names[k] + ' /mb':<20}" + "".join(f"{x['activations_by_kind_gib'].get(k, 0.0):>12.2f}"
                                                          for x in plan["stages"]))
    row("act LM head /mb", "head_gib")
    lines.append(f"{'in-flight mb':<20}" + "".join(f"{x['in_flight']:>12d}" for x in plan["stages"]))
    row("activations", "activations_gib")
    row("bwd transient", "transient_gib")
    row("peak", "peak_gib")
    lines += ["", "peak per recompute choice (fullest stage):"]
    for name, r in plan["by_recompute"].items():
        mods = f" {r['modules']}" if r["modules"] else ""
        lines.append(f"  {name + mods:<34} {r['peak_gib']:8.2f} GiB (activations {r['activations_gib']:.2f})")
    lines += ["", f"checkpoint on disk: {plan['checkpoint_gib']:.1f} GiB (weights + optimizer states)", "verdict:"]
    for gpu, v in plan["verdict"].items():
        lines.append(f"  {gpu:<18} {v}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from nano_hybrid.config import compose, help_requested, overrides_from_argv

    argv = sys.argv[1:] if argv is None else argv
    if help_requested(argv, __doc__):
        return 0
    try:
        cfg = compose(overrides_from_argv(argv))
        fmt = cfg.plan.format
        if fmt not in ("text", "json"):
            raise ConfigError(f"plan.format={fmt!r}; choose text or json")
        plan = make_plan(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(plan, indent=2) if fmt == "json" else format_text(plan))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
