"""Export a nano-hybrid checkpoint as a Hugging Face Nemotron-H folder (``NemotronHForCausalLM``).

    python -m nano_hybrid.export_hf CHECKPOINT_DIR OUT_DIR [--dtype bf16|fp32] [--max-shard-size GB]

CHECKPOINT_DIR: an ``iter_*`` checkpoint, a checkpoints folder (its newest complete checkpoint) or a
run folder. Any TP/EP/PP/DP layout: the global tensors are read from the ``torch_dist`` files, one
layer at a time (no GPU, no process group). OUT_DIR gets ``config.json`` (``model_type: nemotron_h``),
``model-*.safetensors`` shards with ``model.safetensors.index.json`` and the tokenizer files. Bad input
stops with one ``error: ...`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from nano_hybrid.errors import EXIT_BAD_INPUT

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage too)
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)


def main(argv: list[str] | None = None) -> int:
    from nano_hybrid.hf import HFBridgeError, MappingError, export_checkpoint

    ap = _Parser(prog="python -m nano_hybrid.export_hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="iter_* checkpoint, checkpoints folder or run folder")
    ap.add_argument("out", help="output folder (new or empty)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="tensor dtype (default bf16)")
    ap.add_argument("--max-shard-size", type=float, default=5.0, help="GB per safetensors shard (default 5)")
    args = ap.parse_args(argv)
    if not args.max_shard_size > 0:
        print("error: --max-shard-size must be > 0", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, max_shard_bytes=int(args.max_shard_size * 1e9))
    except (HFBridgeError, MappingError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
