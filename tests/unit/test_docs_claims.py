"""Claims of the docs that the code decides (issue 21): each is read from the code here, so a change of one without
the other fails in CI."""

import dataclasses

from kernels.modes import PAPER_BLOCK_KEYS
from launcher import compare
from launcher.config import SAFE_CHANGES, Config, _flatten
from tests.runs import REPO


def read(name):
    return (REPO / name).read_text()


def test_paper_tile_default_is_the_kernels_own():
    assert f"default {PAPER_BLOCK_KEYS}, the authors' tile" in read("docs/monitoring.md")
    assert f"(default: {PAPER_BLOCK_KEYS}, the authors' tile" in read("docs/attention-kernel.md")
    assert "today 64" not in read("docs/monitoring.md") and "option is refused" not in read("docs/attention-kernel.md")


def test_fp8_layout_claims_agree():
    checked = "TP2, PP2 and DP2 ZeRO-3 with FP8"
    for doc in ("README.md", "docs/training.md", "docs/parallelism.md"):
        text = " ".join(read(doc).split())
        assert checked in text, doc
        assert "plain data parallelism only" not in text and "only TP2 + FP8" not in text, doc


def test_layout_file_location_is_described_as_written():
    assert "folder of the first arm" in compare.__doc__
    assert "into the folder of the first arm by name" in " ".join(read("docs/monitoring.md").split())


def test_safe_changes_name_real_fields():
    fields = set(_flatten(dataclasses.asdict(Config())))
    for name in SAFE_CHANGES:
        prefix = name[:-1] if name.endswith(".*") else None
        assert (any(f.startswith(prefix) for f in fields) if prefix else name in fields), name


def test_margin_defaults_table_says_what_the_code_and_the_recipe_set():
    """docs/margin.md's table gives each margin field's default (MarginConfig) and the recipe's value, apart."""
    import yaml

    from analysis.margin import MarginConfig

    recipe = yaml.safe_load(read("recipes/margin.yaml"))["margin"]
    rows = [line.split("|")[1:4] for line in read("docs/margin.md").splitlines() if line.startswith("| `margin.")]
    fields = [f.name for f in dataclasses.fields(MarginConfig)]
    assert sorted(cell[0].strip(" `")[len("margin."):] for cell in rows) == sorted(fields)
    for name, default, in_recipe in rows:
        field = name.strip(" `")[len("margin."):]
        assert yaml.safe_load(default.strip(" `")) == getattr(MarginConfig(), field), field
        value = in_recipe.strip(" `")
        assert (field not in recipe) if value == "-" else yaml.safe_load(value) == recipe[field], field
