"""Hugging Face Nemotron-H bridge: export checkpoints to ``NemotronHForCausalLM`` folders and start
runs from them (``checkpoint.init_from_hf``). See ``bridge.py`` (entry points), ``mapping.py`` (names
and layouts), ``config.py`` (config.json), ``io.py`` (tensor reading/writing), ``tokenizer.py``."""

from nano_hybrid.hf.bridge import (
    HFBridgeError,
    check_init_from_hf,
    export_checkpoint,
    export_model,
    load_hf_weights,
)
from nano_hybrid.hf.mapping import MappingError

__all__ = ["HFBridgeError", "MappingError", "check_init_from_hf", "export_checkpoint", "export_model", "load_hf_weights"]
