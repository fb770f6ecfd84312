"""The documented FLOPs-per-token formula against a hand count (nano_hybrid/flops.py)."""

import pytest

from nano_hybrid.flops import HybridShape, forward_flops_per_token, training_flops_per_token

SMALL = HybridShape(
    pattern="M*E", hidden=64, vocab=256, seq_length=32,
    mamba_heads=4, mamba_head_dim=16, mamba_state=8, mamba_groups=2, conv_width=4, chunk_size=16,
    attn_heads=4, attn_groups=2, attn_head_dim=16,
    num_experts=8, topk=2, moe_ffn=32, shared_ffn=64,
)


def test_small_config_hand_count():
    # Mamba: d_inner 64; in_proj 2*64*(2*64 + 2*2*8 + 4) = 20992; conv 2*(64 + 32)*4 = 768;
    #        SSD 2*2*16*8 + 2*4*16*16 + 4*4*8*16 = 512 + 2048 + 2048 = 4608; out_proj 2*64*64 = 8192
    mamba = 20992 + 768 + 4608 + 8192
    # Attention: qkv 2*64*16*(4 + 2*2) = 16384; core 2*4*16*(32 + 1) = 4224; out 2*4*16*64 = 8192
    attn = 16384 + 4224 + 8192
    # MoE: router 2*64*8 = 1024; routed 2 experts * 4*64*32 = 16384; shared 4*64*64 = 16384
    moe = 1024 + 16384 + 16384
    head = 2 * 64 * 256
    assert forward_flops_per_token(SMALL) == mamba + attn + moe + head == 129920
    assert training_flops_per_token(SMALL) == 3 * 129920


def test_layer_order_and_repeats_add_up():
    twice = HybridShape(**{**SMALL.as_dict(), "pattern": "EM*EM*"})
    head = 2 * 64 * 256
    assert forward_flops_per_token(twice) - head == 2 * (forward_flops_per_token(SMALL) - head)


def test_gated_mlp_and_dense_layer():
    dense = HybridShape(**{**SMALL.as_dict(), "pattern": "-", "ffn": 128, "gated_mlp": True})
    assert forward_flops_per_token(dense) == 4 * 64 * 128 * 1.5 + 2 * 64 * 256


def test_unknown_symbol_is_an_error():
    with pytest.raises(ValueError, match="without a FLOPs formula"):
        forward_flops_per_token(HybridShape(**{**SMALL.as_dict(), "pattern": "M*G"}))


def test_nano30b_is_in_the_published_range():
    """Nemotron-3 Nano 30B-A3B at seq 8192: 6 * N_active ~ 19.4 GFLOP/token (3.23e9 active params);
    Megatron-Bridge's published 328 TFLOP/s at 14719 tok/s implies ~22.3 GFLOP/token."""
    nano = HybridShape(
        pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", hidden=2688, vocab=131072, seq_length=8192,
        mamba_heads=64, mamba_head_dim=64, mamba_state=128, mamba_groups=8, conv_width=4, chunk_size=128,
        attn_heads=32, attn_groups=2, attn_head_dim=128,
        num_experts=128, topk=6, moe_ffn=1856, shared_ffn=3712,
    )
    assert 19.0e9 < training_flops_per_token(nano) < 23.0e9
