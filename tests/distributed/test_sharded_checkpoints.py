"""Sharded checkpoints (launcher/checkpoint.py) across layouts, and the memory a save takes (CPU, gloo).

Three launches of tests/distributed/checkpoint_worker.py: 4 processes train the tiny model under ZeRO-3 over DP4
and under TP2 x PP2 (each rank writes its own shards of the step-6 checkpoint) and save a ~20M-parameter model once
under both layouts, measuring each rank's memory; then 1 and 2 processes resume each of the two checkpoints under one
process, DP2 (DDP and ZeRO-2), TP2 and PP2 and save it again at once: the state every layout loads is the saved
state, bit for bit (training on from there is tests/distributed/test_layouts.py's)."""

import re

import pytest

from tests.runs import launch

pytestmark = pytest.mark.distributed

WORKER = "tests.distributed.checkpoint_worker"
# What a save may add to a rank's resident memory: DCP keeps a copy of each chunk that is a view of a larger buffer
# until its file is complete, i.e. up to one file (checkpoint.FILE_BYTES, set to FILE_BYTES by the worker), plus a
# margin for DCP's planning and the pickled small entries. Measured: docs/parallelism.md ("Checkpoints").
FILE_BYTES = 16 * 2**20
MARGIN = 8 * 2**20


@pytest.fixture(scope="module")
def written(kjv_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    return out, launch(["write", str(out), str(kjv_data)], nproc=4, module=WORKER).stdout


def test_no_rank_needs_more_memory_to_save_than_a_file_of_its_own_shard(written):
    _, stdout = written
    lines = re.findall(r"save memory: (\S+) rank (\d): before (\d+) peak (\d+) wrote (\d+) held (\d+) files (\d+)",
                       stdout)
    assert sorted((layout, int(rank)) for layout, rank, *_ in lines) == \
        [(layout, rank) for layout in ("tp2_pp2", "zero3_dp4") for rank in range(4)], stdout
    for layout, rank, before, peak, wrote, held, files in lines:
        extra, wrote, held = int(peak) - int(before), int(wrote), int(held)
        print(f"{layout} rank {rank}: +{extra / 2**20:.1f} MiB while writing {wrote / 2**20:.1f} MiB in {files} "
              f"file(s) (holds {held / 2**20:.1f} MiB of the model's state)")
        assert int(files) >= 3  # the bound below is then well under the rank's shard
        assert extra <= FILE_BYTES + MARGIN, (layout, rank, extra, wrote)
    # every rank writes its share: the model's state is spread over the ranks, none writes it alone
    for layout in ("tp2_pp2", "zero3_dp4"):
        writes = [int(w) for name, _, _, _, w, _, _ in lines if name == layout]
        assert min(writes) > max(writes) / 2, (layout, writes)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_sharded_checkpoint_resumes_exactly_under_other_layouts(written, kjv_data, nproc):
    out, _ = written
    stdout = launch(["reshard", str(out), str(kjv_data)], nproc=nproc, module=WORKER).stdout
    targets = ["single"] if nproc == 1 else ["dp2", "dp2_zero2", "tp2", "pp2"]
    for source in ("zero3_dp4", "tp2_pp2"):
        for target in targets:
            assert f"{source} -> {target}: identical" in stdout, stdout[-3000:]
