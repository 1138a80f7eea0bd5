"""The training-speed benchmark runs end to end on a CPU-sized model and prints its table (the numbers it measures
on a CPU mean nothing for GPUs; this checks the plumbing: both sides train the same shape and batch)."""

import json
import os
import subprocess
import sys
import textwrap

from benchmarks import train_speed
from tests.runs import REPO


def test_train_speed_prints_both_sides(kjv_data, tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = train_speed.main(["smoke", f"data.data_dir={kjv_data}", "model.vocab_size=2048", "model.n_layer=1",
                             "model.d_model=64", "model.n_head=1", "data.seq_len=32", "model.max_seq_len=32",
                             "data.global_batch_size=4", "data.micro_batch_size=2", "--baselines", "math",
                             "--no-compile-baseline", "--steps", "3", "--skip", "1", "--json", str(out)])
    assert code == 0
    assert "| recipe |" in capsys.readouterr().out
    rows = {r["side"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["recipe", "sdpa_math"] and rows["sdpa_math"]["ratio"] == 1.0
    assert all(r["tokens_per_s"] > 0 for r in rows.values())


def test_train_speed_variants_and_profile(kjv_data, tmp_path, capsys):
    """--also adds a recipe row per override set; --profile prints the per-category table and writes each side's
    top kernels (on a CPU: the ops' CPU time)."""
    out, prof = tmp_path / "rows.json", tmp_path / "prof"
    code = train_speed.main(["smoke", f"data.data_dir={kjv_data}", "model.vocab_size=2048", "model.n_layer=1",
                             "model.d_model=64", "model.n_head=1", "data.seq_len=32", "model.max_seq_len=32",
                             "data.global_batch_size=4", "data.micro_batch_size=2", "--baselines", "math",
                             "--no-compile-baseline", "--steps", "2", "--skip", "1", "--also", "optim.lr=1e-4",
                             "--profile", str(prof), "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| recipe optim.lr=1e-4 |" in printed and "| step wall time |" in printed
    rows = {r["side"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["recipe", "recipe optim.lr=1e-4", "sdpa_math"]
    assert all(r["profile"]["busy_us"] > 0 for r in rows.values())
    assert sorted(p.name for p in prof.iterdir()) == ["recipe_kernels.md", "recipe_optim.lr_1e-4_kernels.md",
                                                      "sdpa_math_kernels.md"]


def test_minimal_gpt_counts_like_the_recipe_model():
    """The baseline has the recipe model's matmul weights (so the two sides do the same work per token)."""
    import torch

    from model import GPT, GPTConfig

    config = GPTConfig(vocab_size=128, max_seq_len=16, n_layer=2, n_head=2, d_model=32)
    ours = GPT(config)
    baseline = train_speed.MinimalGPT(128, 16, 2, 2, 32)
    matrices = lambda m: sum(p.numel() for p in m.parameters() if p.dim() == 2)  # noqa: E731
    assert matrices(baseline) == matrices(ours)
    x = torch.randint(0, 128, (2, 16))
    assert torch.isfinite(baseline(x, x))


def test_train_speed_te_baseline_says_it_needs_a_gpu(capsys):
    """The Transformer Engine baseline on a machine without CUDA: a one-line error and exit status 2."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU: the te baseline runs (benchmarked on the device, docs/results.md)")
    code = train_speed.main(["smoke", "model.vocab_size=512", "--baselines", "te", "--steps", "2", "--skip", "1"])
    assert code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_forward_schedule_model():
    """The Gluon forward's schedule model (benchmarks.forward_schedule): its tile order visits every (query block,
    head) once, ragged last section included; the counter never leaves the busiest program worse off than the
    fixed share at the benchmark shapes; a bad shape is a message and exit status 2. In a fresh process: the model
    takes its constants from kernels.gluon_flash, and Gluon cannot be imported into a process whose Triton was first
    imported under TRITON_INTERPRET=1 (test_attention_triton_interp.py; seen once in CI when pytest-xdist gave both
    files to one worker: an AssertionError in Gluon's import)."""
    code = textwrap.dedent("""
        from benchmarks import forward_schedule as fs

        order = fs.tile_order(pairs=18, n_m=5, section=4)  # sections of 4, 4, 4, 4, 2 pairs
        assert sorted(order) == [(m, p) for m in range(5) for p in range(18)]
        assert [m for m, _ in order[:4]] == [4] * 4 and order[-1] == (0, 17)
        for b, h, t, d in ((8, 12, 1024, 64), (4, 16, 4096, 128)):
            width = fs.section_width(b, h, t, d)
            assert 1 <= width <= b * h
            order = fs.tile_order(b * h, t // 128, width)
            assert fs.busiest_over_mean(order, 132, dynamic=True) <= fs.busiest_over_mean(order, 132, dynamic=False)
        assert fs.main(["--shapes", "4,16"]) == 2
        print("model checks passed")
    """)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "model checks passed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_attention_table_ratios_are_of_gpu_times():
    """benchmarks.attention's table: the forward's and fwd+bwd's ratios to SDPA come from the CUDA-graph (GPU)
    columns, not the eager ones (rows made up here: the benchmark itself needs a GPU)."""
    from benchmarks import attention

    shape = (4, 16, 4096, 128)
    rows = [(shape, "sdpa-flash", 100.0, 250.0, 90.0, 270.0), (shape, "sdpa-cudnn", 100.0, 500.0, 90.0, 450.0),
            (shape, "fa2/none", 50.0, 400.0, 60.0, 300.0), (shape, "fa2/fp32_output", 50.0, 380.0, 60.0, 297.0)]
    table = attention.to_markdown(rows, "a test device")
    cells = {line.split(" | ")[1]: line.strip("| ").split(" | ") for line in table.splitlines() if "4,16,4096" in line}
    assert cells["fa2/none"][2:] == ["50", "400", "0.80", "60", "300", "1.11", "0.67", "1.00"]
    assert cells["fa2/fp32_output"][-1] == "0.99" and cells["sdpa-cudnn"][4] == "1.00"


def test_kernel_profile_rows_and_cpu_refusal(capsys):
    """benchmarks.kernel_profile: per-step rows from the profiler's totals (longest first, a total row), and on a
    machine without a CUDA GPU a one-line refusal, not a traceback."""
    import pytest
    import torch

    from benchmarks import kernel_profile

    rows = kernel_profile.per_step({"_bwd_kernel": (4000.0, 10), "_bwd_delta_kernel": (500.0, 10),
                                    "_fwd_kernel": (1500.0, 10)}, steps=10)
    assert rows == [("_bwd_kernel", 1.0, 400.0), ("_fwd_kernel", 1.0, 150.0), ("_bwd_delta_kernel", 1.0, 50.0)]
    table = kernel_profile.to_markdown((8, 12, 1024, 64), "gluon fa2/none", rows)
    assert "| 8,12,1024,64 | gluon fa2/none | `_bwd_kernel` | 1 | 400.0 | 66.7% |" in table
    assert table.splitlines()[-1] == "| 8,12,1024,64 | gluon fa2/none | **all kernels** | 3 | **600.0** | 100% |"
    names = [name for name, _ in kernel_profile.implementations(["fa2/none", "fa2/fp32_output"], ["gluon"], True)]
    assert names == ["sdpa-cudnn", "gluon fa2/none", "gluon fa2/none atomic-dQ", "gluon fa2/fp32_output",
                     "gluon fa2/fp32_output atomic-dQ"]
    with pytest.raises(SystemExit):
        kernel_profile.main(["--steps", "0"])
    if not torch.cuda.is_available():
        assert kernel_profile.main(["--shapes", "1,2,128,64"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
