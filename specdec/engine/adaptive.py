"""How many tokens to draft at each step of a request.

`FixedK` always asks for k. `AdaptiveK` lets k follow acceptance and switches speculation off
when it does not pay, by measuring what a committed token costs:

- k starts at 1 (slow start: a draft not yet known to pay is tried at its cheapest, and its
  first window is a probe, below) and grows by one after a step in which every drafted token
  was accepted, and shrinks by one after a step whose first drafted token was rejected (an
  early rejection), within [1, k_max]. A rejection further along leaves k alone: the draft
  was right for a while, and drafters that size their own proposals (prompt lookup, by match
  length) keep doing so.
- Every `window` speculative steps, the time per committed token while speculating (draft
  plus verification) is compared with the time of a plain step (a target pass over one
  token, measured on undrafted steps; one is taken on purpose when none has been seen yet).
  The draft time counted is the median step's per drafted token, times the tokens drafted:
  what drafting costs from here on. A step that also caught the draft up on the context (a
  new prompt, or what was committed while speculation was off) paid a cost that does not
  recur, so it does not count against the draft; it does count in the probe budget below.
  When speculating was slower, or no drafted token at all was accepted in the window (then it
  cannot be faster, whatever the timer says), the window's own figures go into the speedup
  formula: expected tokens per step (1 - a^(k+1)) / (1 - a) over the step's cost k*c + v, with
  a the tested acceptance, c the draft cost per token and v the verification cost, both in
  plain steps. k is set to the best k by that formula. If even the best k cannot pay,
  speculation goes off for `max_backoff` steps at once; otherwise it is off for `backoff`
  steps, after which it probes again, each failed probe doubling the backoff (up to
  `max_backoff`). A probe is judged after `probe_window` steps, fewer than a full window,
  since the last window already did not pay; a probe that pays resets the backoff and
  speculation goes on in full windows. A failed window's cost beyond plain decoding
  (including a model draft's catch-up pass over the context: a resumed draft catches up on a
  short recent window only, see `DraftModelDrafter`) may be at most `probe_budget` (1%) of the
  time until the next probe, so the pause is at least that cost over 1% of a plain step.

What was learned (k, the backoff and how much of it is left, the plain step time, the draft's
cost) lives in an `AdaptiveState` that the engine keeps across requests. A drafter whose
passes cost something (a model) and did not pay on the last request starts the next one
switched off and probes on the same schedule, instead of paying the lesson (and a draft pass
over the new prompt) again on every request.

A drafter that costs next to nothing (prompt lookup: under `CHEAP_DRAFT` of a plain step per
drafted token) is never switched off: when it finds nothing it drafts nothing and the step is
a plain one, and when its guesses fail the cost is only the extra positions verified, which
a shrinking k bounds. Switching it off would only miss the matches that come later (repeated
text, a quoted passage); its k alone follows acceptance.

Any choice of k made before a step keeps decoding lossless: the acceptance rule makes each
step's tokens follow the target's distribution whatever the draft length was.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Protocol

from specdec.engine.estimate import expected_speedup

# Draft time per drafted token, over a plain step, under which drafting counts as free.
CHEAP_DRAFT = 0.05
# A failed probe may cost at most this fraction of the time spent off before the next one.
PROBE_BUDGET = 0.01
# The longest a probe's cost may keep speculation off, in steps.
MAX_OFF_STEPS = 1 << 16


@dataclass
class AdaptiveState:
    """What adaptive k has learned so far; shared by the requests of one engine."""

    k: int
    backoff: int
    off_steps_left: int = 0
    plain_step_s: float | None = None  # moving average of an undrafted target step
    draft_cost: float | None = None  # typical draft time per drafted token / plain step (window medians)
    switched_off: int = 0  # how many times speculation went off
    probing: bool = False  # the last window did not pay: the next one is a probe


class SpeculationPolicy(Protocol):
    def next_k(self) -> int:
        """The most tokens to draft at the next step (0: do not draft)."""

    def observe(self, drafted: int, accepted: int, draft_time_s: float, verify_time_s: float) -> None:
        """What the step did: tokens drafted and accepted, time drafting and verifying."""


class FixedK:
    def __init__(self, k: int) -> None:
        self.k = k

    def next_k(self) -> int:
        return self.k

    def observe(self, drafted: int, accepted: int, draft_time_s: float, verify_time_s: float) -> None:
        pass


class AdaptiveK:
    """See the module docstring. `state` carries what was learned from request to request;
    the window being judged belongs to this request alone."""

    def __init__(
        self, k_max: int, state: AdaptiveState | None = None, window: int = 6, backoff: int = 16, max_backoff: int = 512,
        probe_budget: float = PROBE_BUDGET, probe_window: int = 3,
    ) -> None:
        if k_max < 1 or window < 1 or probe_window < 1 or not 1 <= backoff <= max_backoff or probe_budget <= 0:
            raise ValueError(
                "need k_max >= 1, window >= 1, probe_window >= 1, 1 <= backoff <= max_backoff and probe_budget > 0"
            )
        self.k_max = k_max
        self.state = state if state is not None else AdaptiveState(k=1, backoff=backoff, probing=True)
        self.state.k = min(max(self.state.k, 1), k_max)
        if self.free:
            self.state.off_steps_left = 0  # a free drafter is never off
            self.state.backoff = backoff
        self.full_window = window
        self.probe_window = min(probe_window, window)
        self.base_backoff = backoff
        self.max_backoff = max_backoff
        self.probe_budget = probe_budget
        self._reset_window()

    def _reset_window(self) -> None:
        self._window_steps = 0
        self._window_draft_s = 0.0
        self._window_drafted = 0
        self._window_verify_s = 0.0
        self._window_accepted = 0
        self._window_rejections = 0
        self._window_costs: list[float] = []  # draft seconds per drafted token, step by step

    @property
    def window(self) -> int:
        """Speculative steps to the next judgement: fewer while probing."""
        return self.probe_window if self.state.probing and not self.free else self.full_window

    @property
    def free(self) -> bool:
        """Whether drafting costs next to nothing (prompt lookup), as measured so far."""
        return self.state.draft_cost is not None and self.state.draft_cost < CHEAP_DRAFT

    @property
    def k(self) -> int:
        return self.state.k

    @property
    def speculating(self) -> bool:
        return self.state.off_steps_left == 0

    def next_k(self) -> int:
        state = self.state
        if state.off_steps_left > 0:
            return 0
        if self._window_steps >= self.window and state.plain_step_s is None:
            return 0  # measure one plain step to judge the window by
        return state.k

    def observe(self, drafted: int, accepted: int, draft_time_s: float, verify_time_s: float) -> None:
        state = self.state
        if drafted == 0:
            # An undrafted step costs what a plain step costs: keep a moving average.
            step = draft_time_s + verify_time_s
            state.plain_step_s = step if state.plain_step_s is None else 0.7 * state.plain_step_s + 0.3 * step
            if state.off_steps_left > 0:
                state.off_steps_left -= 1
        else:
            if accepted == drafted:
                state.k = min(state.k + 1, self.k_max)
            elif accepted == 0:
                state.k = max(state.k - 1, 1)
            self._window_steps += 1
            self._window_draft_s += draft_time_s
            self._window_drafted += drafted
            self._window_verify_s += verify_time_s
            self._window_costs.append(draft_time_s / drafted)
            self._window_accepted += accepted
            self._window_rejections += accepted < drafted
        if self._window_steps >= self.window and state.plain_step_s is not None:
            self._judge_window()

    def _judge_window(self) -> None:
        state = self.state
        plain = state.plain_step_s
        steps = self._window_steps
        tokens = self._window_accepted + steps
        spent = self._window_draft_s + self._window_verify_s
        # The median step's draft cost: a drafter's first step may also catch up on the whole
        # prompt (a draft model) or index it (prompt lookup), which is not what a step costs.
        step_cost_s = statistics.median(self._window_costs)
        cost = step_cost_s / plain
        state.draft_cost = cost if state.draft_cost is None else 0.5 * state.draft_cost + 0.5 * cost
        ongoing = step_cost_s * self._window_drafted + self._window_verify_s
        paid = self._window_accepted > 0 and ongoing / tokens <= plain
        if paid or self.free:
            state.backoff = self.base_backoff
            state.probing = False
        else:
            tested = self._window_accepted + self._window_rejections
            acceptance = self._window_accepted / tested if tested else 0.0
            verify = max(self._window_verify_s / steps / plain, 1e-9)
            best_k, best = max(
                ((k, expected_speedup(acceptance, k, cost, verify)) for k in range(1, self.k_max + 1)),
                key=lambda pair: pair[1],
            )
            state.k = best_k
            if best < 1.0:
                state.backoff = self.max_backoff  # no k can pay: off for as long as it gets
            # What this window cost beyond plain decoding (catch-up pass included) may be at
            # most probe_budget of the time until the next probe.
            excess = spent - tokens * plain
            floor = math.ceil(excess / (self.probe_budget * plain)) if excess > 0 else 0
            state.off_steps_left = min(max(state.backoff, floor), MAX_OFF_STEPS)
            state.backoff = min(2 * state.backoff, self.max_backoff)
            state.switched_off += 1
            state.probing = True
        self._reset_window()


class AdaptiveStates:
    """What adaptive k has learned, per key (a server route; the library engine has one), carried
    from request to request: the one place a speculation policy for a new sequence is made."""

    def __init__(self) -> None:
        self._states: dict[object, AdaptiveState] = {}

    def get(self, key: object = None) -> AdaptiveState | None:
        return self._states.get(key)

    def set(self, state: AdaptiveState, key: object = None) -> None:
        self._states[key] = state

    def policy(self, k: int, adaptive: bool, key: object = None) -> SpeculationPolicy:
        """A new sequence's policy: AdaptiveK continuing what this key learned, or FixedK(k)."""
        if not adaptive:
            return FixedK(k)
        policy = AdaptiveK(k, self._states.get(key))
        self._states[key] = policy.state
        return policy
