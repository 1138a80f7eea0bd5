"""Helpers for tests that start the launcher in subprocesses and read what the runs wrote."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parent.parent


def events(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    """{step: value} of one TensorBoard scalar of a run ({} if the run never wrote it)."""
    acc = events(run_dir)
    return {e.step: e.value for e in acc.Scalars(tag)} if tag in acc.Tags()["scalars"] else {}


def all_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar tag of a run: {tag: {step: value}}."""
    acc = events(run_dir)
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env() -> dict[str, str]:
    # one thread per process: the CPU tests start several processes on few cores
    # faulthandler: a worker killed by a signal prints its Python stack
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


def launch(args: list[str], nproc: int = 1, module: str = "launcher.pretrain", timeout: int = 600,
           check: bool = True) -> subprocess.CompletedProcess:
    """``python -m module args``, or the same under torchrun with ``nproc`` CPU processes (gloo)."""
    if nproc == 1:
        cmd = [sys.executable, "-m", module, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), "-m", module, *args]
    # own process group: a run that hangs past the timeout is killed with all of torchrun's workers
    with subprocess.Popen(cmd, cwd=REPO, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            stdout, stderr = popen.communicate()
            raise AssertionError(f"timed out after {timeout} s (a hang?): {' '.join(cmd)}\n{stdout[-3000:]}\n"
                                 f"{stderr[-3000:]}") from None
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        # the workers' own errors come before torchrun's summary: keep the lines that say what went wrong
        lines = proc.stderr.splitlines()
        fatal = next((i for i, line in enumerate(lines) if "Fatal Python error" in line), None)
        said = lines[fatal:fatal + 40] if fatal is not None else \
            [line for line in lines if any(w in line for w in ("rror", "abort", "terminate"))]
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-4000:]}\n"
                             + "\n".join(said[:40]) + f"\n...\n{proc.stderr[-2000:]}")
    return proc


def fresh_python_json(code: str, timeout: int = 300):
    """Run ``code`` in a fresh interpreter (repo on the path, nothing else of this environment) and parse the JSON
    its last line prints: for Gluon, which cannot be imported into a process whose Triton was first imported under
    TRITON_INTERPRET=1 (the unit tier's Triton-interpreter tests)."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])

