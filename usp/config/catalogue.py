"""`usp config list|show|cp`: make the config catalogue discoverable and copyable."""
from __future__ import annotations

import shutil
from pathlib import Path

from usp.config import schema
from usp.config.paths import conf_dir, group_options, recipe_names, recipes_dir
from usp.errors import ConfigError
from usp.run.files import staged
from usp.run.writable import check_new_output


def complete_override(incomplete: str) -> list[str]:
    """Shell completion of an override: group=option and conf=<recipe>."""
    options = [f"{g}={o}" for g in schema.GROUPS for o in group_options(g)]
    options += [f"conf={name}" for name in recipe_names()]
    return [o for o in options if o.startswith(incomplete)]


def describe(path: Path) -> str:
    """The leading comment block of a YAML file is its description."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").strip())
    return " ".join(lines)


def render_catalogue() -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"config groups ({conf_dir()})", title_justify="left")
    table.add_column("group", style="bold cyan")
    table.add_column("option")
    table.add_column("description")
    for group in schema.GROUPS:
        for option in group_options(group):
            table.add_row(group, option, describe(conf_dir() / group / f"{option}.yaml"))
    recipes = Table(title=f"recipes ({recipes_dir()})", title_justify="left")
    recipes.add_column("recipe", style="bold cyan")
    recipes.add_column("description")
    for name in recipe_names():
        recipes.add_row(name, describe(recipes_dir() / f"{name}.yaml"))
    console = Console()
    console.print(table)
    console.print(recipes)
    console.print("use: usp config show model=tiny | usp config cp tiny_ddp | usp train conf=recipes/tiny_ddp.yaml")


def show_item(item: str) -> str:
    """YAML of one group option (composed with the schema's defaults) or of a whole recipe."""
    from omegaconf import OmegaConf

    from usp.config.compose import compose_config

    if "=" in item:
        group, option = item.split("=", 1)
        if group not in schema.GROUPS:
            raise ConfigError("not a config group", key=group, value=option,
                              fix=f"one of: {', '.join(schema.GROUPS)}")
        cfg, _ = compose_config(None, [item])
        return f"# {group}={option}\n" + OmegaConf.to_yaml(cfg[group])
    cfg, choices = compose_config(item, [])
    picked = ", ".join(f"{g}={o}" for g, o in choices.items())
    return f"# {item}: {picked}\n" + OmegaConf.to_yaml(cfg)


def copy_recipe(recipe: str, dest: str = ".", force: bool = False) -> Path:
    """Copy a recipe to `dest` (a file, or a directory to copy into). An existing file is replaced
    only with force, through a temporary file (usp.run.files.staged)."""
    source = Path(recipe) if recipe.endswith(".yaml") else recipes_dir() / f"{recipe}.yaml"
    if not source.is_file():
        raise ConfigError("no such recipe", key="recipe", value=recipe,
                          fix=f"one of: {', '.join(recipe_names())}")
    target = Path(dest).expanduser()
    if target.is_dir():
        target = target / source.name
    check_new_output(target, force=force, key="dest", inputs=[source])
    with staged(target) as tmp:
        shutil.copyfile(source, tmp)
    return target
