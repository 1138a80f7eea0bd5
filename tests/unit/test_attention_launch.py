"""The host-side launch cache of the Triton kernels (``kernels.triton_flash._Kernel``), with a stand-in for Triton's
JIT function: which calls go through Triton, which reuse a cached binary, and the argument order handed to the
binary's launcher. The bit-level check against real launches is on the GPU
(tests/gpu/test_attention_gpu.py::test_cached_launch_equals_tritons_launch).

kernels.triton_flash is imported inside the tests: the interpreter tests must be the first to import it (they set
TRITON_INTERPRET=1 for that import).
"""

from __future__ import annotations

import pytest
import torch


class FakeCompiled:
    """What Triton's JIT call returns: a compiled kernel with a launcher."""

    def __init__(self, log):
        self.function, self.packed_metadata = "function-handle", "packed-metadata"
        self.log = log

    @property
    def run(self):
        def launcher(*args):
            self.log.append(("cached", args))
        return launcher


class FakeJit:
    """Stands in for a @triton.jit function kernel(X, Y, n, scale, A: constexpr, BLOCK: constexpr)."""

    arg_names = ["X", "Y", "n", "scale", "A", "BLOCK"]
    constexprs = [4, 5]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return FakeCompiled(self.log)
        return call


@pytest.fixture
def tf(monkeypatch):
    from kernels import triton_flash

    monkeypatch.setattr(triton_flash, "INTERPRET", False)
    monkeypatch.setattr(triton_flash, "FAST_LAUNCH", True)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    return triton_flash


def launch(tf, kernel, x, y, n=128):
    return kernel(lambda c: (n // c["BLOCK"], 3), (x, y), (n,), (0.5,), {"A": 7}, None)


def test_first_call_goes_through_triton_then_the_binary_is_reused(tf):
    fn = FakeJit()
    kernel = tf._Kernel(fn, dict(BLOCK=32, num_warps=4))
    x, y = torch.zeros(64), torch.zeros(64)
    assert launch(tf, kernel, x, y) == dict(BLOCK=32, num_warps=4)
    assert [e[0] for e in fn.log] == ["triton"]
    assert fn.log[0][1:] == ((4, 3), (x, y, 128, 0.5), {"A": 7, "BLOCK": 32, "num_warps": 4})
    launch(tf, kernel, x, y)
    launch(tf, kernel, x, y)
    assert [e[0] for e in fn.log] == ["triton", "cached", "cached"]
    # grid x, y, z, stream, function, metadata, no launch metadata or hooks, then every argument in the kernel's
    # order: tensors, ints, floats, constexpr values (A, BLOCK)
    assert fn.log[1][1] == (4, 3, 1, 77, "function-handle", "packed-metadata", None, None, None, x, y, 128, 0.5, 7, 32)


@pytest.mark.parametrize("change", ["integer", "dtype", "alignment", "config"])
def test_a_new_specialisation_compiles_through_triton(tf, change):
    """Anything the binary depends on (integer values, dtypes, 16-byte alignment, configuration) misses the cache."""
    fn = FakeJit()
    kernel = tf._Kernel(fn, dict(BLOCK=32, num_warps=4))
    x, y = torch.zeros(64), torch.zeros(64)
    launch(tf, kernel, x, y)
    if change == "integer":
        launch(tf, kernel, x, y, n=256)
    elif change == "dtype":
        launch(tf, kernel, x.double(), y)
    elif change == "alignment":
        assert x[1:].data_ptr() % 16 != 0
        launch(tf, kernel, x[1:], y)
    else:
        kernel.fixed = dict(BLOCK=64, num_warps=4)
        launch(tf, kernel, x, y)
    assert [e[0] for e in fn.log] == ["triton", "triton"]
    assert len(kernel.binaries) == 2


def test_launch_hooks_and_the_switch_use_tritons_path(tf, monkeypatch):
    """A registered launch hook (a profiler such as Proton) or FAST_LAUNCH off: every call through Triton."""
    import triton

    fn = FakeJit()
    kernel = tf._Kernel(fn, dict(BLOCK=32, num_warps=4))
    x, y = torch.zeros(64), torch.zeros(64)
    monkeypatch.setattr(tf, "FAST_LAUNCH", False)
    launch(tf, kernel, x, y)
    launch(tf, kernel, x, y)
    monkeypatch.setattr(tf, "FAST_LAUNCH", True)
    hook = triton.knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # Triton >= 3.5: a hook chain
        def enter(*_):
            return None
        hook.add(enter)
        try:
            launch(tf, kernel, x, y)
        finally:
            hook.remove(enter)
    else:  # older Triton: a single optional callable
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *_: None)
        launch(tf, kernel, x, y)
    assert [e[0] for e in fn.log] == ["triton"] * 3
    assert not kernel.binaries


def test_set_fast_launch_returns_the_previous_setting(tf):
    assert tf.set_fast_launch(False) is True
    assert tf.FAST_LAUNCH is False
    assert tf.set_fast_launch(True) is False
    assert tf.FAST_LAUNCH is True


class FakeTuner:
    """Stands in for triton.autotune's wrapper: records its launches and 'picks' one configuration."""

    def __init__(self):
        self.calls = 0
        self.best_config = self

    def all_kwargs(self):
        return dict(BLOCK=64, num_warps=8)

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls += 1
        return call


def test_autotune_off_launches_the_fixed_configuration(tf):
    """A launch without a tuning key (autotune=False) never reaches the autotuner and uses the fixed tiles; with a
    key the autotuner runs once and its choice is kept."""
    fn = FakeJit()
    kernel = tf._Kernel(fn, dict(BLOCK=32, num_warps=4))
    kernel.tuner = FakeTuner()
    x, y = torch.zeros(64), torch.zeros(64)
    grid = lambda c: (128 // c["BLOCK"], 3)  # noqa: E731
    assert kernel(grid, (x, y), (128,), (0.5,), {"A": 7}, None) == dict(BLOCK=32, num_warps=4)
    assert kernel.tuner.calls == 0
    assert kernel(grid, (x, y), (128,), (0.5,), {"A": 7}, ("key",)) == dict(BLOCK=64, num_warps=8)
    assert kernel(grid, (x, y), (128,), (0.5,), {"A": 7}, ("key",)) == dict(BLOCK=64, num_warps=8)
    assert kernel.tuner.calls == 1
    assert kernel(grid, (x, y), (128,), (0.5,), {"A": 7}, None) == dict(BLOCK=32, num_warps=4)
