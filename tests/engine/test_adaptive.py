"""Adaptive k: the policy on its own with given times, and through the engine on the real model."""

from __future__ import annotations

import time

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.drafters import Drafter, Proposal
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine
from specdec.engine.adaptive import AdaptiveK, AdaptiveState, FixedK
from specdec.models import LoadedModel

PLAIN_STEP = 0.030  # seconds, the made-up cost of an undrafted step below


def run(policy: AdaptiveK, steps: list[tuple[int, float]], plain_s: float = PLAIN_STEP) -> list[int]:
    """Feed the policy steps of (accepted tokens, step time) and return the k it asked for at
    each. A step asked for k = 0 is a plain step costing plain_s."""
    asked = []
    for accepted, seconds in steps:
        k = policy.next_k()
        asked.append(k)
        if k == 0:
            policy.observe(0, 0, 0.0, plain_s)
        else:
            policy.observe(k, min(accepted, k), 0.4 * seconds, 0.6 * seconds)  # a drafter that costs
    return asked


def test_fixed_k_is_fixed() -> None:
    policy = FixedK(3)
    policy.observe(3, 0, 1.0, 1.0)
    assert policy.next_k() == 3


def test_k_grows_after_full_acceptance_and_shrinks_after_early_rejection() -> None:
    policy = AdaptiveK(k_max=5, window=100)
    policy.state.k = 2
    policy.observe(2, 2, 0.0, 0.01)
    assert policy.k == 3
    policy.observe(3, 3, 0.0, 0.01)
    policy.observe(4, 4, 0.0, 0.01)
    policy.observe(5, 5, 0.0, 0.01)
    assert policy.k == 5  # bounded by k_max
    policy.observe(5, 2, 0.0, 0.01)
    assert policy.k == 5  # a late rejection: the draft was right for a while
    policy.observe(5, 0, 0.0, 0.01)
    assert policy.k == 4  # the first drafted token was wrong
    for _ in range(10):
        policy.observe(policy.k, 0, 0.0, 0.01)
    assert policy.k == 1  # bounded below by 1


def test_measures_a_plain_step_before_judging() -> None:
    policy = AdaptiveK(k_max=4, window=3)
    asked = run(policy, [(4, 0.04)] * 3 + [(4, 0.04)])
    assert asked[:3] == [1, 2, 3]  # slow start: from k = 1, one more after each full acceptance
    assert asked[3] == 0  # no plain step seen yet: take one to compare with
    assert policy.state.plain_step_s == pytest.approx(PLAIN_STEP)


def test_a_draft_that_is_never_right_goes_off_for_the_longest_backoff() -> None:
    policy = AdaptiveK(k_max=2, window=4, backoff=5, max_backoff=20, probe_budget=1.0)
    policy.observe(0, 0, 0.0, PLAIN_STEP)  # a plain step is known
    # Every draft rejected: no k can pay, so no short backoff is tried first. A draft not yet
    # known to pay is probed: judged after probe_window (3) steps, not a full window.
    asked = run(policy, [(0, 0.045)] * 3)
    assert asked == [1, 1, 1]
    assert policy.state.switched_off == 1 and not policy.speculating
    asked = run(policy, [(0, 0.045)] * 20)
    assert asked == [0] * 20  # off for max_backoff steps
    assert policy.speculating  # then it probes again
    asked = run(policy, [(0, 0.045)] * 3 + [(0, 0.045)] * 20)
    assert asked[:3] == [1, 1, 1] and asked[3:] == [0] * 20
    assert policy.state.switched_off == 2


def observe_window(policy: AdaptiveK, accepted: list[int], k: int, draft_cost: float, verify_cost: float) -> None:
    """Steps that each draft k tokens at draft_cost plain steps a token and verify at verify_cost."""
    for n in accepted:
        policy.observe(k, n, k * draft_cost * PLAIN_STEP, verify_cost * PLAIN_STEP)


def test_a_draft_that_could_pay_at_a_smaller_k_backs_off_briefly_and_returns_at_that_k() -> None:
    policy = AdaptiveK(k_max=4, window=4, backoff=5, max_backoff=40, probe_budget=1.0, probe_window=4)
    policy.observe(0, 0, 0.0, PLAIN_STEP)
    # k = 4 at 0.3 plain steps a drafted token: 2.3 plain steps for 2 tokens a step, slower than
    # plain. Tested acceptance 4 / (4 + 4) = 0.5: by the formula k = 1 pays (1.5 / 1.4 = 1.07x).
    observe_window(policy, [3, 0, 1, 0], k=4, draft_cost=0.3, verify_cost=1.1)
    assert not policy.speculating and policy.state.off_steps_left == 5 and policy.state.backoff == 10
    assert policy.k == 1
    asked = run(policy, [(0, 0.0)] * 5)
    assert asked == [0] * 5 and policy.next_k() == 1


