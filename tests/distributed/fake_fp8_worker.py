"""Worker: ``python -m tests.distributed.fake_fp8_worker <launcher.pretrain arguments>`` trains like the launcher,
on the CPU, with tests/fake_transformer_engine.py in place of Transformer Engine (its collectives, not its FP8
arithmetic), so that the FP8 plumbing of every layout runs in CI."""

from tests.fake_transformer_engine import install

install()

from launcher import config, fp8, pretrain  # noqa: E402 (after the fake is installed)

fp8.require_gpu = lambda device: None
_environment_problems = config.environment_problems
pretrain.environment_problems = lambda cfg: [p for p in _environment_problems(cfg) if "fp8" not in p]

if __name__ == "__main__":
    pretrain.exit_with(pretrain.main())
