"""What a model draft's catch-up pass costs, in plain target steps, by the tokens it catches up on.

A draft resumed after adaptive k switched it off keeps the context's first `SINK` tokens in its
cache and runs one pass over the last `RESUME_WINDOW` (`specdec/drafters/draft_model.py`),
logits for the last position only. This times such passes (n tokens after `SINK` cached ones)
for the full model and for the layer_skip draft of the shipped profile, against a plain step
(a pass over one token after 300 cached ones), so that the window can be sized against what a
probe may cost. `--context` sets the cached tokens: a draft that caught up on everything
instead runs after all of the context it had.

    python benchmarks/catch_up_cost.py   # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse

from specdec.bench.cost import step_costs
from specdec.drafters.draft_model import RESUME_WINDOW, SINK
from specdec.config import SpeculativeConfig
from specdec.drafters.layer_skip import resolve_layers
from specdec.models.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=f"1,8,{RESUME_WINDOW},32,64,128", help="tokens per pass, comma-separated")
    parser.add_argument("--context", type=int, default=SINK, help="tokens already cached (default: the sink)")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    sizes = sorted({1, *(int(n) for n in args.sizes.split(","))})

    target = load_model(None)
    layers = resolve_layers(SpeculativeConfig(method="layer_skip"), target)
    plain = step_costs(target, [1], context=300, repeats=args.repeats)[1]
    print(f"plain step: {plain * 1000:.1f} ms; layer_skip draft: {len(layers)} of {target.model.config.num_hidden_layers} layers")
    for name, draft_layers in (("full model", None), ("layer_skip draft", layers)):
        seconds = step_costs(target, sizes, context=args.context, repeats=args.repeats, layers=draft_layers,
                             last_only=True)
        print(f"{name:17s}", "  ".join(f"{n} tok: {seconds[n] / plain:.2f}" for n in sizes))


if __name__ == "__main__":
    main()
