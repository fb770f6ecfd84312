"""Hydra config composition for every entry point (train, inspect, benchmarks).

We use Hydra's compose API with the overrides taken from the command line (as Megatron-Bridge does)
rather than ``@hydra.main``: no working-directory change and no per-rank ``${now:}`` output dirs under
torchrun. ``recipe=NAME`` expands to the override list in ``recipes/NAME.yaml``; the other overrides on the command
line win over it, before or after it.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from nano_hybrid.errors import ConfigError  # noqa: F401 (the config's one error type, raised here)

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"
RECIPES_DIR = REPO_ROOT / "recipes"


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def expand_recipe(overrides: list[str]) -> list[str]:
    """The overrides listed in each ``recipes/NAME.yaml`` of a ``recipe=NAME``, then the other overrides in their
    order: an override given with a recipe wins over the recipe's own, wherever it stands on the command line."""
    out: list[str] = []
    rest: list[str] = []
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
            rest.append(ov)
    return out + rest


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose the config from ``configs/`` with CLI-style overrides; errors become ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from nano_hybrid.schema import register

    register()  # the <group>/schema nodes the group files start from
    overrides = expand_recipe(list(overrides or []))
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = _hint(msg, overrides, config_name)
        raise ConfigError(f"bad config override: {msg.rstrip('.') if hint else msg}{hint}") from None
    return cfg


def group_options(group: str) -> list[str]:
    """The options of a config group (its YAML files under ``configs/<group>/``)."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def _hint(msg: str, overrides: list[str], config_name: str) -> str:
    """What a Hydra error leaves out: the options of an unknown group choice, the closest key to an unknown one."""
    import difflib
    import re

    found = re.match(r"In '[^']*': Could not find '([^'/]+)/([^']+)'", msg)
    if found:
        return f"; options: {', '.join(group_options(found.group(1))) or 'none'}"
    found = re.match(r"Could not override '([^']+)'", msg)
    if not found:
        return ""
    key = found.group(1)
    if "." not in key:  # a top-level key or group: the config's own keys and the group names
        names = sorted({*group_names(), "recipe", *(str(k) for k in _top_level_keys(overrides, key, config_name))})
        match = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
        return f": no such key or group; did you mean {match[0]}?" if match else ": no such key or group"
    parent, _, name = key.rpartition(".")
    others = [ov for ov in overrides if not ov.lstrip("+~").startswith(key + "=")]
    try:  # the same config without the failing override: its keys under the same parent
        node = OmegaConf.select(compose(others, config_name), parent)
    except ConfigError:
        return ""
    if not isinstance(node, DictConfig):
        return ""
    match = difflib.get_close_matches(name, [str(k) for k in node.keys()], n=1, cutoff=0.6)
    return f": no such key; did you mean {parent}.{match[0]}?" if match else ": no such key"


def group_names() -> list[str]:
    """The config groups (folders under ``configs/``)."""
    return sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir())


def _top_level_keys(overrides: list[str], key: str, config_name: str) -> list[str]:
    others = [ov for ov in overrides if not ov.lstrip("+~").startswith(key + "=")]
    try:
        return list(compose(others, config_name).keys())
    except ConfigError:
        return []


HELP_FLAGS = ("-h", "--help")


def usage(doc: str | None) -> str:
    """An entry point's ``--help``: its module doc, then the config groups with their options and the recipes."""
    lines = [(doc or "").strip(), "", "Hydra overrides (key=value, group=option); the groups and their options:"]
    lines += [f"  {g:<11} {', '.join(group_options(g))}" for g in group_names()]
    lines += [f"  {'recipe':<11} {', '.join(list_recipes())}",
              "Every key, its type, default and doc: nano_hybrid/schema.py"]
    return "\n".join(lines)


def help_requested(argv: list[str], doc: str | None) -> bool:
    """Print ``usage(doc)`` when ``argv`` asks for help (-h / --help); whether it did."""
    if not any(a in HELP_FLAGS for a in argv):
        return False
    print(usage(doc))
    return True


def overrides_from_argv(argv: list[str]) -> list[str]:
    bad = [a for a in argv if a.startswith("-") and a not in ("--",)]
    if bad:
        raise ConfigError(
            f"unexpected option(s) {bad}: nano-hybrid takes Hydra overrides like model=tiny kernels.backend=torch"
        )
    return [a for a in argv if a != "--"]

