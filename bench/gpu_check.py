"""The GPU check, from a source checkout: ``python bench/gpu_check.py [flags]`` is
``kvpark bench --scenario gpu-check [flags]`` (python/kvpark/bench/in_process/gpu_check.py says
what it measures and its flags)."""

import sys

from kvpark.bench.in_process.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
