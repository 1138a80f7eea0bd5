"""monitor.on_warning end to end on CPU (launcher/on_warning.py, Trainer.act_on_warning): the onset checkpoint kept
outside the rotation, stop's exit status and one-line reason, switch_fix's changes.yaml and a resume after the
switch that is bit-identical to the uninterrupted run.

The condition is forced through the rule's own settings, not a switch in the library: a W_Q growth threshold of
1e-9 over a 1-step window holds at every spectral call, so the warning turns on at warning_after_step (3)."""

import math

import pytest
import yaml

from launcher.checkpoint import CheckpointStore, read_whole_checkpoint
from launcher.config import ConfigError, load_config
from launcher.parallel.dims import ParallelDims
from launcher.trainer import train_arm
from tests.runs import all_scalars, launch

ONSET = 3
FORCED = ["monitor.spectral_interval=1", "monitor.probe_interval=0", "monitor.warning_tie_rate=0",
          "monitor.warning_wq_growth=1e-9", "monitor.warning_window=1", f"monitor.warning_after_step={ONSET}",
          "monitor.warning_patience=1", "run.max_steps=8", "optim.decay_steps=8", "eval.interval=0",
          "data.micro_batch_size=4"]


@pytest.fixture
def common(tiny_overrides):
    return tiny_overrides + FORCED


def train(common, *extra):
    return train_arm(load_config("smoke", [*common, *extra]), ParallelDims())


def test_stop_saves_keeps_and_exits_with_its_own_status(common, tmp_path):
    proc = launch(["smoke", "--arm", "baseline", *common, "monitor.on_warning=stop"], check=False, timeout=300)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "stopped by the early warning" in line]
    assert lines and all(f"early warning at step {ONSET}: wq_growth" in line and "exit status 4" in line
                         for line in lines), proc.stdout
    assert "Traceback" not in proc.stderr
    run_dir = tmp_path / "runs" / "smoke" / "baseline"  # tiny_overrides' run.out_dir
    kept = run_dir / "checkpoints" / f"warning_step_{ONSET:08d}"
    assert kept.is_dir() and CheckpointStore(run_dir).problem(kept) is None
    assert sorted(all_scalars(run_dir)["train/loss"]) == list(range(1, ONSET + 1))  # nothing trained after it


def test_checkpoint_mode_keeps_the_onset_outside_the_rotation(common):
    result = train(common, "monitor.on_warning=checkpoint", "checkpoint.interval=1")
    assert result.status == "completed" and result.steps == 8
    store = CheckpointStore(result.run_dir)
    assert [p.name for p in store.steps()] == ["step_00000007", "step_00000008"]  # the rotation pruned 3
    kept = store.dir / f"warning_step_{ONSET:08d}"
    assert kept.is_dir() and store.problem(kept) is None
    assert read_whole_checkpoint(kept)["step"] == ONSET