def test_a_costly_probe_pauses_speculation_long_enough_to_stay_within_its_budget() -> None:
    policy = AdaptiveK(k_max=2, window=4, backoff=5, max_backoff=20, probe_budget=0.01, probe_window=4)
    policy.observe(0, 0, 0.0, PLAIN_STEP)
    # The first step also catches the draft up on a long prompt: 0.4 s more than its tokens'
    # worth of plain steps over the window, which 1% of a plain step repays in about 1,330 steps.
    policy.observe(2, 0, 0.3 + 2 * 0.5 * PLAIN_STEP, 1.2 * PLAIN_STEP)
    observe_window(policy, [0, 0, 0], k=1, draft_cost=0.5, verify_cost=1.2)
    excess = 0.3 + 2 * 0.5 * PLAIN_STEP + 3 * 0.5 * PLAIN_STEP + 4 * 1.2 * PLAIN_STEP - 4 * PLAIN_STEP
    assert policy.state.off_steps_left == pytest.approx(excess / (0.01 * PLAIN_STEP), abs=2)
    # The formula took the median step's draft cost, not the catch-up's.
    assert policy.state.draft_cost == pytest.approx(0.5)


def test_a_catch_up_pass_does_not_count_against_a_draft_that_pays_per_step() -> None:
    policy = AdaptiveK(k_max=3, window=4, backoff=5, max_backoff=40, probe_budget=1.0)
    policy.observe(0, 0, 0.0, PLAIN_STEP)
    # Each step: 3 drafted tokens at 0.2 plain steps each, verified in 1.3 plain steps, all
    # accepted: 4 tokens for 1.9 plain steps. The first step also caught the draft up on a
    # long prompt (10 plain steps), which the window's total time cannot repay.
    policy.observe(3, 3, (10 + 0.6) * PLAIN_STEP, 1.3 * PLAIN_STEP)
    observe_window(policy, [3, 3, 3], k=3, draft_cost=0.2, verify_cost=1.3)
    assert policy.speculating and policy.state.switched_off == 0
    # The same steps without accepted tokens do not pay, catch-up or not.
    observe_window(policy, [0, 0, 0, 0], k=3, draft_cost=0.2, verify_cost=1.3)
    assert not policy.speculating


def test_a_probe_that_pays_goes_back_to_full_windows() -> None:
    policy = AdaptiveK(k_max=3, window=6, backoff=4, max_backoff=40, probe_budget=1.0, probe_window=2)
    policy.observe(0, 0, 0.0, PLAIN_STEP)
    observe_window(policy, [0] * 6, k=1, draft_cost=0.5, verify_cost=1.1)
    assert not policy.speculating and policy.state.probing
    run(policy, [(0, 0.0)] * policy.state.off_steps_left)
    # The probe is judged after 2 steps: these pay (3 tokens for 2.2 plain steps a step).
    observe_window(policy, [2, 2], k=2, draft_cost=0.5, verify_cost=1.2)
    assert policy.speculating and not policy.state.probing and policy.window == 6
    # Back in full windows: 5 failing steps are not yet judged, the 6th is.
    observe_window(policy, [0] * 5, k=2, draft_cost=0.5, verify_cost=1.2)
    assert policy.speculating
    observe_window(policy, [0], k=2, draft_cost=0.5, verify_cost=1.2)
    assert not policy.speculating


def test_a_paying_probe_keeps_speculating_and_resets_the_backoff() -> None:
    policy = AdaptiveK(k_max=3, window=4, backoff=5, max_backoff=40, probe_budget=1.0)
    policy.observe(0, 0, 0.0, PLAIN_STEP)
    run(policy, [(0, 0.045)] * 4 + [(0, 0.0)] * 40)  # off for the longest backoff
    assert policy.state.backoff == 40 and policy.speculating
    # All accepted: 4 tokens per 50 ms step beats 30 ms per token.
    asked = run(policy, [(3, 0.05)] * 12)
    assert 0 not in asked
    assert policy.state.backoff == 5 and policy.state.switched_off == 1


def test_what_was_learned_carries_over_to_the_next_request() -> None:
    first = AdaptiveK(k_max=4, window=4, backoff=8, max_backoff=8, probe_budget=1.0)
    first.observe(0, 0, 0.0, PLAIN_STEP)
    run(first, [(0, 0.045)] * 3 + [(0, 0.0)] * 3)  # a failed probe: off, 5 of 8 off steps left
    assert first.state.off_steps_left == 5
    second = AdaptiveK(k_max=4, state=first.state, window=4, backoff=8, max_backoff=8, probe_budget=1.0)
    assert run(second, [(0, 0.0)] * 5) == [0] * 5  # the new request starts switched off
    assert second.speculating
    fresh = AdaptiveK(k_max=4, state=AdaptiveState(k=9, backoff=8))
    assert fresh.k == 4  # a remembered k is kept within this policy's bounds


