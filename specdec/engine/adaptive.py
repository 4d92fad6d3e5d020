"""How many tokens to draft at each step of one request.

`FixedK` always asks for k. `AdaptiveK` lets k follow acceptance and switches speculation off
when it does not pay, by measuring, per request, what a committed token costs:

- k grows by one after a step in which every drafted token was accepted, and shrinks by one
  after a step with a rejection, within [1, k_max].
- Every `window` speculative steps, the time per committed token while speculating (draft
  plus verification) is compared with the time of a plain step (a target pass over one
  token, measured on the request's own undrafted steps; one is taken on purpose when none
  has happened yet). When speculating is slower, or no drafted token at all was accepted in
  the window (then it cannot be faster, whatever the timer says), speculation is off for
  `backoff` steps, after
  which it probes again; each failed probe doubles the backoff (up to `max_backoff`), and a
  probe that pays resets it.

Any choice of k made before a step keeps decoding lossless: the acceptance rule makes each
step's tokens follow the target's distribution whatever the draft length was.
"""

from __future__ import annotations

from typing import Protocol


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
    """See the module docstring. `k` is the current draft length; `speculating` is False while
    speculation is switched off."""

    def __init__(self, k_max: int, window: int = 8, backoff: int = 16, max_backoff: int = 256) -> None:
        if k_max < 1 or window < 1 or not 1 <= backoff <= max_backoff:
            raise ValueError("need k_max >= 1, window >= 1 and 1 <= backoff <= max_backoff")
        self.k_max = k_max
        self.k = k_max
        self.window = window
        self.base_backoff = backoff
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.off_steps_left = 0
        self.plain_step_s: float | None = None  # moving average of an undrafted target step
        self._window_steps = 0
        self._window_time_s = 0.0
        self._window_tokens = 0
        self.switched_off = 0  # how many times speculation went off (for stats and tests)

    @property
    def speculating(self) -> bool:
        return self.off_steps_left == 0

    def next_k(self) -> int:
        if self.off_steps_left > 0:
            return 0
        if self._window_steps >= self.window and self.plain_step_s is None:
            return 0  # measure one plain step to judge the window by
        return self.k

    def observe(self, drafted: int, accepted: int, draft_time_s: float, verify_time_s: float) -> None:
        if drafted == 0:
            # An undrafted step costs what a plain step costs: keep a moving average.
            step = draft_time_s + verify_time_s
            self.plain_step_s = step if self.plain_step_s is None else 0.7 * self.plain_step_s + 0.3 * step
            if self.off_steps_left > 0:
                self.off_steps_left -= 1
        else:
            self.k = min(self.k + 1, self.k_max) if accepted == drafted else max(self.k - 1, 1)
            self._window_steps += 1
            self._window_time_s += draft_time_s + verify_time_s
            self._window_tokens += accepted + 1
        if self._window_steps >= self.window and self.plain_step_s is not None:
            self._judge_window()

    def _judge_window(self) -> None:
        time_per_token = self._window_time_s / self._window_tokens
        if time_per_token > self.plain_step_s or self._window_tokens == self._window_steps:
            self.off_steps_left = self.backoff
            self.backoff = min(2 * self.backoff, self.max_backoff)
            self.switched_off += 1
        else:
            self.backoff = self.base_backoff
        self._window_steps = 0
        self._window_time_s = 0.0
        self._window_tokens = 0
