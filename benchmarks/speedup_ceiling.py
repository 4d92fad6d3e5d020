"""How far each drafter of a `specdec bench` run is from what its acceptance allows.

A speculative pass commits `mean accepted length` tokens (the target's own token counted) and
costs at least one plain step, so no kernel can lift a drafter's speedup over plain decoding
above its mean accepted length: that is its ceiling. The measured speedup over the ceiling gives
what a pass cost in plain steps, drafting included (ceiling / speedup). Reads the JSON that
`specdec bench --json` writes and prints, per system and per category, the ceiling, the
measured speedup and the implied cost of a pass; with `--target X`, the categories whose
ceiling is below X (no faster verification reaches X there: only a drafter that accepts more).

    python benchmarks/speedup_ceiling.py benchmarks/results/bench_fused.json --target 1.6
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(result: dict) -> list[tuple[str, str, float, float]]:
    """(system, category or "all", ceiling, measured speedup) for every speculative system."""
    found = []
    groups = [("all", result["systems"])] + list(result.get("systems_by_category", {}).items())
    for category, systems in groups:
        for name, stats in systems.items():
            length, speedup = stats.get("mean_accepted_length"), stats.get("speedup")
            if length is None or speedup is None or length <= 1.0:
                continue  # a plain system, or a peer whose acceptance is not reported
            found.append((name, category, float(length), float(speedup)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json", type=Path, help="a `specdec bench --json` result")
    parser.add_argument("--target", type=float, default=None, help="a speedup to check each ceiling against")
    args = parser.parse_args()
    result = json.loads(args.bench_json.read_text(encoding="utf-8"))
    found = rows(result)
    if not found:
        raise SystemExit(f"{args.bench_json}: no speculative system with a mean accepted length")
    print(f"{'system':28s} {'category':16s} {'ceiling':>8s} {'speedup':>8s} {'pass cost':>10s}")
    for name, category, ceiling, speedup in found:
        print(f"{name:28s} {category:16s} {ceiling:8.3f} {speedup:8.3f} {ceiling / speedup:9.3f}x")
    if args.target is not None:
        short = [(n, c, ceiling) for n, c, ceiling, _ in found if ceiling < args.target]
        print(f"\nceilings below {args.target}x (out of reach for any verification cost): "
              + (", ".join(f"{n} / {c} ({ceiling:.2f})" for n, c, ceiling in short) or "none"))


if __name__ == "__main__":
    main()
