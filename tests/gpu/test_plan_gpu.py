"""launcher.plan against one GPU's peak allocation: a ~300M-parameter model of the large recipes' shape (BF16
autocast, the Triton kernel with the fixed arms' fix=fp32_output, with BF16 and with FP8 FFNs), two optimizer steps;
torch.cuda.max_memory_allocated of the second against the plan's peak (which adds no context or fragmentation
allowance: those are outside PyTorch's allocator or in its reserve) within TOLERANCE. Prints both, per case.

    python -m pytest tests/gpu/test_plan_gpu.py -s
"""

import importlib.util

import pytest
import torch

from launcher import plan
from launcher.config import load_config
from tests.plan_memory_worker import gpu_peak

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOLERANCE = 0.10
needs_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                              reason="transformer_engine is not installed (on a GPU machine: pip install -e '.[gpu]')")
MODEL = ["model.vocab_size=8192", "model.n_layer=16", "model.d_model=1024", "model.n_head=8", "model.max_seq_len=2048",
         "data.seq_len=2048", "data.global_batch_size=8", "data.micro_batch_size=4", "precision.dtype=bf16",
         "run.device=cuda", "arms.baseline.attention.rounding=fa2", "arms.baseline.attention.fix=fp32_output",
         "attention.autotune=false",
         "monitor.spectral_interval=0", "monitor.probe_interval=0"]


@pytest.mark.parametrize("fp8, checkpointing", [(False, False), (False, True),
                                                pytest.param(True, False, marks=needs_te)])
def test_the_plan_matches_the_gpu_peak(kjv_data, fp8, checkpointing):
    overrides = [f"data.data_dir={kjv_data}", *MODEL, f"precision.fp8_ffn={str(fp8).lower()}",
                 f"parallel.activation_checkpointing={str(checkpointing).lower()}",
                 *(["precision.fp8_recipe=current"] if fp8 and checkpointing else [])]
    config = load_config("smoke", overrides, arm="baseline")
    planned = plan.plan(config, 1)[0].peak(checkpointing)
    measured = gpu_peak(config)
    print(f"fp8={fp8} checkpointing={checkpointing}: planned {planned / 2**30:.2f} GiB, measured "
          f"{measured / 2**30:.2f} GiB ({measured / planned - 1:+.1%})")
    assert abs(measured - planned) <= TOLERANCE * planned
