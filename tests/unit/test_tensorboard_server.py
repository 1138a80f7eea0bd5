"""A real TensorBoard server reads both arms' monitor tags (and the comparison's layout) over its HTTP API."""

import contextlib
import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

from launcher import compare
from launcher.config import Config
from launcher.monitors.monitors import Monitors
from model import GPT, GPTConfig, build_attention
from tests.runs import free_port


pytestmark = pytest.mark.usefixtures("single_thread")

STARTUP_TIMEOUT_S = 90


def get_json(port: int, path: str, **query):
    url = f"http://127.0.0.1:{port}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def write_arm(run_dir, fix):
    """Monitors of a tiny model with the arm's fix, logged at steps 1 and 2 like the trainer does."""
    config = Config()
    config.model = GPTConfig(vocab_size=64, max_seq_len=32, n_layer=2, n_head=2, d_model=32)
    config.attention.rounding, config.attention.fix, config.attention.backend = "paper", fix, "reference"
    config.monitor.spectral_interval = config.monitor.probe_interval = 1
    torch.manual_seed(0)
    model = GPT(config.model, build_attention(config.attention, torch.device("cpu")))
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    writer = SummaryWriter(str(run_dir))
    monitors = Monitors(config, model, (tokens[:, :-1], tokens[:, 1:]), writer, contextlib.nullcontext, "reference")
    logged = {}
    for step in (1, 2):
        with torch.no_grad():
            model.blocks[1].attn.q_proj.weight.mul_(1.5)  # a growing W_Q
        writer.add_scalar("train/loss", 4.0 - 0.1 * step, step)
        logged[step] = monitors.after_step(step)
    writer.close()
    return logged


def test_tensorboard_serves_both_arms_spectral_tags(tmp_path):
    experiment = tmp_path / "exp"
    logged = {"baseline": write_arm(experiment / "baseline", "none"),
              "fixed": write_arm(experiment / "fixed", "dynamic_max")}
    compare.write_report(experiment, quiet=True)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(experiment),
                             "--host", "127.0.0.1", "--port", str(port), "--load_fast", "false",
                             "--reload_interval", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        run_tags = {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"tensorboard exited early:\n{proc.stdout.read()}"
            with contextlib.suppress(OSError, ValueError):
                run_tags = get_json(port, "/data/plugin/scalars/tags")
                if all("spectral/L01/wq" in run_tags.get(arm, {}) for arm in logged):
                    break
            time.sleep(0.5)
        assert all("spectral/L01/wq/h01" in run_tags.get(arm, {}) for arm in logged), run_tags.keys()
        for arm, values in logged.items():
            for tag in ("spectral/L01/wq", "spectral/L01/wq/h01", "spectral/L00/fc_out"):
                points = get_json(port, "/data/plugin/scalars/scalars", run=arm, tag=tag)
                assert [p[1] for p in points] == [1, 2]
                for (_, step, value) in points:
                    assert abs(value - values[step][tag]) <= 1e-6 * abs(values[step][tag])
            # W_Q of layer 1 was scaled by 1.5 between the two logged steps
            points = get_json(port, "/data/plugin/scalars/scalars", run=arm, tag="spectral/L01/wq")
            assert abs(points[1][2] / points[0][2] - 1.5) < 1e-3
        layout = get_json(port, "/data/plugin/custom_scalars/layout")
        titles = {chart["title"] for category in layout["category"] for chart in category["chart"]}
        assert "spectral/L01/wq" in titles
        assert sorted(get_json(port, "/data/runs")) == ["baseline", "fixed"]  # the layout adds no run of its own
    finally:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        proc.stdout.close()
