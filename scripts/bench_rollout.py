"""The generation benchmark alone: `scripts/bench.py --sections rollout` with its defaults.

  python scripts/bench_torch.py --out /tmp/tb --sections generate   # transformers generate, same GPU
  python scripts/bench_rollout.py --torch_results /tmp/tb [--presets ... --batches 64,256,1024]

Reports tokens/s and the % of the HBM roofline (weights + K/V bytes each decode step must read, over
the copy bandwidth the device reaches) at Qwen2.5 shapes with GSM8K-like lengths.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts import bench  # noqa: E402

if __name__ == "__main__":
    if "--sections" not in sys.argv:
        sys.argv += ["--sections", "rollout"]
    bench.main()
