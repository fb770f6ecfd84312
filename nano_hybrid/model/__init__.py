"""The Nemotron-3 Nano hybrid model on megatron-core (local, non-TE layer specs).

- ``build_model(cfg, *, device=None, dtype=None) -> MambaModel``  (see ``build.py``)
- ``make_transformer_config(cfg, device=..., dtype=...)``        (see ``config.py``)
- ``hybrid_stack_spec(backend, attention_impl=..., moe_experts_impl=...)`` (see ``specs.py``)
- ``count_params(model)``: total and per-token active parameter counts from the built modules.
"""

from nano_hybrid.model.build import build_model, default_device
from nano_hybrid.model.config import make_transformer_config, padded_vocab_size
from nano_hybrid.model.count import count_params

__all__ = ["build_model", "default_device", "make_transformer_config", "padded_vocab_size", "count_params"]
