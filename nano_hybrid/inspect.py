"""Print a model's parameter counts as JSON, counted from the built modules on the meta device.

    python -m nano_hybrid.inspect model=nano30b [overrides]

Output keys: ``model``, ``hybrid_override_pattern``, ``layers`` ({M, E, *, -} counts), ``total_params``,
``active_params`` (per token, excluding the input embedding), ``active_params_incl_embedding``,
``active_definition``, and a breakdown. Counts are for the whole model at TP=PP=EP=1 (the parallel
group in the config is ignored: this is about the architecture, not a rank's shard).
"""

from __future__ import annotations

import json
import sys
import warnings

from omegaconf import OmegaConf


def inspect_model(overrides: list[str]) -> dict:
    from nano_hybrid.config import compose
    from nano_hybrid.model import build_model, count_params
    from nano_hybrid.parallel import destroy_parallel, initialize_parallel
    from nano_hybrid.schema import ParallelSchema, defaults

    cfg = compose(overrides)
    # count the unsharded model: one process, no model parallelism
    cfg.parallel = OmegaConf.create(defaults(ParallelSchema))  # the schema's layout: parallel=single
    initialize_parallel(cfg, backend="gloo")
    try:
        model = build_model(cfg, device="meta")
        counts = count_params(model)
    finally:
        destroy_parallel()
    pattern = str(cfg.model.hybrid_override_pattern)
    return {
        "model": str(cfg.model.name),
        "hybrid_override_pattern": pattern,
        "layers": {s: pattern.count(s) for s in "ME*-" if s in pattern},
        "kernels_backend": str(cfg.kernels.backend),
        **counts,
    }


def main(argv: list[str] | None = None) -> int:
    from nano_hybrid.config import ConfigError, help_requested, overrides_from_argv
    from nano_hybrid.errors import EXIT_BAD_INPUT, filter_startup_warnings

    warnings.filterwarnings("ignore")
    filter_startup_warnings()  # megatron's log records of the local specs (nano_hybrid/errors.py)
    argv = sys.argv[1:] if argv is None else argv
    if help_requested(argv, __doc__):
        return 0
    try:
        out = inspect_model(overrides_from_argv(argv))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
