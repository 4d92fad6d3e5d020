"""Predicted outputs: the drafter follows the output through the prediction, finds its place
again after an edit, and proposes nothing while lost; through the engine a prediction never
changes the output (greedy identical to plain decoding whatever it predicts, and the sampled
first tokens follow the target's exact distribution), and a right prediction takes far fewer
target passes."""

from __future__ import annotations

import dataclasses


from specdec import LLM, SamplingParams
from specdec.drafters.prediction import PREDICTION_K, PredictionDrafter
from specdec.engine import Engine
from specdec.models import LoadedModel
from tests.engine.test_sampling_distribution import PROMPT, SAMPLED, VOCAB, assert_first_tokens_follow, exact_sequence_probs

PARAMS = SamplingParams()


def proposals(drafter: PredictionDrafter, prompt: list[int], output: list[int], k: int = 4) -> list[int]:
    drafter.commit(prompt + output, 0)
    return drafter.propose(prompt + output, k, PARAMS, None).tokens


def test_follows_the_prediction_and_finds_its_place_after_an_edit() -> None:
    prediction = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    drafter = PredictionDrafter(prediction)
    prompt = [1, 2]
    drafter.begin(prompt, 100)
    # The draft grows with the run of tokens that followed the prediction (at least 2, at most k).
    assert proposals(drafter, prompt, []) == [10, 11]
    assert proposals(drafter, prompt, [10, 11]) == [12, 13]
    assert proposals(drafter, prompt, [10, 11, 12]) == [13, 14, 15]
    other = PredictionDrafter(prediction)
    other.begin(prompt, 100)
    assert proposals(other, prompt, [10, 11, 12, 13]) == [14, 15, 16, 17]  # k
    # An edit: 13 replaced by 99. Lost: prompt lookup over the prediction and the context finds
    # nothing for 99, then 14 in the prediction: its place again, followed from there.
    assert proposals(drafter, prompt, [10, 11, 12, 99]) == []
    assert proposals(drafter, prompt, [10, 11, 12, 99, 14]) == [15, 16]
    assert proposals(drafter, prompt, [10, 11, 12, 99, 14, 15]) == [16, 17]
    assert proposals(drafter, prompt, [10, 11, 12, 99, 14, 15, 16, 17, 18, 19]) == []  # the end


def test_lost_in_a_loop_it_looks_up_the_context() -> None:
    drafter = PredictionDrafter([1, 2, 3, 4, 5])
    drafter.begin([0], 100)
    # The output left the prediction at 9 and repeats itself: the latest "9 8" is in the output.
    assert proposals(drafter, [0], [1, 2, 3, 9, 8, 7, 9, 8]) == [7]


def real_edit(model: LoadedModel) -> tuple[list[dict], list[int]]:
    """A rename request over a function of Python's standard library, and the function as the
    prediction (the answer mostly repeats it)."""
    source = '''def indent(text, prefix):
    """Add prefix to every line of text."""
    return "".join(prefix + line for line in text.splitlines(True))
'''
    code = f"```python\n{source}```"
    messages = [{"role": "user", "content": f"Rewrite this Python function, renaming the parameter prefix to pad:\n\n{code}"}]
    return messages, model.tokenizer.encode(code, add_special_tokens=False)


def test_a_prediction_never_changes_greedy_output(default_model: LoadedModel) -> None:
    messages, prediction = real_edit(default_model)
    llm = LLM(loaded=default_model)
    params = SamplingParams(max_tokens=80)
    plain = llm.generate([messages], params, speculate=False)[0]
    right = llm.generate([messages], dataclasses.replace(params, prediction=tuple(plain.token_ids)), speculate=False)[0]
    source = llm.generate([messages], dataclasses.replace(params, prediction=tuple(prediction)), speculate=False)[0]
    wrong = llm.generate([messages], dataclasses.replace(params, prediction=tuple(range(1000, 1100))), speculate=False)[0]
    for out in (right, source, wrong):
        assert out.token_ids == plain.token_ids
    assert right.stats.acceptance_rate == 1.0 and source.stats.accepted_tokens > 0
    # Drafts of 2, 3, 7, then k: the passes of a right prediction are a fraction of the tokens.
    assert len(right.stats.drafted_at) == PREDICTION_K  # drafted_at: drafts per position
    assert right.stats.target_forward_passes <= len(plain.token_ids) // 4


def test_sampling_with_a_prediction_follows_the_target(small_model_factory) -> None:
    target = small_model_factory(seed=1, vocab_size=VOCAB)
    engine = Engine(target)
    prediction = (PROMPT * 2)[:6]  # tokens the target often samples, and often not
    params = dataclasses.replace(SAMPLED, prediction=prediction)
    assert engine.generate(PROMPT, dataclasses.replace(params, seed=0)).stats.drafted_tokens > 0
    assert_first_tokens_follow(engine, PROMPT, params, exact_sequence_probs(target, SAMPLED), VOCAB, draws=2500, tv=0.05)