def test_a_free_drafter_is_never_switched_off() -> None:
    costly = AdaptiveK(k_max=1, window=2, backoff=8)
    costly.observe(0, 0, 0.0, PLAIN_STEP)
    for _ in range(2):
        costly.observe(1, 0, 0.5 * PLAIN_STEP, 1.1 * PLAIN_STEP)  # half a plain step per drafted token
    assert costly.state.draft_cost == pytest.approx(0.5, rel=0.05) and not costly.speculating
    assert not AdaptiveK(k_max=1, state=costly.state).speculating  # still off on the next request
    free = AdaptiveK(k_max=3, window=2, backoff=8)
    free.observe(0, 0, 0.0, PLAIN_STEP)
    for _ in range(20):
        free.observe(free.next_k(), 0, 0.001 * PLAIN_STEP, 1.1 * PLAIN_STEP)  # prompt lookup: drafting is free
    assert free.free and free.speculating and free.state.switched_off == 0
    assert free.k == 1  # its k still follows acceptance
    for _ in range(3):
        free.observe(free.next_k(), free.next_k(), 0.001 * PLAIN_STEP, 1.2 * PLAIN_STEP)
    assert free.k == 3


def test_invalid_settings() -> None:
    with pytest.raises(ValueError):
        AdaptiveK(k_max=0)
    with pytest.raises(ValueError):
        AdaptiveK(k_max=2, backoff=50, max_backoff=10)
    with pytest.raises(ValueError):
        AdaptiveK(k_max=2, probe_budget=0)


# --- through the engine, on the real default model -------------------------------------------


class WrongDrafter(Drafter):
    """Proposes tokens the target never picks (the vocabulary's last ids), counting its calls;
    each proposal takes 10 ms, as a draft model's passes would."""

    added_memory_bytes = 0

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.calls = 0

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        pass

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        self.calls += 1
        time.sleep(0.01)
        return Proposal([self.vocab_size - 1 - i for i in range(k)])

    def commit(self, context: list[int], num_accepted: int) -> None:
        pass


@pytest.mark.real
def test_adaptive_switches_a_useless_drafter_off_without_changing_output(default_model: LoadedModel) -> None:
    prompt = default_model.tokenizer("The history of the printing press begins", add_special_tokens=True)["input_ids"]
    params = SamplingParams(max_tokens=96, ignore_eos=True)
    plain = Engine(default_model).generate(prompt, params)
    drafter = WrongDrafter(default_model.vocab_size)
    engine = Engine(default_model, drafter, 4, adaptive=True)
    adaptive = engine.generate(prompt, params)
    assert adaptive.token_ids == plain.token_ids
    stats = adaptive.stats
    assert stats.accepted_tokens == 0
    # Off most of the time: the drafter is not even asked while speculation is off.
    assert stats.undrafted_steps > stats.target_steps / 2
    assert drafter.calls == stats.target_steps - stats.undrafted_steps
    # The engine remembers: the next request starts switched off, so it drafts even less.
    calls = drafter.calls
    again = engine.generate(prompt, params)
    assert again.token_ids == plain.token_ids
    assert drafter.calls - calls < calls


@pytest.mark.real
def test_adaptive_keeps_a_paying_drafter_on(default_model_native_f32: LoadedModel) -> None:
    # In float32 the model copies the list exactly (the int4 model paraphrases part of it).
    default_model = default_model_native_f32
    llm = LLM(loaded=default_model)
    fruit = "apples, pears, plums, cherries, grapes, lemons, limes, oranges, peaches, figs, dates, kiwis"
    prompt = llm.encode([{"role": "user", "content": f"Copy this list exactly: {fruit}."}])
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    plain = Engine(default_model).generate(prompt, params)
    fixed = Engine(default_model, NgramDrafter(1, 6), 6).generate(prompt, params)
    engine = Engine(default_model, NgramDrafter(1, 6), 6, adaptive=True)
    adaptive = engine.generate(prompt, params)
    assert adaptive.token_ids == fixed.token_ids == plain.token_ids
    # The answer repeats itself: lookup is nearly always right, and adaptive k keeps drafting.
    assert fixed.stats.acceptance_rate > 0.8
    assert adaptive.stats.acceptance_rate > 0.8
    assert adaptive.stats.mean_accepted_length > 0.9 * fixed.stats.mean_accepted_length
    state = engine.adaptive_states.get()
    assert state is not None and state.switched_off == 0


@pytest.mark.real
def test_a_draft_resumed_after_a_pause_keeps_output_identical(default_model: LoadedModel) -> None:
    # The engine starts switched off (as after a draft that did not pay), so the probe resumes
    # the draft mid-request on the recent window of the context only.
    llm = LLM(loaded=default_model)
    prompt = llm.encode([{"role": "user", "content": "Explain how a bicycle stays upright, step by step."}])
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    plain = Engine(default_model).generate(prompt, params)
    drafter = DraftModelDrafter(default_model, layers=range(0, 30, 2), resume_window=16)
    engine = Engine(default_model, drafter, 3, adaptive=True)
    engine.adaptive_states.set(AdaptiveState(k=2, backoff=16, off_steps_left=30, switched_off=1))
    resumed = engine.generate(prompt, params)
    assert resumed.token_ids == plain.token_ids
    assert resumed.stats.drafted_tokens > 0 and drafter.offset > 0
    assert drafter.cached[: drafter.sink] == prompt[: drafter.sink]
    assert drafter.offset > len(prompt)  # it saw none of the prompt past the sink
