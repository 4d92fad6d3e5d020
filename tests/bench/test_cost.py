"""`specdec costs`'s measurement (specdec.bench.cost.step_costs): what it times."""

from __future__ import annotations

import pytest

from specdec.bench import cost
from specdec.models.loader import LoadedModel
from specdec.models.runner import ModelRunner


class _Clock:
    """A perf_counter that only the fake passes below advance."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_each_timed_pass_follows_a_pass_of_its_own_size(tiny_native: LoadedModel,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # A pass costs n units after three passes of its own size and ten times that sooner after
    # another size's (a wider pass slows the next few): a steady measurement reports n for every
    # size, one that times a pass too soon after another size's reports 10 n.
    clock, sizes, seen = _Clock(), [1, 3, 8], []
    real = ModelRunner.forward

    def forward(self, cache, tokens, **kwargs):
        n = len(tokens)
        clock.now += n * (1.0 if seen[-3:] == [n] * 3 else 10.0)
        seen.append(n)
        return real(self, cache, tokens, **kwargs)

    monkeypatch.setattr(cost, "time", clock)
    monkeypatch.setattr(ModelRunner, "forward", forward)
    measured = cost.step_costs(tiny_native, sizes, context=5, repeats=3)
    assert measured == {n: float(n) for n in sizes}
    # the sizes take turns within every round, so that drift falls on all of them alike, the
    # widest first: the plain step is timed after passes as narrow as its own
    assert seen[1:] == [n for _ in range(3) for n in sorted(sizes, reverse=True) for _ in range(cost.WARM_PASSES + 1)]
