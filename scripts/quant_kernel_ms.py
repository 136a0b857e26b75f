"""Per schedule of a traced `bench step` run: the fused quantization kernels' device ms
per traced step and the streams they ran on (Chrome traces `trace_NAME.json.gz`).

    python scripts/quant_kernel_ms.py OUT_DIR STEPS [--json PATH]
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

KERNELS = ("_encode", "_reduce", "_decode", "_commit")


def kernel_ms(trace: Path, steps: int) -> dict:
    events = json.loads(gzip.open(trace).read())["traceEvents"]
    total, streams = 0.0, defaultdict(float)
    for e in events:
        if e.get("cat") == "kernel" and e.get("name", "").startswith(KERNELS):
            total += e["dur"] / 1e3
            streams[str(e.get("args", {}).get("stream", e.get("tid")))] += e["dur"] / 1e3
    return {"kernel_ms_per_step": round(total / steps, 3),
            "by_stream": {k: round(v / steps, 3) for k, v in streams.items()}}


if __name__ == "__main__":
    out_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
    result = {p.name[len("trace_"):-len(".json.gz")]: kernel_ms(p, steps)
              for p in sorted(out_dir.glob("trace_*.json.gz"))}
    print(json.dumps(result))
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(result, indent=1))