def test_switch_fix_is_recorded_and_a_resume_after_it_is_exact(common):
    common = common + ["monitor.probe_interval=2"]  # the delta-bias monitor follows the switched numerics too
    straight = train(common, "monitor.on_warning=switch_fix", "run.experiment=straight")
    logged = train(common, "run.experiment=logged")  # the same rule, on_warning=log: no switch
    for cut in (ONSET, 5):  # resumed from the onset checkpoint itself, and from one after the switch
        train(common, "monitor.on_warning=switch_fix", f"run.experiment=cut{cut}", f"run.max_steps={cut}")
        resumed = train(common, "monitor.on_warning=switch_fix", f"run.experiment=cut{cut}")
        assert resumed.status == "completed" and resumed.steps == 8
        a, b = all_scalars(straight.run_dir), all_scalars(resumed.run_dir)
        trained = [t for t in a if not t.startswith(("perf/", "monitor/"))]
        assert set(trained) <= set(b) and all(a[t] == b[t] for t in trained), cut  # bit for bit, monitors too
        changes = yaml.safe_load((resumed.run_dir / "changes.yaml").read_text())
        assert changes[0]["step"] == ONSET and changes[0]["changes"] == {"attention.fix": {"from": "none",
                                                                                          "to": "fp32_output"}}
        assert "wq_growth" in changes[0]["reason"] and changes[1]["changes"].keys() == {"run.max_steps"}
        last = read_whole_checkpoint(resumed.run_dir / "checkpoints" / "step_00000008")
        assert last["warning_switch"]["to"] == "fp32_output" and last["config"]["attention"]["fix"] == "fp32_output"
    changes = yaml.safe_load((straight.run_dir / "changes.yaml").read_text())
    assert [c["step"] for c in changes] == [ONSET]
    assert yaml.safe_load((straight.run_dir / "config.yaml").read_text())["attention"]["fix"] == "none"
    a, c = (all_scalars(r.run_dir)["train/loss"] for r in (straight, logged))
    assert all(a[s] == c[s] for s in range(1, ONSET + 1))  # the same run up to the switch...
    assert any(a[s] != c[s] for s in range(ONSET + 1, 9)) and all(math.isfinite(v) for v in a.values())  # ...not after
    assert not (logged.run_dir / "changes.yaml").exists()

    from launcher.compare import write_report  # the comparison report shows the warning and the switch

    report = write_report(straight.run_dir.parent, quiet=True, layout=False)
    summary = (report.parent / "summary.txt").read_text()
    assert (report.parent / "warning_timeline.png").is_file()
    assert f"first at step {ONSET}: wq_growth" in summary and "switched none -> fp32_output" in summary


@pytest.mark.parametrize("overrides, needle", [
    (["monitor.on_warning=stop", "monitor.warning_qk_act_drop=0"], "acts on the early warning, which is off"),
    # the default rule reads the probe's Q-K scores: with the probe off there is nothing to act on
    (["monitor.on_warning=stop", "monitor.probe_interval=0"], "acts on the early warning, which is off"),
    # a threshold chosen by the user must be measurable
    (["monitor.warning_qk_act_drop=0.5", "monitor.probe_interval=0"],
     "monitor.warning_qk_act_drop=0.5 reads monitor.qk_activation of layer 1, which is off"),
    (["monitor.on_warning=checkpoint", "checkpoint.enabled=false"], "checkpoint.enabled=false"),
    (["monitor.on_warning=halt"], "monitor.on_warning='halt' is not one of"),
    (["monitor.on_warning=switch_fix", "monitor.switch_fix_to=none"], "monitor.switch_fix_to='none'"),
])
def test_mistakes_are_named(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("smoke", overrides)


def test_default_rule_rests_where_its_monitor_is_off():
    """The shipped threshold (qk_act_drop) does not make a run without the probe an error; the rule just has no
    input there, and the run loads as before."""
    config = load_config("smoke", ["monitor.probe_interval=0"])
    assert config.monitor.warning_qk_act_drop > 0 and config.monitor.on_warning == "log"


def test_a_run_without_the_rules_input_says_its_warning_is_off(tiny_overrides, capsys):
    """With the spectra on and the probe off (tiny_overrides' probe_interval=0) the default rule has nothing to
    read: the run says so once; with the probe on it does not."""
    short = [*tiny_overrides, "run.max_steps=2", "optim.decay_steps=2", "eval.interval=0", "monitor.spectral_interval=1"]
    train_arm(load_config("smoke", short), ParallelDims())
    assert capsys.readouterr().out.count("early warning off in this run: qk_act_drop") == 1
    train_arm(load_config("smoke", [*short, "monitor.probe_interval=1", "run.experiment=probed"]), ParallelDims())
    assert "early warning off" not in capsys.readouterr().out


def test_margin_refuses_stop():
    from analysis.margin import prepare

    with pytest.raises(ConfigError, match="on_warning=stop would end margin arms"):
        prepare("margin", ["monitor.on_warning=stop"])
