"""docs/configuration.md is generated from the config dataclasses and must match them.

Regenerate it with `python -m bench.config_doc > docs/configuration.md`.
"""

import dataclasses
import importlib
from pathlib import Path

from bench import config_doc

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"
REGENERATE = "python -m bench.config_doc > docs/configuration.md"


def test_configuration_page_matches_the_dataclasses():
    expected = config_doc.render()
    current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
    assert current == expected, (
        f"docs/configuration.md is out of date with the config dataclasses: run `{REGENERATE}` "
        "and commit the result"
    )


def test_every_settable_field_has_a_row_with_its_names():
    sections = config_doc.render().split("\n## ")[1:]
    assert len(sections) == len(config_doc.CONFIGS) + 1  # + the cluster file
    for source, section in zip(config_doc.CONFIGS, sections, strict=False):
        assert section.startswith(source.title)
        module, _, name = source.cls.partition(":")
        cls = getattr(importlib.import_module(module), name)
        rows = section.splitlines()
        for field in dataclasses.fields(cls):
            if not field.init:
                continue
            row = next((line for line in rows if line.startswith(f"| `{field.name}` |")), None)
            assert row is not None, f"{name}.{field.name} has no row"
            if source.env_prefix is not None:
                assert f"`--{field.name.replace('_', '-')}`" in row
                assert f"`{source.env_prefix}{field.name.upper()}`" in row


def test_the_cluster_file_format_is_shown_as_toml():
    section = config_doc.render().split("\n## ")[-1]
    assert section.startswith("Cluster file")
    assert "[server]" in section and "[[shard]]" in section and "```toml" in section
