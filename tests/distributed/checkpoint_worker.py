"""Worker of tests/distributed/test_sharded_checkpoints.py, run under torchrun (or alone for one process):

    python -m tests.distributed.checkpoint_worker write OUT DATA
        trains each source layout (ZeRO-3 over DP4; TP2 x PP2) of the tiny test model for 6 steps, with a checkpoint
        at step 6 in OUT/<layout>; then, for a model 100x larger and both layouts, creates the Adam state (zero
        moments, no step) and saves it once with files of at most FILE_BYTES, measuring each rank's resident memory
        while it saves. Prints one line per rank and save:
        ``save memory: <layout> rank <r>: before <b> peak <p> wrote <w> held <h> files <n>`` (bytes).
    python -m tests.distributed.checkpoint_worker reshard OUT DATA
        for each source checkpoint and each layout this world size has (1 process; DP2 with DDP and with ZeRO-2,
        TP2, PP2 with 2), resumes a copy of it and saves it again at once (no step in between); the logging rank
        compares the two checkpoints, read whole: ``<source> -> <layout>: identical`` when every parameter, Adam
        moment, the step counts, the guard and the monitors' per-head state are equal bit for bit, else what
        differs.

Exits 1 on a failed comparison."""

import shutil
import sys
import threading
import time
from pathlib import Path

import torch

from launcher import checkpoint, distributed
from launcher.checkpoint import CheckpointStore, read_whole_checkpoint, training_entries
from launcher.config import load_config
from launcher.parallel import dims as parallel_dims
from launcher.trainer import Trainer

STEP = 6
FILE_BYTES = 16 * 2**20
TINY = ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.max_seq_len=64", "data.seq_len=64",
        "data.global_batch_size=8", "data.micro_batch_size=2", "optim.warmup_steps=2", "optim.decay_steps=10",
        "eval.interval=3", "eval.batches=2", "monitor.spectral_interval=5", "monitor.probe_interval=5",
        "precision.dtype=fp32", "arms.fixed.attention.fix=dynamic_max", "run.log_interval=100"]
LARGE = ["model.n_layer=6", "model.d_model=512", "model.n_head=8", "monitor.spectral_interval=0",
         "monitor.probe_interval=0"]  # ~20M parameters: 240 MB of parameters and moments
SOURCES = {"zero3_dp4": ["parallel.zero_stage=3"],
           "tp2_pp2": ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"]}
TARGETS = {1: {"single": []},
           2: {"dp2": [], "dp2_zero2": ["parallel.zero_stage=2"], "tp2": ["parallel.tensor_parallel=2"],
               "pp2": ["parallel.pipeline_parallel=2"]}}


def trainer_for(out: Path, data: str, name: str, overrides: list[str], world: int, base) -> Trainer:
    config = load_config("smoke", [*TINY, *overrides, f"data.data_dir={data}", f"run.out_dir={out}",
                                   f"run.experiment={name}", f"checkpoint.interval={STEP}"],
                         arm="fixed", world_size=world)
    return Trainer(config, parallel_dims.build(config.parallel, world, base.rank, base.local_rank, base.device))


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakMemory:
    """The largest resident set size of this process while the context is open, sampled every 0.2 ms."""

    def __enter__(self):
        self.before = self.peak = resident_bytes()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.is_set():
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.0002)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())


def measured_save(trainer: Trainer, name: str) -> None:
    """Save ``trainer``'s state once at step 1 (its Adam state created, zero), measuring this rank's memory."""
    trainer.engine.prepare_state_load(1)  # the moments' storage, as after a first step
    entries = training_entries(trainer.engine.state_pieces(), trainer.dims)
    held = sum(t.numel() * t.element_size() for e in entries.values() for _, t in e.chunks)
    del entries
    with PeakMemory() as memory:
        trainer.save_checkpoint(1)
    rank = trainer.dims.rank
    files = list((trainer.store.dir / "step_00000001").glob(f"__{rank}_*.distcp"))
    wrote = sum(f.stat().st_size for f in files)
    print(f"save memory: {name} rank {rank}: before {memory.before} peak {memory.peak} wrote {wrote} held {held} "
          f"files {len(files)}", flush=True)


def write(out: Path, data: str, world: int, base) -> int:
    for name, overrides in SOURCES.items():
        trainer = trainer_for(out, data, name, [*overrides, f"run.max_steps={STEP}"], world, base)
        assert trainer.fit().status == "completed"
    checkpoint.FILE_BYTES = FILE_BYTES  # several files per rank at this size, as a large model has at the default
    for name, overrides in SOURCES.items():
        trainer = trainer_for(out, data, f"large_{name}", [*overrides, *LARGE, "run.max_steps=1"], world, base)
        measured_save(trainer, name)
        trainer.engine.close()
    return 0


def differences(a: dict, b: dict) -> list[str]:
    found = [k for k in ("step", "guard") if a[k] != b[k]]
    if a["optimizer"]["adam_step"] != b["optimizer"]["adam_step"]:
        found.append("adam_step")
    for name, tensor in a["model"].items():
        if name not in b["model"] or not torch.equal(tensor, b["model"][name]):
            found.append(name)
        for key, moment in a["optimizer"]["state"].get(name, {}).items():
            if not torch.equal(moment, b["optimizer"]["state"][name][key]):
                found.append(f"{key} of {name}")
    for key, value in a["monitors"].items():
        if isinstance(value, torch.Tensor) and not torch.equal(value, b["monitors"].get(key)):
            found.append(key)
    return found + sorted(set(a["model"]) ^ set(b["model"]))


def reshard(out: Path, data: str, world: int, base) -> int:
    failed = 0
    for source in SOURCES:
        saved = out / source / "fixed" / "checkpoints" / f"step_{STEP:08d}"
        for target, overrides in TARGETS[world].items():
            name = f"{source}_to_{target}"
            if base.rank == 0:
                shutil.rmtree(out / name, ignore_errors=True)
                shutil.copytree(saved, out / name / "fixed" / "checkpoints" / saved.name)
            if world > 1:
                torch.distributed.barrier()
            trainer = trainer_for(out, data, name, [*overrides, f"run.max_steps={STEP}"], world, base)
            assert trainer.start_step == STEP
            trainer.store = CheckpointStore(out / f"{name}_again")  # the loaded state, saved again at once
            trainer.save_checkpoint(STEP)
            trainer.engine.close()
            if trainer.lock is not None:
                trainer.lock.release()
            if base.rank == 0:
                bad = differences(read_whole_checkpoint(saved),
                                   read_whole_checkpoint(trainer.store.dir / saved.name))
                print(f"{source} -> {target}: " + (f"differs in {bad[:5]}" if bad else "identical"), flush=True)
                failed += bool(bad)
    return 1 if failed else 0


def main() -> int:
    mode, out, data = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    world = distributed.world_size_from_env()
    base = distributed.init("cpu")
    code = {"write": write, "reshard": reshard}[mode](out, data, world, base)
    distributed.shutdown(wait_for_all=True)
    return code


if __name__ == "__main__":
    distributed.exit_process(main())
