"""Worker: ``python -m tests.distributed.nan_worker KIND STEP RANK <launcher.pretrain arguments>`` trains like the
launcher, except that on process RANK the training loss of optimizer step STEP (1-based) goes bad: NaN (KIND=nan, so
are its gradients) or 1000 times too large (KIND=spike, finite). Every rank must still agree to drop that update."""

import os
import sys

from launcher import pretrain, trainer
from model.gpt import GPT


def main() -> int:
    factor = {"nan": float("nan"), "spike": 1000.0}[sys.argv[1]]
    bad_step, bad_rank = int(sys.argv[2]), int(sys.argv[3])
    current = {"step": -1}
    train_step, forward = trainer.Trainer.train_step, GPT.forward

    def tracked_train_step(self, step):
        current["step"] = step + 1
        return train_step(self, step)

    def poisoned_forward(self, idx, targets=None):
        logits, loss = forward(self, idx, targets)
        if self.training and targets is not None and current["step"] == bad_step \
                and int(os.environ.get("RANK", "0")) == bad_rank:
            loss = loss * factor
        return logits, loss

    trainer.Trainer.train_step, GPT.forward = tracked_train_step, poisoned_forward
    return pretrain.main(sys.argv[4:])


if __name__ == "__main__":
    sys.exit(main())
