"""Train the arms of an experiment: ``python -m launcher.pretrain RECIPE [section.field=value ...] [--arm NAME]``.

Runs alone, under ``torchrun --nproc-per-node N`` or under ``srun`` (one process per device; gloo on CPU, NCCL on
GPU). Every arm of the recipe is trained in turn with the same seed and the same batches; the arms differ only in
attention numerics. Each arm writes TensorBoard events, checkpoints and its batch offsets to
``<run.out_dir>/<run.experiment>/<arm>/``; at the end the comparison report of the arms is written
(``launcher/compare.py``). Ctrl-C or SIGTERM saves a checkpoint at the end of the current step; the same command
resumes.

Exit status: 0 done; 2 a setting to change (one line says which); 3 the guard stopped an arm (a non-finite loss or
gradient); 4 the early warning stopped one (monitor.on_warning=stop, launcher/on_warning.py); 130 interrupted (the
same command resumes). SLURM's batch script requeues none of 2, 3 and 4.
"""

from __future__ import annotations

from launcher.stop_signals import STOP

if __name__ == "__main__":  # before torch loads: a time-limit warning during the imports must not kill the leg
    STOP.trap_scheduler_signals()

import argparse  # noqa: E402 (the imports below load torch)
import math
import os
import sys
from typing import NoReturn, Optional

import yaml

from launcher import distributed
from launcher.checkpoint import HashingWriter
from launcher.compare import CompareError
from launcher.config import (ConfigError, arm_names, build_config, describe, environment_problems, load_recipe,
                             parameter_estimate, problems_error)
from launcher.data import DataError
from launcher.on_warning import EXIT_STATUS as WARNING_EXIT_STATUS
from launcher.trainer import train_arm


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m launcher.pretrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", help="recipe name in recipes/ (e.g. smoke) or a YAML path")
    parser.add_argument("overrides", nargs="*", help="section.field=value, e.g. run.max_steps=100 optim.lr=3e-4")
    parser.add_argument("--arm", action="append", help="train only this arm (repeatable); default: every arm")
    parser.add_argument("--no-report", action="store_true", help="skip the comparison report at the end")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config of each arm and exit")
    parser.add_argument("--experiment-dir", action="store_true",
                        help="validate like --dry-run, then print only the experiment folder "
                             "(<run.out_dir>/<run.experiment>) and exit; for batch scripts")
    parser.add_argument("--help-config", action="store_true", help="list every config field with its meaning")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after --arm
    if args.help_config:
        print(describe())
        sys.exit(0)
    if not args.recipe:
        parser.error("give a recipe, e.g. `python -m launcher.pretrain smoke`")
    return args


def write_report_when_ended(tree: dict, config) -> None:
    """Write the comparison report once every arm of the recipe has ended, however it ended (completed, stopped by
    the guard, interrupted, crashed or killed; launcher/arm_status.py), in this command or an earlier one; otherwise
    say which arms have not and how to write it later."""
    from launcher.arm_status import read_ending
    from launcher.compare import write_report

    names = arm_names(tree)
    if len(names) < 2:
        return
    experiment_dir = config.run_dir.parent
    waiting = []
    for arm in names:
        folder = experiment_dir / arm
        if not (folder / "config.yaml").is_file():
            waiting.append(f"{arm} has not started")
        elif not read_ending(folder, 0).ended:
            waiting.append(f"{arm} is still training")
    if waiting:
        print(f"[report] not written yet: {'; '.join(waiting)}; once every arm has ended, "
              f"`python -m launcher.compare {experiment_dir}` writes it", flush=True)
        return
    write_report(experiment_dir)  # prints its summary and the report's path


def newest_checkpoint(config) -> str:
    """What a rerun of ``config`` would resume from, in words."""
    from launcher.checkpoint import CheckpointStore

    latest = CheckpointStore(config.run_dir).latest()
    if latest is None:
        return f"{config.run_dir} holds no checkpoint yet: the same command starts this arm over"
    return f"the same command resumes {config.run.arm} from {latest} (the newest checkpoint)"


CPU_STEP_WARNING_TFLOP = 1.0  # ~10 s or more per step on a CPU


