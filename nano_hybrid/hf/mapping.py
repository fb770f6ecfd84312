"""Weight names and layouts: megatron dist-checkpoint tensors <-> Hugging Face Nemotron-H tensors.

Both sides are *global* (unsharded) tensors:

- megatron side: the keys and global shapes of this project's ``torch_dist`` checkpoints (what
  ``MambaModel.sharded_state_dict()`` names after its factories: the Mamba ``in_proj`` weight is stored
  as its ``.z .x .B .C .dt`` components, ``conv1d`` as ``.x .B .C``, the layer pre-norms under the TE
  spec names, grouped experts stacked as ``experts.experts.linear_fc1.weight`` [E, ffn, hidden]). These
  do not depend on the TP/EP/PP layout that saved them.
- Hugging Face side: the published Nemotron-3 Nano layout (``backbone.`` prefix, one 2-D tensor per
  routed expert: ``backbone.layers.{i}.mixer.experts.{e}.up_proj.weight``), which transformers'
  ``NemotronHForCausalLM`` converts on load and vLLM reads as is.

Per layer symbol (``hybrid_override_pattern``), megatron -> HF:

    all   <norm key>                                  -> backbone.layers.{i}.norm.weight
    M     mixer.in_proj.weight.{z,x,B,C,dt} (concat)  -> mixer.in_proj.weight
          mixer.conv1d.{weight,bias}.{x,B,C} (concat) -> mixer.conv1d.{weight,bias}
          mixer.{dt_bias,A_log,D,norm.weight,out_proj.weight} keep their names
    *     self_attention.linear_qkv.weight            -> mixer.{q,k,v}_proj.weight (megatron stores
          [q heads of group g, k_g, v_g] per KV group g, interleaved)
          self_attention.linear_proj.weight           -> mixer.o_proj.weight
    E     mlp.router.weight / .expert_bias            -> mixer.gate.weight / .e_score_correction_bias
          mlp.experts.experts.linear_fc{1,2}.weight   -> mixer.experts.{e}.{up,down}_proj.weight
          mlp.shared_experts.linear_fc{1,2}.weight    -> mixer.shared_experts.{up,down}_proj.weight
    -     mlp.linear_fc{1,2}.weight                   -> mixer.{up,down}_proj.weight

plus ``embedding.word_embeddings.weight`` -> ``backbone.embeddings.weight``,
``decoder.final_norm.weight`` -> ``backbone.norm_f.weight``, ``output_layer.weight`` -> ``lm_head.weight``.
Every tensor on either side must be used exactly once; anything left over is an error. The shapes
come from a :class:`nano_hybrid.arch.HybridArch` (``HybridArch.from_model_cfg(cfg.model)``).
"""

from __future__ import annotations

from typing import Iterable

import torch

from nano_hybrid.arch import HybridArch

HF_PREFIX = "backbone."


class MappingError(ValueError):
    """The tensors do not fit the architecture (missing, extra or mis-shaped); one-line message."""


def _mcore_norm_key(symbol: str, i: int) -> str:
    return {
        "M": f"decoder.layers.{i}.mixer.in_proj.layer_norm_weight",
        "*": f"decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight",
        "E": f"decoder.layers.{i}.pre_mlp_layernorm.weight",
        "-": f"decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight",
    }[symbol]


def _take(src: dict, key: str, used: set) -> torch.Tensor:
    if key not in src:
        raise MappingError(f"tensor {key} is missing")
    used.add(key)
    return src[key]


def _check_all_used(src: dict, used: set, side: str) -> None:
    extra = sorted(set(src) - used)
    if extra:
        raise MappingError(f"{len(extra)} {side} tensor(s) have no counterpart in the architecture, e.g. {extra[:3]}")


