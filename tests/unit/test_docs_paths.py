"""Every repository path that a doc, a recipe or a report's text names exists (issue 35: docs cited a file the project
does not have). Walks README.md, docs/ (the pages and each device session's README), recipes/ and the string
literals of the report writers; records of past output (device-run logs, copied reports) are history and are not
walked."""

import ast
import re
from pathlib import Path

import pytest

from tests.runs import REPO

TOP = ("analysis", "benchmarks", "data", "docs", "kernels", "launcher", "model", "recipes", "slurm", "tests")
GENERATED = ("data/cache/",)  # made by the commands (prepare_data), not shipped
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./*-]*[\w*/])" % "|".join(TOP))
RELATIVE = re.compile(r"(?<![\w./-])(device-runs/[\w./*-]*[\w*/])")
DEVICE_RUN = re.compile(r"device-runs/[\w.=-]+")
BARE_FILE = re.compile(r"`([\w./=-]+\.(?:log|json|sh|py|md|png|txt|xml)|[\w.=-]+/)`")  # a file, or a folder/
LINK = re.compile(r"\]\(([^)\s#]+)\)")  # markdown links and images
MODULE = re.compile(r"python3? -m ((?:%s)(?:\.\w+)+)" % "|".join(TOP))
REPORT_WRITERS = ("launcher/compare.py", "analysis/margin_report.py", "analysis/margin.py")


def texts() -> list[tuple[str, str]]:
    """(file, text) of what a reader of the project reads."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "docs" / "device-runs").glob("**/README.md")), *sorted((REPO / "recipes").glob("*.yaml"))]
    out = [(str(f.relative_to(REPO)), f.read_text()) for f in files]
    for name in REPORT_WRITERS:  # the text these write into every report
        tree = ast.parse((REPO / name).read_text())
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        out.append((name, "\n".join(strings)))
    return out


def missing_paths(name: str, text: str) -> list[str]:
    missing = []
    # a session's README also names its files that were removed from the tree (it says so, and where they are)
    own = str(Path(name).parent) + "/" if "device-runs/" in name else None
    for path in PATH.findall(text):
        path = path.rstrip(".")
        if own and path.startswith(own):
            continue
        last = path.rstrip("/").rsplit("/", 1)[-1]
        if path.startswith(GENERATED) or last.split(".")[0].isupper() or not (path.endswith("/") or "." in last or "*" in last):
            continue  # made by a command; a placeholder (recipes/RECIPE.yaml); prose ("data/tensor parallelism")
        if "*" in path:
            if not list(REPO.glob(path)):
                missing.append(path)
        elif not (REPO / path).exists():
            missing.append(path)
    folder = (REPO / name).parent
    if name.startswith("docs/"):  # docs/ pages name their device runs relative to docs/
        for path in RELATIVE.findall(text):
            path = path.rstrip(".")
            if not (list(folder.glob(path)) if "*" in path else (folder / path).exists()):
                missing.append(path)
    if not own:
        missing += missing_device_files(text)
    for target in LINK.findall(text):
        if "://" not in target and re.fullmatch(r"[\w./-]+\.\w+", target) and not (folder / target).exists():
            missing.append(target)
    for module in MODULE.findall(text):
        parts = module.split(".")
        if not ((REPO / "/".join(parts)).with_suffix(".py").is_file() or (REPO / "/".join(parts)).is_dir()):
            missing.append(f"python -m {module}")
    return missing


def missing_device_files(text: str) -> list[str]:
    """A paragraph that names a device run (docs/device-runs/<session>/...) may name its files by their names alone
    (`call1/launch_times.log`, `run23.sh`): each must be in that session's folder."""
    repo_names = {p.name for p in REPO.glob("[!.]*/**/*") if "device-runs" not in p.parts}
    missing = []
    for paragraph in re.split(r"\n\s*\n", text):
        sessions = {REPO / "docs" / "device-runs" / m.split("/")[1] for m in DEVICE_RUN.findall(paragraph)}
        for file in BARE_FILE.findall(paragraph) if sessions else []:
            if file.startswith(TOP) or file.startswith("device-runs/") or file in repo_names:
                continue  # a repository path (checked above) or a repository file named alone (test_x.py)
            if not any(list(session.glob(f"**/{file.rstrip('/')}")) for session in sessions):
                missing.append(file)
    return missing


@pytest.mark.parametrize("name, text", texts(), ids=lambda v: v if len(v) < 80 else "")
def test_every_named_path_exists(name, text):
    assert missing_paths(name, text) == [], name


def test_the_check_finds_a_missing_path():
    assert missing_paths("README.md", "see docs/paper-notes.md, launcher/compare.py and python -m launcher.nope") == [
        "docs/paper-notes.md", "python -m launcher.nope"]
    assert missing_paths("docs/margin.md", "![x](no-such.png) ![y](monitoring.md)") == ["no-such.png"]


def test_docs_cite_no_file_outside_the_project():
    """The files beside the project (../shared/...) are not part of it: docs, and the reports kept as results, cite
    the paper or the project's runs."""
    reports = [(str(p.relative_to(REPO)), p.read_text()) for p in (REPO / "docs" / "device-runs").glob("**/margin.md")]
    for name, text in texts() + reports:
        assert "shared/" not in text and "paper-notes" not in text, name

