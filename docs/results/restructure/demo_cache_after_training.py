"""The demo as it ran at commit 6510343 (the `gated-delta-recall` recipe before it trained with its cache: the
recall cache of 128 tokens per head switched on after training), on today's code; ``recall_cache: 0`` in the
cell options only overrides the recipe's cell option (no cache during training), as 6510343 had none::

    python docs/results/restructure/demo_cache_after_training.py OUT
"""

import sys
import time

from dofla.demo import demo_config
from dofla.pipeline import linearize
from dofla.run_config import LinearizeConfig

base = demo_config(sys.argv[1]).to_dict()
base["student"]["cell_options"] = {"window_factor": 0.999, "recall_cache": 0}
base["student"]["recall_cache"] = 128
started = time.time()
linearize(LinearizeConfig.from_dict(base))
print("total", time.time() - started, flush=True)
