"""Which implementation computes a call (kernels.implementation): backend=auto takes the Gluon kernel on a Hopper
GPU only where it is the faster one, by name every backend is what it says; the banner says what runs."""

import pytest
import torch

import kernels
from kernels.modes import AttentionSettings


@pytest.fixture
def gpu(monkeypatch):
    """Pretend device cuda:0 is a Hopper GPU (or, with the returned setter, another one); no GPU is touched."""
    monkeypatch.setattr(kernels, "_HOPPER", {0: True})
    return lambda hopper: kernels._HOPPER.__setitem__(0, hopper)


def test_auto_takes_gluon_on_hopper_at_head_dim_128_for_the_modes_it_implements(gpu):
    cuda = torch.device("cuda", 0)
    for fix in ("none", "fp32_output", "stochastic_output"):
        assert kernels.implementation(AttentionSettings(fix=fix), cuda, 128) == "gluon"
        assert kernels.implementation(AttentionSettings(fix=fix), cuda, None) == "gluon"  # head size not known yet
    assert kernels.implementation(AttentionSettings(), cuda, 64) == "triton"  # slower there (docs, Speed)
    assert kernels.implementation(AttentionSettings(fix="dynamic_max"), cuda, 128) == "triton"
    assert kernels.implementation(AttentionSettings(rounding="paper"), cuda, 128) == "triton"
    assert kernels.implementation(AttentionSettings(fix="exact_delta"), cuda, 128) == "triton"  # issue 34's modes
    assert kernels.implementation(AttentionSettings(output_gain=4.0), cuda, 128) == "triton"
    assert kernels.implementation(AttentionSettings(delta_gain=4.0, delta_reference="exact"), cuda, 128) == "triton"
    assert kernels.implementation(AttentionSettings(delta_gain=4.0), cuda, 128) == "gluon"
    gpu(False)
    assert kernels.implementation(AttentionSettings(), cuda, 128) == "triton"  # not a Hopper GPU


def test_named_backends_and_the_cpu(gpu):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert kernels.implementation(AttentionSettings(), cpu, 128) == "reference"
    for name in ("triton", "gluon", "reference"):
        assert kernels.implementation(AttentionSettings(backend=name), cuda, 64) == name


