"""Worker: ``python -m tests.distributed.noise_keys_worker OUT <launcher.pretrain arguments>`` trains like the launcher
and records which noise keys reach each layer's attention: process RANK writes ``OUT.RANK.json`` with
{layer: sorted distinct keys}. Under any layout the union over the ranks must equal one process's: every layer of
every stage, tensor-parallel rank and data-parallel rank gets the keys of the global rows it computes."""

import json
import os
import sys
from pathlib import Path

from launcher import pretrain
from model import attention


def main() -> int:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    seen: dict[int, set[int]] = {}
    call = attention.noise_keys

    def recording(row_keys, layer, batch, device):
        keys = call(row_keys, layer, batch, device)
        seen.setdefault(layer, set()).update(keys.tolist())
        return keys

    attention.noise_keys = recording  # KernelAttention looks it up at each call
    try:
        return pretrain.main(args)
    finally:
        path = out.with_name(f"{out.name}.{os.environ.get('RANK', '0')}.json")
        path.write_text(json.dumps({layer: sorted(keys) for layer, keys in seen.items()}))


if __name__ == "__main__":
    pretrain.exit_with(main())
