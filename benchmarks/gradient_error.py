"""Whole-model gradient error of every attention numerics mode on a trained checkpoint, against an fp64 oracle.

    python -m benchmarks.gradient_error runs/smoke/fixed/checkpoints/step_00000120 [--batch 8] [--seed 0]

Loads the checkpoint's model, takes one batch of its training data, and compares the full parameter gradient of each
(rounding, fix) pair through ``kernels.reference_attention`` with the gradient of the same model in fp64 with exact
attention. A fix that only moves the softmax maximum should leave the error where ``fix=none`` has it; a larger error
would point at a wrong backward. Runs on the CPU (the reference path), in seconds for the smoke model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import kernels
from launcher.checkpoint import RUN, load_model_weights
from launcher.data import DataError, TokenData, step_offsets, windows
from launcher.sharded import read_whole
from model import GPT, AttentionConfig, GPTConfig, build_attention


def full_gradient(model: GPT, x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten().double() for p in model.parameters()])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gradient_error", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoints/step_XXXXXXXX folder written by launcher.pretrain")
    parser.add_argument("--batch", type=int, default=8, help="sequences in the batch (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch's offsets (default %(default)s)")
    args = parser.parse_args(argv)
    path = Path(args.checkpoint)
    if not (path / ".metadata").is_file():
        print(f"error: no checkpoint at {path}", file=sys.stderr)
        return 2
    state = read_whole(path, [RUN])[RUN]
    config = state["config"]
    try:
        data = TokenData.open(config["data"]["data_dir"])
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model_config = GPTConfig(**config["model"])
    seq = config["data"]["seq_len"]
    x, y = windows(data.train, step_offsets(args.seed, 0, args.batch, seq, len(data.train)), seq)

    oracle = GPT(model_config)
    load_model_weights(path, oracle)
    oracle.double()  # SDPA in fp64: no rounding anywhere
    exact_loss, exact = full_gradient(oracle, x, y)
    print(f"{path} (step {state['step']}), batch {args.batch} x {seq}; fp64 loss {exact_loss:.5f}")
    print(f"{'numerics':<28} {'loss':>9} {'grad rel. error':>16} {'cosine':>10}")
    for rounding in kernels.ROUNDINGS:
        for fix in kernels.FIXES:
            model = GPT(model_config, build_attention(AttentionConfig(backend="reference", rounding=rounding, fix=fix),
                                                      torch.device("cpu")))
            load_model_weights(path, model)
            loss, grad = full_gradient(model, x, y)
            err = ((grad - exact).norm() / exact.norm()).item()
            cos = torch.nn.functional.cosine_similarity(grad, exact, dim=0).item()
            print(f"{rounding + '/' + fix:<28} {loss:>9.5f} {err:>16.3e} {cos:>10.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
