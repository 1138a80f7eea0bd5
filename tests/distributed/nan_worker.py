"""Worker: ``python -m tests.distributed.nan_worker KIND STEP RANK <launcher.pretrain arguments>`` trains like the
launcher, except that on process RANK optimizer step STEP (1-based) goes bad: its training loss is NaN (KIND=nan,
so are its gradients) or 1000 times too large (KIND=spike, finite). Under a pipeline the NaN is injected into the
activations of the stage RANK belongs to (it reaches the loss on the last stage), and the spike into the loss of the
last stage (RANK must be one of its ranks). Every rank must still agree to drop that update."""

import os
import sys

from launcher import pretrain, trainer
from launcher.parallel import pipeline
from model import gpt


def main() -> int:
    factor = {"nan": float("nan"), "spike": 1000.0}[sys.argv[1]]
    bad_step, bad_rank = int(sys.argv[2]), int(sys.argv[3])
    args = sys.argv[4:]
    current = {"step": -1, "training": False}
    train_step = trainer.Trainer.train_step

    def tracked_train_step(self, step):
        current["step"], current["training"] = step + 1, True
        try:
            return train_step(self, step)
        finally:
            current["training"] = False

    def bad_now() -> bool:
        return current["training"] and current["step"] == bad_step and int(os.environ.get("RANK", "0")) == bad_rank

    trainer.Trainer.train_step = tracked_train_step
    if any(a.startswith("parallel.pipeline_parallel=") and not a.endswith("=1") for a in args):
        add_positions, loss_fn = pipeline.AddPositions.forward, gpt.token_cross_entropy
        if factor != factor:  # NaN: into the first stage's activations
            pipeline.AddPositions.forward = lambda self, x: add_positions(self, x) * (factor if bad_now() else 1.0)
        else:  # spike: into the last stage's loss (GPT takes its loss function when it is built)
            gpt.token_cross_entropy = lambda logits, targets: loss_fn(logits, targets) * (factor if bad_now() else 1.0)
    else:
        forward = gpt.GPT.forward

        def poisoned_forward(self, idx, targets=None):
            logits, loss = forward(self, idx, targets)
            return logits, (loss * factor if bad_now() and targets is not None else loss)

        gpt.GPT.forward = poisoned_forward
    return pretrain.main(args)


if __name__ == "__main__":
    sys.exit(main())
