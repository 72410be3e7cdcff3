#!/usr/bin/env python
"""Side-by-side speed comparison: pagedserve vs Hugging Face transformers (and, optionally, the peers).

The command of benchmarks/comparison/ (its __init__ says what is measured and how; `--help` too):

    python benchmarks/compare.py                    # full run (~15 min on 2 cores) -> benchmarks/RESULTS_<class>.md
    python benchmarks/compare.py --quick            # smoke run -> benchmarks/out/RESULTS-quick.md
    python benchmarks/compare.py --peers-only --with-llamacpp --with-vllm
    python benchmarks/compare.py --render benchmarks/out/compare.json --peer-json benchmarks/peers/*.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the comparison package beside this file

from comparison.cli import main  # noqa: E402
# What the other benchmark scripts took from this module before it was split (benchmarks/tensor_parallel.py
# imports these from `compare`); new code imports from the comparison package.
from comparison.environment import ContentionMeter  # noqa: E402, F401
from comparison.models import QWEN05_SHAPE, build_random_model, default_gguf_path  # noqa: E402, F401
from comparison.workers import Worker  # noqa: E402, F401
from comparison.workloads import (FULL_WORKLOADS, QUICK_WORKLOADS, make_prompts, prompt_pool,  # noqa: E402, F401
                                  prompt_rng)

if __name__ == "__main__":
    sys.exit(main())
