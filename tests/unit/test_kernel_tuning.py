"""The autotuned tiles of the Triton kernel are part of a run's numerics (the tile decides which running maximum P is
rounded against): a checkpoint keeps this process's choices (``kernels.tuning_record``) and a resumed process
installs them (``kernels.install_tuning``) instead of timing the candidates again. CPU: the record's round trip,
the refusal of another GPU's record, an installed choice driving a launch (with a stand-in for Triton's JIT
function), and the trainer's save and resume. That a resumed GPU process then trains bit for bit is the GPU test
tests/gpu/test_train_gpu.py::test_resume_in_a_new_process_is_bit_exact_with_autotuned_tiles.

kernels.triton_flash is imported inside the tests: the interpreter tests must be the first to import it.
"""

from __future__ import annotations

import json

import pytest
import torch

import kernels
from launcher.checkpoint import read_whole_checkpoint
from launcher.config import load_config
from launcher.parallel.dims import ParallelDims
from launcher.trainer import train_arm
from tests.unit.test_attention_launch import FakeJit

DQ_KEY = ("dq", False, 1024, 64, True, False, torch.bfloat16)


@pytest.fixture
def tf(monkeypatch):
    from kernels import triton_flash

    for kernel in triton_flash.TUNED.values():  # this test's choices only, restored afterwards
        monkeypatch.setattr(kernel, "chosen", {})
    monkeypatch.setattr(triton_flash, "_device_name", lambda: "NVIDIA H200")
    return triton_flash


def test_the_record_survives_json_and_installs_the_same_choices(tf):
    cfg = {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_ctas": 1, "num_stages": 3}
    tf.DQ.chosen[DQ_KEY] = dict(cfg)
    record = json.loads(json.dumps(tf.tuning_record()))  # what a checkpoint could hold, as plain values
    assert record["device"] == "NVIDIA H200" and set(record["choices"]) == {"dq"}
    tf.DQ.chosen.clear()
    message = tf.install_tuning(record)
    assert tf.DQ.chosen == {DQ_KEY: cfg}  # the dtype in the key came back as torch.bfloat16
    assert "installed 1 recorded" in message and "NVIDIA H200" in message


def test_another_gpus_record_is_not_installed_and_says_why(tf):
    tf.FWD.chosen[("fwd", 256, 64, True, True, 0, 0, torch.bfloat16, True, False)] = {"BLOCK_M": 64, "BLOCK_N": 64}
    record = tf.tuning_record()
    tf.FWD.chosen.clear()
    record["device"] = "NVIDIA A100-SXM4-80GB"
    message = tf.install_tuning(record)
    assert tf.FWD.chosen == {}
    assert "autotuned on NVIDIA A100-SXM4-80GB, this is NVIDIA H200" in message and "numerics may differ" in message
    assert tf.install_tuning({}) == "" and tf.install_tuning(None) == ""


def test_an_installed_choice_is_what_the_launch_uses_without_timing(tf, monkeypatch):
    monkeypatch.setattr(tf, "INTERPRET", False)
    monkeypatch.setattr(tf, "FAST_LAUNCH", False)  # through the (fake) JIT entry point, which logs its arguments
    fake = FakeJit()
    kernel = tf._Kernel(fake, dict(BLOCK=64))
    kernel.tuner = "never called: a call with a chosen key does not time the candidates"
    monkeypatch.setattr(tf, "TUNED", {"fake": kernel})
    key = ("fake", 128)
    tf.install_tuning({"device": "NVIDIA H200", "choices": {"fake": [[list(key), {"BLOCK": 32}]]}})
    x = torch.zeros(4)
    used = kernel(lambda c: (128 // c["BLOCK"], 3), (x, x), (128,), (0.5,), {"A": 7}, key)
    assert used == {"BLOCK": 32}
    (_, grid, _, kwargs), = fake.log
    assert grid == (4, 3) and kwargs["BLOCK"] == 32


def test_kernels_module_level_calls_do_nothing_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernels.install_tuning({"device": "NVIDIA H200", "choices": {"dq": [[list(DQ_KEY[:-1]), {}]]}}) == ""


def test_a_checkpoint_keeps_the_record_and_a_resume_installs_it(tiny_overrides, monkeypatch, capsys):
    record = {"device": "NVIDIA H200",
              "choices": {"forward": [[["fwd", 64, 64, True, True, 0, 0, "dtype:bfloat16", False, False],
                                       {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}]]}}
    monkeypatch.setattr(kernels, "tuning_record", lambda: record)  # as a GPU process would have it
    common = tiny_overrides + ["run.max_steps=4", "optim.decay_steps=4", "checkpoint.interval=2"]
    first = train_arm(load_config("smoke", common + ["run.max_steps=2"]), ParallelDims())
    assert first.status == "completed"
    assert read_whole_checkpoint(first.run_dir / "checkpoints" / "step_00000002")["kernel_tuning"] == record
    installed = []
    monkeypatch.setattr(kernels, "install_tuning", lambda r: installed.append(r) or "installed 1 recorded ...")
    capsys.readouterr()
    rest = train_arm(load_config("smoke", common), ParallelDims())
    assert rest.status == "completed" and installed == [record]
    assert "installed 1 recorded" in capsys.readouterr().out
