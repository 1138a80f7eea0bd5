"""benchmarks/monitor_scale.py end to end on a CPU-sized layer (the plumbing: it measures every call it reports)."""

import re

from benchmarks import monitor_scale


def test_monitor_scale_reports_every_call(capsys):
    assert monitor_scale.main(["--d-model", "64", "--heads", "2", "--seq", "32"]) == 0
    lines = re.findall(r"rank 0 \[d 64, 2 heads.*tp 1\] (.+?): [\d.]+ s, \+\d+ MiB, (\d+) scalars",
                       capsys.readouterr().out)
    assert [name for name, _ in lines] == ["spectral, fresh start", "spectral, tracked", "probe", "probe + delta bias"]
    # a layer outside monitor.head_layers logs its layer-wide tags only: 6 spectral (and, from the second call on,
    # 6 Q-K update aggregates), 4 activation, 4 attention, 1 Q-K activation entropy; with the delta bias (then a head
    # layer, default head_layers) also the 4 attention statistics and the Q-K activation entropy of each of its 2
    # heads, the delta bias's sum and running sum per layer and per head (no cosine at a first call) and its timing
    assert [int(n) for _, n in lines] == [6, 6 + 6, 4 + 4 + 1, 4 + 4 + 1 + 5 * 2 + 2 + 2 * 2 + 1]
