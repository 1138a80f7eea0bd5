"""Moved: this tool is now ``python -m analysis.checkpoint_delta_bias`` (analysis/checkpoint_delta_bias.py).

The old command still works: this file runs the new module as a command. It forwards by module name (runpy) rather
than importing it, so that launcher/ imports nothing of analysis/ (analysis/ is built on launcher/)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("analysis.checkpoint_delta_bias", run_name="__main__", alter_sys=True)
