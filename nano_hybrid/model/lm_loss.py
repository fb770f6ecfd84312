"""LM head + cross-entropy: megatron's plain path, or a chunked one that never holds the full fp32 logits.

``model.lm_head_loss``:

- ``plain``: megatron's ``MambaModel`` tail: the output layer writes the full ``[s, b, vocab]`` logits,
  ``vocab_parallel_cross_entropy`` turns them into fp32 (at 16k tokens x 131k vocab about 8.6 GB) and keeps
  the fp32 softmax for the backward.
- ``chunked``: ``ChunkedLinearCrossEntropy``: the logits of ``model.lm_loss_chunk_tokens`` tokens at a time
  (matmul in the model dtype, softmax statistics in fp32), the per-token loss, and the gradient of the loss
  with respect to the logits, ``softmax - onehot``, kept in the model dtype ([tokens, vocab] bf16 on GPU).
  The backward needs no elementwise pass over the vocabulary: the upstream per-token gradient ``g`` scales
  rows, so ``d hidden = g * (D @ W)`` and ``d W = D^T @ (g * hidden)`` are two plain matmuls.
  Same per-token loss as the plain path (megatron's semantics: no ignore index, no label smoothing; the
  loss mask is applied by the caller). Tensor parallelism (vocab-parallel logits) is not supported: the
  config check refuses ``tensor_model_parallel_size > 1``.
- ``chunked_compiled``: the same, with each chunk's softmax statistics, loss and ``D`` in two kernels that
  ``torch.compile`` generates (``chunk_loss_and_dlogits``: one reduction pass and one elementwise pass over
  the chunk's logits instead of eager torch's separate cast, logsumexp, subtract, exp, scatter and cast).
"""

from __future__ import annotations

import torch
from megatron.core.models.mamba import MambaModel

from nano_hybrid.schema import ModelSchema, optional_defaults

LM_HEAD_LOSSES = ("plain", "chunked", "chunked_compiled")
# the schema's defaults (nano_hybrid/schema.py ModelSchema), for callers outside a config
DEFAULT_LM_HEAD_LOSS = optional_defaults(ModelSchema)["lm_head_loss"]
DEFAULT_CHUNK_TOKENS = optional_defaults(ModelSchema)["lm_loss_chunk_tokens"]
PROFILE_RANGE = "nano_hybrid::lm_head_loss"  # record_function name around the chunked head (step breakdown)


def lm_head_settings(m: dict) -> tuple[str, int]:
    """(``model.lm_head_loss``, ``model.lm_loss_chunk_tokens``) from a model dict (``model_dict``: every key
    present); ``ValueError`` naming the key."""
    choice = m["lm_head_loss"]
    if choice not in LM_HEAD_LOSSES:
        raise ValueError(f"model.lm_head_loss={choice!r}; choose one of {', '.join(LM_HEAD_LOSSES)}")
    chunk = m["lm_loss_chunk_tokens"]
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        raise ValueError(f"model.lm_loss_chunk_tokens={chunk!r} must be a positive integer")
    return choice, chunk


def check_lm_head_parallel(m: dict, tensor_model_parallel_size: int) -> None:
    """The chunked head computes the full vocabulary on each rank: refuse tensor parallelism."""
    choice = m["lm_head_loss"]
    if choice not in LM_HEAD_LOSSES:
        raise ValueError(f"model.lm_head_loss={choice!r}; choose one of {', '.join(LM_HEAD_LOSSES)}")
    if choice != "plain" and tensor_model_parallel_size > 1:
        raise ValueError(
            f"model.lm_head_loss={choice} needs parallel.tensor_model_parallel_size=1 (got {tensor_model_parallel_size}): "
            "its logits are not vocab-parallel; use model.lm_head_loss=plain with TP")


