"""nano-hybrid: Megatron-style pretraining of the Nemotron-3 Nano hybrid with switchable kernel backends."""

__version__ = "0.1.0"
