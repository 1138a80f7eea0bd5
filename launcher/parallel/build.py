"""The engine of a layout, around the part of the model that launcher/parallelize.py made for this rank."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from torch import nn

from launcher.config import Config
from launcher.parallel.dims import ParallelDims
from launcher.parallel.engine import Engine, LocalEngine, ZeroEngine
from launcher.parallel.pipeline import PipelineEngine, PipelineStage


def build_engine(part: nn.Module | PipelineStage, config: Config, dims: ParallelDims,
                 run_dir: Optional[Path] = None) -> Engine:
    """DeepSpeed's pipeline engine around a pipeline stage; else DDP (``parallel.zero_stage=0``) or DeepSpeed ZeRO
    around the whole model. ``run_dir``: where DeepSpeed's JSON config is written (None: nowhere)."""
    if isinstance(part, PipelineStage):
        return PipelineEngine(part, config, dims, run_dir)
    if config.parallel.zero_stage == 0:
        return LocalEngine(part, config, dims)
    return ZeroEngine(part, config, dims, run_dir)
