"""How long torch's OpenMP workers spin, set before torch loads them where it can.

torch's OpenMP workers (libgomp) spin about 300,000 times after each parallel torch op before
they sleep, and on a small machine that spinning takes the core the kernels' own pool
(specdec/kernels/pool.cpp) needs for the next pass: a decoding step runs a few vocabulary-wide
torch ops beside the kernels (sampling, logprobs). A shorter spin costs torch's own parallel work
nothing measurable (docs/backends.md has both figures). libgomp reads its settings when torch
loads it, so this takes effect where specdec is imported before torch; a value the user set is
kept. Where neither holds, `kernels.torch_ops_inline` keeps torch's operations between passes off
the workers instead.
"""

import os
import sys

_user_set = "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ
# Whether libgomp's spinning is bounded: by a setting of the user's, or by ours, read when torch
# (not yet imported) loads libgomp.
spin_bounded = _user_set or "torch" not in sys.modules
if not _user_set:
    os.environ["GOMP_SPINCOUNT"] = "10000"
