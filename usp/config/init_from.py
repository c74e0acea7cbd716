"""model.init_from: which model keys the checkpoint's config.json decides, and which the user did.

A run that starts from a Hugging Face checkpoint takes the model's shape from its config.json. A
model key that the command line or the recipe sets (`model.n_heads=8`, a recipe's `model:` section),
or that comes from a model group one of them picks (`model=llama3_2_1b`, a recipe's
`override model: ...`), is the user's: the planner refuses it when config.json disagrees
(usp/plan/hf_config.py). The others, which only the default model group (conf/config.yaml's) gives,
are left MISSING ('???') here, and the planner fills them from config.json before it reads the
model. model.vocab_size=-1 (from the tokenizer) counts as unset wherever it comes from: the
embedding must have the checkpoint's rows."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from usp.config.paths import conf_dir
from usp.contract.hf_shape import CHECKPOINT_KEYS

MISSING = "???"  # omegaconf's "no value yet"
def explicit_model_keys(recipe: Path, overrides: Sequence[str], model_option: str | None) -> set[str]:
    """The model keys the command line or the recipe file set, directly or through a model group
    they pick (conf/config.yaml itself, whose group is the default, sets none)."""
    keys: set[str] = set()
    picked = False
    for line in overrides:
        key = line.partition("=")[0].lstrip("+~")
        picked |= key == "model"
        if key.startswith("model."):
            keys.add(key.split(".")[1])
    if recipe.resolve() != (conf_dir() / "config.yaml").resolve():
        content = _yaml(recipe)
        model = content.get("model")
        keys |= set(model) if isinstance(model, dict) else set()
        picked |= any(isinstance(entry, dict) and any(str(k).split()[-1] == "model" for k in entry)
                      for entry in content.get("defaults") or [])
    if picked and model_option:
        given = Path(model_option)  # model=path/to/mine.yaml: the choice is the file's absolute path
        group = given if given.is_absolute() and given.is_file() else next(
            (d / "model" / f"{model_option}.yaml" for d in (recipe.parent, conf_dir())
             if (d / "model" / f"{model_option}.yaml").is_file()), None)
        keys |= set(_yaml(group)) if group is not None else set(CHECKPOINT_KEYS)
    return keys


def leave_to_checkpoint(cfg, recipe: Path, overrides: Sequence[str], model_option: str | None):
    """With model.init_from set: every checkpoint key the user did not set becomes MISSING, for the
    planner to fill from config.json. Returns cfg (changed in place)."""
    if not cfg.model.get("init_from"):
        return cfg
    explicit = explicit_model_keys(recipe, overrides, model_option)
    for key in CHECKPOINT_KEYS:
        if key not in explicit or (key == "vocab_size" and cfg.model.vocab_size == -1):
            cfg.model[key] = MISSING
    return cfg


def _yaml(path: Path) -> dict:
    import yaml

    data = yaml.safe_load(path.read_text(encoding="utf-8"))  # check_recipe_file read it already
    return data if isinstance(data, dict) else {}
