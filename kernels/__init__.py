"""Flash attention with explicit, selectable rounding (Qiu & Yao, arXiv 2510.04212): Triton kernel and reference."""

from kernels.modes import FIXES, ROUNDINGS
from kernels.reference import reference_attention

__all__ = ["ROUNDINGS", "FIXES", "flash_attention", "reference_attention", "saved_output"]