def _check_shape(key: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise MappingError(f"tensor {key} has shape {tuple(t.shape)}, the architecture needs {tuple(shape)}")


# ------------------------------------------------------------------------------- megatron -> HF
def _qkv_split(w: torch.Tensor, a: HybridArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, hd = a.num_query_groups, a.kv_channels
    per_group = a.num_attention_heads // g
    w = w.reshape(g, (per_group + 2) * hd, -1)
    q, k, v = torch.split(w, [per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, w.shape[-1]), k.reshape(-1, w.shape[-1]), v.reshape(-1, w.shape[-1])


def mcore_layer_to_hf(src: dict, a: HybridArch, i: int, used: set) -> dict[str, torch.Tensor]:
    """HF tensors of layer ``i`` from the megatron tensors in ``src`` (keys consumed are added to ``used``)."""
    sym = a.hybrid_override_pattern[i]
    p, h = f"decoder.layers.{i}.", f"{HF_PREFIX}layers.{i}."
    out = {f"{h}norm.weight": _take(src, _mcore_norm_key(sym, i), used)}
    if sym == "M":
        out[f"{h}mixer.in_proj.weight"] = torch.cat(
            [_take(src, f"{p}mixer.in_proj.weight.{c}", used) for c in ("z", "x", "B", "C", "dt")], 0)
        for part in ("weight", "bias"):
            out[f"{h}mixer.conv1d.{part}"] = torch.cat(
                [_take(src, f"{p}mixer.conv1d.{part}.{c}", used) for c in ("x", "B", "C")], 0)
        for name in ("dt_bias", "A_log", "D", "norm.weight", "out_proj.weight"):
            out[f"{h}mixer.{name}"] = _take(src, f"{p}mixer.{name}", used)
    elif sym == "*":
        q, k, v = _qkv_split(_take(src, f"{p}self_attention.linear_qkv.weight", used), a)
        out.update({f"{h}mixer.q_proj.weight": q, f"{h}mixer.k_proj.weight": k, f"{h}mixer.v_proj.weight": v})
        out[f"{h}mixer.o_proj.weight"] = _take(src, f"{p}self_attention.linear_proj.weight", used)
    elif sym == "E":
        out[f"{h}mixer.gate.weight"] = _take(src, f"{p}mlp.router.weight", used)
        bias_key = f"{p}mlp.router.expert_bias"
        if bias_key in src:
            out[f"{h}mixer.gate.e_score_correction_bias"] = _take(src, bias_key, used)
        else:  # no aux-loss-free bias in this model: HF's correction bias is zero
            out[f"{h}mixer.gate.e_score_correction_bias"] = torch.zeros(a.num_moe_experts, dtype=torch.float32)
        w1 = _take(src, f"{p}mlp.experts.experts.linear_fc1.weight", used)
        w2 = _take(src, f"{p}mlp.experts.experts.linear_fc2.weight", used)
        if w1.shape[0] != a.num_moe_experts or w2.shape[0] != a.num_moe_experts:
            raise MappingError(f"layer {i}: {w1.shape[0]} experts stored, the architecture has {a.num_moe_experts}")
        for e in range(a.num_moe_experts):
            out[f"{h}mixer.experts.{e}.up_proj.weight"] = w1[e]
            out[f"{h}mixer.experts.{e}.down_proj.weight"] = w2[e]
        out[f"{h}mixer.shared_experts.up_proj.weight"] = _take(src, f"{p}mlp.shared_experts.linear_fc1.weight", used)
        out[f"{h}mixer.shared_experts.down_proj.weight"] = _take(src, f"{p}mlp.shared_experts.linear_fc2.weight", used)
    elif sym == "-":
        out[f"{h}mixer.up_proj.weight"] = _take(src, f"{p}mlp.linear_fc1.weight", used)
        out[f"{h}mixer.down_proj.weight"] = _take(src, f"{p}mlp.linear_fc2.weight", used)
    else:
        raise MappingError(f"layer {i}: unknown layer symbol {sym!r}")
    return out


def mcore_global_to_hf(src: dict, a: HybridArch, layers: Iterable[int] | None = None, *, ends: bool = True,
                       used: set | None = None) -> dict[str, torch.Tensor]:
    """HF tensors from megatron global tensors. ``layers`` (default all) and ``ends`` (embedding, final
    norm, LM head) pick what to convert, so a caller can stream a large model layer by layer; with the
    defaults every tensor of ``src`` must be used."""
    check_all = layers is None and ends and used is None
    used = set() if used is None else used
    out: dict[str, torch.Tensor] = {}
    if ends:
        out[f"{HF_PREFIX}embeddings.weight"] = _take(src, "embedding.word_embeddings.weight", used)
        out[f"{HF_PREFIX}norm_f.weight"] = _take(src, "decoder.final_norm.weight", used)
        if a.tied_embeddings:
            out["lm_head.weight"] = out[f"{HF_PREFIX}embeddings.weight"]
        else:
            out["lm_head.weight"] = _take(src, "output_layer.weight", used)
    for i in range(a.num_layers) if layers is None else layers:
        out.update(mcore_layer_to_hf(src, a, i, used))
    if check_all:
        _check_all_used(src, used, "megatron")
    return out


# ------------------------------------------------------------------------------- HF -> megatron
def hf_to_mcore_global(src, a: HybridArch, layers: Iterable[int] | None = None, *, ends: bool = True,
                       used: set | None = None) -> dict[str, torch.Tensor]:
    """Megatron global tensors from HF tensors in the published layout (``src``: a mapping, e.g.
    ``io.NormalizedHFTensors``, read on access). ``layers`` / ``ends`` / ``used`` as in
    :func:`mcore_global_to_hf`; with the defaults every tensor of ``src`` must be used."""
    check_all = layers is None and ends and used is None
    used = set() if used is None else used
    out: dict[str, torch.Tensor] = {}
    if ends:
        out["embedding.word_embeddings.weight"] = _take(src, f"{HF_PREFIX}embeddings.weight", used)
        out["decoder.final_norm.weight"] = _take(src, f"{HF_PREFIX}norm_f.weight", used)
        if a.tied_embeddings:
            if "lm_head.weight" in src:
                used.add("lm_head.weight")
        else:
            out["output_layer.weight"] = _take(src, "lm_head.weight", used)
    d, bc, nh, hid = a.d_inner, a.bc_width, a.mamba_num_heads, a.hidden_size
    for i in range(a.num_layers) if layers is None else layers:
        sym = a.hybrid_override_pattern[i]
        p, h = f"decoder.layers.{i}.", f"{HF_PREFIX}layers.{i}."
        out[_mcore_norm_key(sym, i)] = _take(src, f"{h}norm.weight", used)
        if sym == "M":
            w = _take(src, f"{h}mixer.in_proj.weight", used)
            _check_shape(f"{h}mixer.in_proj.weight", w, (2 * d + 2 * bc + nh, hid))
            for c, t in zip(("z", "x", "B", "C", "dt"), torch.split(w, [d, d, bc, bc, nh], 0)):
                out[f"{p}mixer.in_proj.weight.{c}"] = t
            for part in ("weight", "bias"):
                t = _take(src, f"{h}mixer.conv1d.{part}", used)
                if t.shape[0] != d + 2 * bc:
                    raise MappingError(f"tensor {h}mixer.conv1d.{part} has {t.shape[0]} channels, the architecture needs {d + 2 * bc}")
                for c, s in zip(("x", "B", "C"), torch.split(t, [d, bc, bc], 0)):
                    out[f"{p}mixer.conv1d.{part}.{c}"] = s
            for name in ("dt_bias", "A_log", "D", "norm.weight", "out_proj.weight"):
                out[f"{p}mixer.{name}"] = _take(src, f"{h}mixer.{name}", used)
        elif sym == "*":
            q = _take(src, f"{h}mixer.q_proj.weight", used)
            k = _take(src, f"{h}mixer.k_proj.weight", used)
            v = _take(src, f"{h}mixer.v_proj.weight", used)
            g, hd = a.num_query_groups, a.kv_channels
            _check_shape(f"{h}mixer.q_proj.weight", q, (a.num_attention_heads * hd, hid))
            _check_shape(f"{h}mixer.k_proj.weight", k, (g * hd, hid))
            _check_shape(f"{h}mixer.v_proj.weight", v, (g * hd, hid))
            qkv = torch.cat([q.reshape(g, -1, hid), k.reshape(g, hd, hid), v.reshape(g, hd, hid)], 1)
            out[f"{p}self_attention.linear_qkv.weight"] = qkv.reshape(-1, hid)
            out[f"{p}self_attention.linear_proj.weight"] = _take(src, f"{h}mixer.o_proj.weight", used)
        elif sym == "E":
            out[f"{p}mlp.router.weight"] = _take(src, f"{h}mixer.gate.weight", used)
            out[f"{p}mlp.router.expert_bias"] = _take(src, f"{h}mixer.gate.e_score_correction_bias", used)
            for n, lin in (("up_proj", "linear_fc1"), ("down_proj", "linear_fc2")):
                out[f"{p}mlp.experts.experts.{lin}.weight"] = torch.stack(
                    [_take(src, f"{h}mixer.experts.{e}.{n}.weight", used) for e in range(a.num_moe_experts)])
                out[f"{p}mlp.shared_experts.{lin}.weight"] = _take(src, f"{h}mixer.shared_experts.{n}.weight", used)
        elif sym == "-":
            out[f"{p}mlp.linear_fc1.weight"] = _take(src, f"{h}mixer.up_proj.weight", used)
            out[f"{p}mlp.linear_fc2.weight"] = _take(src, f"{h}mixer.down_proj.weight", used)
        else:
            raise MappingError(f"layer {i}: unknown layer symbol {sym!r}")
    if check_all:
        _check_all_used(src, used, "Hugging Face")
    return out


def check_all_used(src, used: set, side: str) -> None:
    """After converting piecewise (``layers=`` / ``ends=`` with a shared ``used`` set): nothing left over."""
    _check_all_used(src, used, side)
