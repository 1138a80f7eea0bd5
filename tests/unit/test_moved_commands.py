"""Commands that moved or were renamed keep their old names (issue 35, "the house"): ``python -m launcher.margin``
and the others are forwarding addresses that run the module's new home, and launcher/ imports nothing of analysis/."""

import ast
import subprocess
import sys

import pytest

from tests.runs import REPO, launcher_env

MOVED = {  # old command -> where it lives now
    "launcher.margin": "analysis.margin",
    "launcher.warning_calibration": "analysis.warning_calibration",
    "launcher.probe_checkpoint": "analysis.checkpoint_delta_bias",
    "kernels.bias_probe": "kernels.tie_bias",
}


@pytest.mark.parametrize("old, new", MOVED.items())
def test_the_old_command_runs_the_new_one(old, new):
    proc = subprocess.run([sys.executable, "-m", old, "--help"], cwd=REPO, env=launcher_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: python -m {new} "), proc.stdout[:300]


def test_launcher_imports_nothing_of_analysis():
    for path in sorted((REPO / "launcher").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "analysis" or n.startswith("analysis.") for n in names), path
