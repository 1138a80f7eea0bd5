"""Benchmarks that print measured ratios (``python -m benchmarks.<name> --help``)."""

import sys


def cuda_missing(prog: str, why: str = "") -> bool:
    """Whether this machine lacks a CUDA GPU, said on stderr (a GPU benchmark then exits with status 2)."""
    import torch

    if torch.cuda.is_available():
        return False
    print(f"{prog} needs a CUDA GPU" + (f" ({why})" if why else ""), file=sys.stderr)
    return True
