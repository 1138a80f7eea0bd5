"""Worker: ``python -m tests.distributed.nan_worker KINDS STEPS RANKS <launcher.pretrain arguments>`` trains like the
launcher, except that some optimizer steps go bad. KINDS, STEPS and RANKS are comma-separated lists of the same
length (e.g. ``nan,spike 3,5 1,0``): on process RANKS[i], optimizer step STEPS[i] (1-based) goes bad: its training
loss is NaN (KINDS[i]=nan, so are its gradients) or 1000 times too large (KINDS[i]=spike, finite). Under a pipeline
the NaN is injected into the activations of the stage its rank belongs to (it reaches the loss on the last stage),
and the spike into the loss of the last stage (its rank must be one of that stage's). Every rank must still agree to
drop each such update."""

import os
import sys

from launcher import pretrain, trainer
from launcher.parallel import pipeline
from model import gpt

FACTORS = {"nan": float("nan"), "spike": 1000.0}


def main() -> int:
    kinds, steps, ranks = (sys.argv[i].split(",") for i in (1, 2, 3))
    assert len(kinds) == len(steps) == len(ranks) and len(set(steps)) == len(steps), sys.argv[1:4]
    bad = {kind: [] for kind in FACTORS}  # kind -> [(step, rank)]
    for kind, step, rank in zip(kinds, steps, ranks):
        bad[kind].append((int(step), int(rank)))
    args = sys.argv[4:]
    current = {"step": -1, "training": False}
    train_step = trainer.Trainer.train_step

    def tracked_train_step(self, step):
        current["step"], current["training"] = step + 1, True
        try:
            return train_step(self, step)
        finally:
            current["training"] = False

    def factor_now(kind: str) -> float:
        here = (current["step"], int(os.environ.get("RANK", "0")))
        return FACTORS[kind] if current["training"] and here in bad[kind] else 1.0

    trainer.Trainer.train_step = tracked_train_step
    if any(a.startswith("parallel.pipeline_parallel=") and not a.endswith("=1") for a in args):
        add_positions, loss_fn = pipeline.AddPositions.forward, gpt.token_cross_entropy
        # NaN: into the first stage's activations
        pipeline.AddPositions.forward = lambda self, x: add_positions(self, x) * factor_now("nan")
        # spike: into the last stage's loss (GPT takes its loss function when it is built)
        gpt.token_cross_entropy = lambda logits, targets: loss_fn(logits, targets) * factor_now("spike")
    else:
        forward = gpt.GPT.forward

        def poisoned_forward(self, idx, targets=None):
            logits, loss = forward(self, idx, targets)
            if targets is not None:
                loss = loss * factor_now("nan") * factor_now("spike")
            return logits, loss

        gpt.GPT.forward = poisoned_forward
    return pretrain.main(args)


if __name__ == "__main__":
    pretrain.exit_with(main())
