"""The documents against the code: the configuration reference is what the schemas generate, every recipe file a
user is pointed to is the whole recipe (no chain through other experiments), and the README stays short."""
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from tests.helpers.cli import compose_cfg
from transformer import config_doc

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (REPO / "conf/experiment").glob("*.yaml"))


def test_configuration_reference_is_generated_from_the_schemas():
    committed = config_doc.DOC_PATH.read_text(encoding="utf-8")
    assert committed == config_doc.render(), "docs/configuration.md is stale: python -m transformer.config_doc > " \
                                             "docs/configuration.md"


def test_configuration_reference_lists_every_key():
    """Every leaf key of the composed config (any group's schema) has a row, and a row says what it does."""
    cfg = OmegaConf.to_container(compose_cfg(), resolve=False)
    keys, stack = set(), [("", cfg)]
    while stack:
        prefix, node = stack.pop()
        for k, v in node.items():
            if isinstance(v, dict) and k != "files":
                stack.append((f"{prefix}{k}.", v))
            else:
                keys.add(f"{prefix}{k}")
    documented = {key for cls, prefix in _schemas() for key, *_ in config_doc.rows(cls, prefix)} | {"seed"}
    assert keys - documented == set()
    undescribed = [key for cls, prefix in _schemas() for key, _, _, note in config_doc.rows(cls, prefix) if not note]
    assert undescribed == []


def _schemas():
    import dataclasses
    import typing

    from transformer.config import Config
    hints = typing.get_type_hints(Config)
    fields = dataclasses.fields(Config)
    return [(hints[f.name], f"{f.name}.") for f in fields if dataclasses.is_dataclass(hints[f.name])]


def _overrides(node, prefix=""):
    """A recipe file's values as command-line overrides (lists and nulls in Hydra's syntax)."""
    out = []
    for k, v in node.items():
        if isinstance(v, dict):
            out += _overrides(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}")
    return out


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_file_is_the_whole_recipe(recipe):
    """`experiment=R` composes to the schema defaults, the groups the file names and the file's own values, and
    nothing else: its defaults list only overrides groups, it never includes another experiment."""
    text = yaml.safe_load((REPO / f"conf/experiment/{recipe}.yaml").read_text(encoding="utf-8"))
    groups = []
    for entry in text.pop("defaults", []):
        assert isinstance(entry, dict) and len(entry) == 1, f"{recipe}: {entry!r} includes another config"
        (key, option), = entry.items()
        assert key.startswith("override /") and not key.endswith("experiment"), f"{recipe}: {key}"
        groups.append(f"{key.removeprefix('override /')}={option}")
    by_name = OmegaConf.to_container(compose_cfg(f"experiment={recipe}"))
    by_hand = OmegaConf.to_container(compose_cfg(*groups, *_overrides(text)))
    assert by_name == by_hand


def test_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, len(lines)  # torchtitan's README: under 200 lines, the rest in docs/