def chunk_loss_and_dlogits(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss (fp32) and ``softmax - onehot`` (in ``logits.dtype``) of one chunk ``[c, V]`` (functional:
    the form ``torch.compile`` fuses)."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    loss = lse - lf.gather(1, target[:, None]).squeeze(1)
    cols = torch.arange(lf.shape[1], device=lf.device)
    d = torch.exp(lf - lse[:, None]) - (cols[None, :] == target[:, None]).to(lf.dtype)
    return loss, d.to(logits.dtype)


def chunk_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token loss (fp32) of one chunk ``[c, V]``."""
    lf = logits.float()
    return torch.logsumexp(lf, dim=-1) - lf.gather(1, target[:, None]).squeeze(1)


_COMPILED: dict = {}


def compiled(fn):
    """``torch.compile(fn)`` once per process (static shapes: the last, shorter chunk is a second graph)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Per-token ``cross_entropy(hidden @ weight.T, labels)`` computed ``chunk_tokens`` tokens at a time.

    hidden ``[T, h]``, weight ``[V, h]`` (same dtype), labels ``[T]`` int64 in ``[0, V)``; returns the fp32
    per-token loss ``[T]``. Forward keeps ``D = softmax - onehot`` ``[T, V]`` in the weight's dtype.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                grad_enabled: bool = True, use_compile: bool = False):
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be [T, h] and [V, h]")
        if labels.shape != hidden.shape[:1]:
            raise ValueError(f"labels {tuple(labels.shape)} must be [T] with T = {hidden.shape[0]}")
        n_tok, vocab = hidden.shape[0], weight.shape[0]
        # grad mode is off inside forward: the caller passes whether it was on (no D under torch.no_grad)
        need_grad = grad_enabled and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        loss = torch.empty(n_tok, dtype=torch.float32, device=hidden.device)
        dlogits = torch.empty(n_tok, vocab, dtype=weight.dtype, device=hidden.device) if need_grad else None
        labels = labels.long()
        if use_compile:
            fused_grad, fused_loss = compiled(chunk_loss_and_dlogits), compiled(chunk_loss)
            for s in range(0, n_tok, chunk_tokens):
                e = min(n_tok, s + chunk_tokens)
                logits = torch.mm(hidden[s:e], weight.t())
                if need_grad:
                    loss[s:e], dlogits[s:e] = fused_grad(logits, labels[s:e])
                else:
                    loss[s:e] = fused_loss(logits, labels[s:e])
                del logits
            ctx.save_for_backward(hidden, weight, dlogits)
            return loss
        for s in range(0, n_tok, chunk_tokens):
            e = min(n_tok, s + chunk_tokens)
            tgt = labels[s:e, None]
            lf = torch.mm(hidden[s:e], weight.t()).float()  # [c, V] fp32 (a copy on bf16; the matmul's output on fp32)
            lse = torch.logsumexp(lf, dim=-1)
            loss[s:e] = lse - lf.gather(1, tgt).squeeze(1)
            if need_grad:
                lf.sub_(lse[:, None]).exp_()  # softmax
                lf.scatter_add_(1, tgt, torch.full_like(tgt, -1, dtype=lf.dtype))
                dlogits[s:e].copy_(lf)
            del lf
        ctx.save_for_backward(hidden, weight, dlogits)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, dlogits = ctx.saved_tensors
        g = grad_loss.float()[:, None]
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = (torch.mm(dlogits, weight).float() * g).to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.mm(dlogits.t(), (hidden.float() * g).to(hidden.dtype))
        return grad_hidden, grad_weight, None, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, use_compile: bool = False) -> torch.Tensor:
    """Per-token loss of ``hidden [..., h]`` against ``labels [...]`` (same leading shape), fp32."""
    lead = labels.shape
    loss = ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                           int(chunk_tokens), torch.is_grad_enabled(), bool(use_compile))
    return loss.view(lead)


def plain_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The reference: full logits, then megatron's ``vocab_parallel_cross_entropy`` (TP=1 here)."""
    from megatron.core import tensor_parallel

    logits = torch.matmul(hidden, weight.t())
    return tensor_parallel.vocab_parallel_cross_entropy(logits, labels)


class LMLossMambaModel(MambaModel):
    """megatron's ``MambaModel`` with the LM head + loss of ``model.lm_head_loss``.

    ``plain`` (and every call without labels, in inference or on a non-last pipeline stage) is
    ``MambaModel.forward`` unchanged. ``chunked`` / ``chunked_compiled`` run ``MambaModel.forward`` up to the final norm (as a
    non-last stage does) and then ``chunked_linear_cross_entropy`` with the output layer's weight (the
    embedding's when they are tied). Parameters and checkpoint keys are those of ``MambaModel``.
    """

    def __init__(self, *args, lm_head_loss: str = DEFAULT_LM_HEAD_LOSS, lm_loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.lm_head_loss, self.lm_loss_chunk_tokens = lm_head_settings(
            {"lm_head_loss": lm_head_loss, "lm_loss_chunk_tokens": lm_loss_chunk_tokens})
        check_lm_head_parallel({"lm_head_loss": self.lm_head_loss}, self.pg_collection.tp.size())

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, runtime_gather_output=None, *, inference_params=None,
                packed_seq_params=None, padding_mask=None):
        kw = dict(inference_params=inference_params, packed_seq_params=packed_seq_params, padding_mask=padding_mask)
        if (self.lm_head_loss == "plain" or labels is None or not self.post_process
                or inference_context is not None or inference_params is not None):
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels,
                                   inference_context, runtime_gather_output, **kw)
        # MambaModel.forward returns the decoder's output (after the final norm) when post_process is off
        self.post_process = False
        try:
            hidden = super().forward(input_ids, position_ids, attention_mask, decoder_input, None,
                                     inference_context, runtime_gather_output, **kw)
        finally:
            self.post_process = True
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
            else self.output_layer.weight
        with torch.profiler.record_function(PROFILE_RANGE):
            loss = chunked_linear_cross_entropy(hidden, weight, labels.transpose(0, 1), self.lm_loss_chunk_tokens,
                                                use_compile=self.lm_head_loss == "chunked_compiled")
        return loss.transpose(0, 1).contiguous()  # [s, b] -> [b, s], as MambaModel returns it
