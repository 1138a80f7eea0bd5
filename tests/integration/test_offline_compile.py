"""The Gluon Hopper kernels compile for sm_90 under the installed Triton, on a machine without a GPU: CI's guard
against a Triton release that changes Gluon's API (kernels/offline_compile.py). A fresh Triton cache, so that every
configuration is compiled, not read back."""

import re
import subprocess
import sys

from tests.conftest import REPO


def test_gluon_kernels_compile_for_sm90(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "TRITON_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO),
           "HOME": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-m", "kernels.offline_compile", "--quick", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ok", "FAILED"))]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(lines) == 7 and all(line.startswith("ok") for line in lines), proc.stdout
    for name in ("forward_d128_fp32_output", "backward_d128_deterministic"):
        ptx = (tmp_path / f"{name}.ptx").read_text()
        # what makes them Hopper kernels: asynchronous warpgroup MMAs, TMA copies, per-partition register budgets
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx, name
    # the backward's dQ shares leave by TMA reduce-add (the writer warp), not by FP32 atomics from registers, and the
    # ordered backward waits until its adds are performed in global memory before it passes the turn on
    for name in ("backward_d128_deterministic", "backward_d64_atomic_dQ"):
        ptx = (tmp_path / f"{name}.ptx").read_text()
        assert "cp.reduce.async.bulk.tensor" in ptx and "add.bulk_group" in ptx, name
        assert not re.search(r"(red|atom)\.global\S*f32", ptx), name
    assert "cp.async.bulk.wait_group 0;" in (tmp_path / "backward_d128_deterministic.ptx").read_text()
    # dQ = LP(scale * sums) written by the backward itself (BWD_DQ_FINISH, off by default): 16-byte stores of 8
    # values, one per 8 x 32 block of a query tile (32 blocks at head_dim 128, 16 at 64), none in the default
    # backward (the finishing launch does it)
    finished = (tmp_path / "backward_d128_deterministic_dQ_finished.ptx").read_text()
    assert finished.count("st.global.v4.b32") == 32
    assert (tmp_path / "backward_d64_atomic_dQ_first_store_dQ_finished.ptx").read_text().count("st.global.v4.b32") == 16
    assert "st.global.v4.b32" not in (tmp_path / "backward_d128_deterministic.ptx").read_text()
    # the bf16 O leaves by stmatrix into shared memory and a TMA store (FWD_O_TMA): the forward's only plain global
    # stores are the LSE's (one FP32 per row, 4 in the two consumers' code); at head_dim 128 with fix=fp32_output the
    # FP32 O's buffers no longer fit beside the bf16 O's, so it goes by plain 8-byte stores (_fwd_store_plan: 64 more)
    fwd_o32 = (tmp_path / "forward_d128_fp32_output.ptx").read_text()
    fwd_none = (tmp_path / "forward_d128_none_static_schedule.ptx").read_text()
    for ptx in (fwd_o32, fwd_none):
        assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx and "stmatrix" in ptx
    assert fwd_none.count("st.global") == 4
    assert fwd_o32.count("st.global.v2.b32") == 64 and fwd_o32.count("st.global") == 68
    # the dynamic schedule takes tiles from the global counter, the static one does not
    assert "atom.global" in (tmp_path / "forward_d128_fp32_output.ptx").read_text()
    assert "atom.global" not in (tmp_path / "forward_d128_none_static_schedule.ptx").read_text()
    # the forwards' machine code was disassembled and read (the diagnostic line is there for every pipelined loop)
    forwards = [line for line in lines if line.split()[1:2] == ["forward"]]
    assert len(forwards) == 3, lines  # two with the tile counter, one with the static schedule
    for line in forwards:
        found = re.search(r"exponentials under a PV product: min (\d+) over (\d+) loops", line)
        assert found and int(found.group(2)) >= 2, line
    # ptxas keeps every value of the forwards in registers (spills to local memory would sit in the key-tile
    # loops); the number is read from the machine code for every kernel (the backward at head_dim 128 has a few)
    for line in lines:
        found = re.search(r"spill stores (\d+)", line)
        assert found, line
        assert line.split()[1] != "forward" or found.group(1) == "0", line
    # no kernel makes ptxas serialise its asynchronous products (message C7514/C7518 "... are serialized"), which
    # would run every product one after another
    assert not any("serialized" in line for line in lines), "\n".join(lines)
