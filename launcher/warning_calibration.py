"""Moved: this tool is now ``python -m analysis.warning_calibration`` (analysis/warning_calibration.py).

The old command still works: this file runs the new module as a command. It forwards by module name (runpy) rather
than importing it, so that launcher/ imports nothing of analysis/ (analysis/ is built on launcher/)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("analysis.warning_calibration", run_name="__main__", alter_sys=True)
