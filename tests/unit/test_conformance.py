"""The conformance suite (kernels/conformance.py) on a small subset on CPU: its CLI (one line per kernel, a skip line
for kernels not runnable here) and what it measures on cases with a known answer."""

import subprocess
import sys

import pytest
import torch

from kernels import conformance
from tests.runs import REPO, launcher_env


def test_cli_prints_one_line_per_kernel_and_says_what_it_skipped(tmp_path):
    out_file = tmp_path / "table.md"
    names = ["fa2/none", "fa2/exact_delta", "sdpa-flash", "sdpa-cudnn", "te", "flash-attn"]
    proc = subprocess.run([sys.executable, "-m", "kernels.conformance", "--cases", "ties", "v1", "--rows", "256",
                           "--kernels", *names, "--out", str(out_file)], cwd=REPO, env=launcher_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert lines[0].startswith("| kernel | ties k=1 | ties k=2 | ties k=3 | ties k=4 | V=1 | bad rows |")
    assert [line.split(" | ")[0][2:] for line in lines[1:]] == names
    rows = {line.split(" | ")[0][2:]: line for line in lines[1:]}
    if not torch.cuda.is_available():
        for name in ("sdpa-cudnn", "te", "flash-attn"):
            assert "skipped: needs CUDA" in rows[name]
    assert "±" in rows["fa2/none"] and "skipped" not in rows["sdpa-flash"]
    assert out_file.read_text().strip() == "\n".join(proc.stdout.strip().splitlines()[-len(lines) - 3:])


def test_measures_the_known_answers():
    """paper/none's tie bias at k = 2 is the theory's 1/4 ulp toward magnitude (the tie-bias tile case); the
    correctly rounded O has none on V = 1 (it is 1); exact_delta's delta error is 0 to the printed digits on
    ties, where fa2/none's equals its O error (delta from the bf16 O, dO with V's sign)."""
    result = conformance.run(["ties", "v1"], ["paper/none", "fa2/none", "fa2/exact_delta", conformance.EXACT],
                             rows=1024, seed=1)["results"]
    o, o_ci, _, _, n = result["ties"]["paper/none"]["ties k=2"]
    assert n > 100 and abs(o - 0.25) < max(3 * o_ci, 0.02), (o, o_ci)
    assert all(abs(x) < 1e-9 for x in result["v1"][conformance.EXACT]["V=1"][:4])  # FP64's O is 1 to ~1e-16
    _, _, d, d_ci, _ = result["ties"]["fa2/exact_delta"]["ties k=2"]
    assert abs(d) < 1e-3 and d_ci < 1e-3
    o, _, d, _, _ = result["ties"]["fa2/none"]["ties k=3"]
    assert d == pytest.approx(o, abs=0.01)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9,
                    reason="on a Hopper GPU --backend gluon runs (tests/gpu covers the kernel)")
def test_gluon_backend_without_a_hopper_gpu_says_what_to_use_instead(capsys):
    with pytest.raises(SystemExit) as exit_info:
        conformance.main(["--backend", "gluon", "--cases", "v1"])
    assert exit_info.value.code == 2
    assert "--backend gluon needs a Hopper GPU (sm_90); use --backend triton or reference" in capsys.readouterr().err
