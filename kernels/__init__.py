"""Kernel backends for the Mamba-2 mixer's training ops (mamba-ssm compatible signatures).

This package knows nothing of megatron or the training loop: tensors in, tensors out.
See ``kernels.registry`` for the backend switch.
"""
