"""Hydra config composition for every entry point (train, inspect, benchmarks).

We use Hydra's compose API with the overrides taken from the command line (as Megatron-Bridge does)
rather than ``@hydra.main``: no working-directory change and no per-rank ``${now:}`` output dirs under
torchrun. ``recipe=NAME`` expands to the override list in ``recipes/NAME.yaml``; overrides given on the
command line after it win.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"
RECIPES_DIR = REPO_ROOT / "recipes"


class ConfigError(ValueError):
    """A bad configuration, reported before any work starts."""


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def expand_recipe(overrides: list[str]) -> list[str]:
    """Replace ``recipe=NAME`` with the overrides listed in ``recipes/NAME.yaml``."""
    out: list[str] = []
    for ov in overrides:
        if ov.startswith("recipe="):
            name = ov.split("=", 1)[1]
            path = RECIPES_DIR / f"{name}.yaml"
            if not path.is_file():
                raise ConfigError(f"unknown recipe {name!r}; available: {', '.join(list_recipes()) or 'none'}")
            recipe = OmegaConf.load(path)
            if "overrides" not in recipe:
                raise ConfigError(f"recipe file {path} has no 'overrides' list")
            out.extend(str(x) for x in recipe.overrides)
        else:
            out.append(ov)
    return out


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose the config from ``configs/`` with CLI-style overrides; errors become ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = expand_recipe(list(overrides or []))
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"bad config override: {msg}") from None
    return cfg


def overrides_from_argv(argv: list[str]) -> list[str]:
    bad = [a for a in argv if a.startswith("-") and a not in ("--",)]
    if bad:
        raise ConfigError(
            f"unexpected option(s) {bad}: nano-hybrid takes Hydra overrides like model=tiny kernels.backend=torch"
        )
    return [a for a in argv if a != "--"]