def cpu_warning(config) -> Optional[str]:
    """A warning for a model too large to train on a CPU, before its first (silent) step: training FLOPs per step
    from the usual 6 x parameters x tokens (+ attention), without building the model."""
    m, d = config.model, config.data
    params, _ = parameter_estimate(config)
    tokens = d.global_batch_size * d.seq_len
    tflop = (6 * params + 12 * m.n_layer * m.d_model * d.seq_len) * tokens / 1e12
    if tflop < CPU_STEP_WARNING_TFLOP:
        return None
    return (f"this runs on the CPU: ~{params / 1e6:,.0f}M parameters x {tokens:,} tokens per step is ~{tflop:,.0f} "
            f"TFLOP per step, minutes to hours per step here, and the first progress line comes after step "
            f"{min(config.run.log_interval, config.run.max_steps)}. Use a GPU, or a small recipe (smoke) on a CPU")


def main(argv: Optional[list[str]] = None, checkpoint_writer=HashingWriter) -> int:
    """The command line; ``checkpoint_writer`` is passed on to the trainer (launcher/checkpoint.py; tests inject a
    writer that pauses mid-save, tests/paused_save_worker.py)."""
    STOP.trap_scheduler_signals()  # SLURM's USR1 or TERM while starting or resuming: stop after the first step
    args = parse_args(argv)
    dims = current = None
    try:
        tree = load_recipe(args.recipe, args.overrides)
        arms = args.arm or arm_names(tree)
        world = distributed.world_size_from_env()
        configs, problems = [], []  # every arm validated before any work starts, every problem said at once
        for arm in arms:
            try:
                configs.append(build_config(tree, arm, world))
                distributed.prepare_environment(configs[0].parallel)  # before anything starts CUDA
            except ConfigError as err:
                problems += err.problems
                if err.partial is not None:  # what this machine cannot do of the rest, in the same pass
                    problems += environment_problems(err.partial[0], frozenset(err.partial[1]))
        problems += [p for config in configs for p in environment_problems(config)]
        if problems:
            raise problems_error(problems)
        if args.experiment_dir:
            print(configs[0].run_dir.parent)
            return 0
        if args.dry_run:
            for config in configs:
                print(f"# arm {config.run.arm}\n" + yaml.safe_dump(config.to_dict(), sort_keys=False))
            return 0
        dims = distributed.init(configs[0].run.device, configs[0].parallel, configs[0].distributed,
                                configs[0].run_dir.parent / "flight_recorder")
        if dims.device.type == "cpu":
            threads = distributed.set_cpu_threads()
            if dims.is_logging_rank:
                print(f"[train] {threads}", flush=True)
        results = []
        for config in configs:
            current = config
            if dims.device.type == "cpu" and dims.is_logging_rank:
                warning = cpu_warning(config)
                if warning:
                    print(f"[{config.run.arm}] {warning}", flush=True)
            results.append(train_arm(config, dims, checkpoint_writer))
            if results[-1].stop_requested:
                break  # the user asked to stop: do not start the next arm
        stop_requested = any(r.stop_requested for r in results)
        if dims.is_logging_rank and not args.no_report and not stop_requested:
            write_report_when_ended(tree, configs[0])
        distributed.shutdown(wait_for_all=True)
        if dims.is_logging_rank:  # inside the try: a second Ctrl-C while it prints is still answered in one line
            for r in results:
                loss = f"last loss {r.last_loss:.4f}" if math.isfinite(r.last_loss) else r.message or "no finite loss"
                how = f"stopped by the guard ({r.message})" if r.status == "stopped" else r.status
                print(f"[summary] {r.arm}: {how} at step {r.steps}, {loss}  ({r.run_dir})")
    except (ConfigError, DataError, CompareError) as err:
        if int(os.environ.get("RANK", "0")) == 0:  # every rank validates the same input: say it once
            print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C: say what is on disk, not what might be
        print(f"aborted without saving; {newest_checkpoint(current) if current else 'nothing was trained'}",
              file=sys.stderr)
        return 130
    finally:
        distributed.shutdown()
    if any(r.stop_requested for r in results):
        return 130
    if any(r.status == "stopped" for r in results):
        return 3
    return WARNING_EXIT_STATUS if any(r.status == "stopped_by_warning" for r in results) else 0


def exit_with(status: int) -> NoReturn:
    """Exit the process with ``main``'s status. A USR1 or TERM from here on has nothing left to save; ignored, it
    cannot kill the interpreter's teardown (launcher/stop_signals.py) and turn a finished leg into status 138. A
    member of a multi-process job skips that teardown (``distributed.exit_process``)."""
    STOP.ignore_while_exiting()
    distributed.exit_process(status)


if __name__ == "__main__":
    exit_with(main())
