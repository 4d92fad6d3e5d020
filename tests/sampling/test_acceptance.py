"""greedy_accept and speculative_accept: exact one-hot cases, shape checks, seeded
determinism, and statistical tests that the committed tokens follow the target distribution
(and that a wrong rule is caught by the same tests)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec.sampling import AcceptResult, greedy_accept, speculative_accept
from specdec.sampling.acceptance import PAD_TOKEN
from specdec.sampling.probs import sample

VOCAB = 6


def one_hot_logits(tokens: list[list[int]], vocab: int = VOCAB) -> torch.Tensor:
    """[batch, positions] argmax tokens -> [batch, positions, vocab] logits."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float() * 5.0


# --- greedy_accept ---------------------------------------------------------------------------


def test_greedy_all_accepted_adds_bonus_argmax_at_last_position() -> None:
    result = greedy_accept(one_hot_logits([[1, 2, 3, 4]]), torch.tensor([[1, 2, 3]]))
    assert result.num_accepted.tolist() == [3]
    assert result.tokens.tolist() == [[1, 2, 3, 4]]
    assert result.row(0) == [1, 2, 3, 4]


@pytest.mark.parametrize("mismatch", [0, 1, 2])
def test_greedy_first_mismatch_adds_target_argmax_there(mismatch: int) -> None:
    target = [1, 2, 3, 4]
    draft = [1, 2, 3]
    draft[mismatch] = 5
    result = greedy_accept(one_hot_logits([target]), torch.tensor([draft]))
    assert result.num_accepted.tolist() == [mismatch]
    assert result.row(0) == target[:mismatch] + [target[mismatch]]
    # Positions after the recovered token are padding, whatever the draft held there.
    assert result.tokens[0, mismatch + 1 :].tolist() == [PAD_TOKEN] * (3 - mismatch)


def test_greedy_later_agreement_after_a_mismatch_is_not_accepted() -> None:
    result = greedy_accept(one_hot_logits([[1, 2, 3, 4]]), torch.tensor([[0, 2, 3]]))
    assert result.row(0) == [1]


def test_greedy_rows_are_independent() -> None:
    logits = one_hot_logits([[1, 2, 3], [4, 5, 0], [1, 1, 1]])
    draft = torch.tensor([[1, 2], [4, 0], [2, 1]])
    result = greedy_accept(logits, draft)
    assert result.num_accepted.tolist() == [2, 1, 0]
    assert [result.row(i) for i in range(3)] == [[1, 2, 3], [4, 5], [1]]


def test_greedy_empty_draft_is_plain_decoding() -> None:
    result = greedy_accept(one_hot_logits([[3], [0]]), torch.empty((2, 0), dtype=torch.long))
    assert result.num_accepted.tolist() == [0, 0]
    assert result.tokens.tolist() == [[3], [0]]


@pytest.mark.parametrize(
    ("logits_shape", "draft_shape"),
    [((1, 4, VOCAB), (3,)), ((1, 3, VOCAB), (1, 3)), ((2, 4, VOCAB), (1, 3)), ((4, VOCAB), (1, 3))],
)
def test_greedy_checks_shapes(logits_shape: tuple[int, ...], draft_shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="must be"):
        greedy_accept(torch.zeros(logits_shape), torch.zeros(draft_shape, dtype=torch.long))


# --- speculative_accept: exact cases ----------------------------------------------------------


def random_dists(generator: torch.Generator, *shape: int, sharpness: float = 1.5) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=generator) * sharpness, dim=-1)


@pytest.mark.parametrize(
    ("target_shape", "draft_shape", "probs_shape"),
    [
        ((1, 4, VOCAB), (1, 4), None),
        ((1, 4, VOCAB), (4,), None),
        ((1, 4, VOCAB), (1, 3), (1, 2, VOCAB)),
        ((1, 4, VOCAB), (1, 3), (1, 3, VOCAB + 1)),
    ],
)
def test_speculative_checks_shapes(target_shape, draft_shape, probs_shape) -> None:
    draft_probs = None if probs_shape is None else torch.full(probs_shape, 1.0 / probs_shape[-1])
    with pytest.raises(ValueError, match="must be"):
        speculative_accept(
            torch.full(target_shape, 1.0 / VOCAB), torch.zeros(draft_shape, dtype=torch.long), draft_probs
        )


def test_draft_equal_to_target_always_accepts() -> None:
    gen = torch.Generator().manual_seed(0)
    batch, k = 4000, 3
    dists = random_dists(gen, batch, k + 1, VOCAB)
    draft = torch.multinomial(dists[:, :k].reshape(-1, VOCAB), 1, generator=gen).view(batch, k)
    result = speculative_accept(dists, draft, dists[:, :k].clone(), gen)
    assert (result.num_accepted == k).all()
    assert torch.equal(result.tokens[:, :k], draft)


def test_draft_token_with_zero_target_probability_is_always_rejected() -> None:
    gen = torch.Generator().manual_seed(1)
    batch, k = 4000, 2
    target = random_dists(gen, batch, k + 1, VOCAB)
    target[:, 0, 5] = 0.0
    target = target / target.sum(-1, keepdim=True)
    draft = torch.full((batch, k), 5)
    draft_probs = torch.full((batch, k, VOCAB), 0.02)
    draft_probs[:, :, 5] = 0.9
    for probs in (draft_probs, None):
        result = speculative_accept(target, draft, probs, gen)
        assert (result.num_accepted == 0).all()
        # The recovered token comes from the residual, which has no mass on token 5.
        assert (result.tokens[:, 0] != 5).all()
        assert (result.tokens[:, 1:] == PAD_TOKEN).all()


def test_one_hot_target_matching_draft_accepts_and_bonus_follows_target() -> None:
    target = torch.nn.functional.one_hot(torch.tensor([[2, 4, 1]]), VOCAB).float()
    result = speculative_accept(target, torch.tensor([[2, 4]]), None, torch.Generator().manual_seed(0))
    assert result.row(0) == [2, 4, 1]


def test_seeded_determinism() -> None:
    gen = torch.Generator().manual_seed(3)
    batch, k = 500, 3
    target = random_dists(gen, batch, k + 1, VOCAB)
    draft_probs = random_dists(gen, batch, k, VOCAB)
    draft = torch.multinomial(draft_probs.reshape(-1, VOCAB), 1, generator=gen).view(batch, k)

    def run(seed: int) -> AcceptResult:
        return speculative_accept(target, draft, draft_probs, torch.Generator().manual_seed(seed))

    a, b, c = run(11), run(11), run(12)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    assert not torch.equal(a.tokens, c.tokens)


def test_result_layout_pads_after_the_final_token() -> None:
    gen = torch.Generator().manual_seed(4)
    batch, k = 2000, 3
    target = random_dists(gen, batch, k + 1, VOCAB)
    draft_probs = random_dists(gen, batch, k, VOCAB)
    draft = torch.multinomial(draft_probs.reshape(-1, VOCAB), 1, generator=gen).view(batch, k)
    result = speculative_accept(target, draft, draft_probs, gen)
    assert result.tokens.shape == (batch, k + 1)
    assert set(result.num_accepted.unique().tolist()) == {0, 1, 2, 3}  # every outcome occurs
    positions = torch.arange(k + 1)
    n = result.num_accepted[:, None]
    accepted_part = torch.where(positions < n, result.tokens, -2)[:, :k]
    assert torch.equal(accepted_part, torch.where(positions[:k] < n, draft, -2))
    assert ((result.tokens >= 0) == (positions <= n)).all()


# --- speculative_accept: the committed tokens follow the target --------------------------------


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of integer samples to `probs`; cells expecting under 5 are pooled."""
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() / probs.sum() * len(samples)
    assert counts[expected == 0].sum() == 0, "a sample fell where the distribution has no mass"
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    exp = exp * (obs.sum() / exp.sum())  # chisquare wants equal totals to 1e-8
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=len(probs)).double() / len(samples)
    return 0.5 * float((freq - probs.double()).abs().sum())


def accept_all(target_probs, draft_tokens, draft_probs, generator=None) -> AcceptResult:
    """A WRONG rule: keep every drafted token, then draw the bonus token from the target."""
    batch, k = draft_tokens.shape
    bonus = torch.multinomial(target_probs[:, k], 1, generator=generator).squeeze(1)
    tokens = torch.cat([draft_tokens, bonus[:, None]], dim=1)
    return AcceptResult(tokens=tokens, num_accepted=torch.full((batch,), k, dtype=torch.long))


def disagreeing_pair(seed: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs: [k + 1, vocab] and draft_probs: [k, vocab], far apart (TV > 0.3 per row)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        target = random_dists(gen, k + 1, VOCAB, sharpness=2.0)
        draft = random_dists(gen, k, VOCAB, sharpness=2.0)
        if (0.5 * (target[:k] - draft).abs().sum(-1)).min() > 0.3:
            return target, draft


def run_rule(
    rule,
    target: torch.Tensor,
    draft_probs: torch.Tensor | None,
    batch: int,
    seed: int,
    draft_tokens: torch.Tensor | None = None,
) -> AcceptResult:
    """Vectorised trials: the same distributions in every row; draft tokens drawn from draft_probs."""
    gen = torch.Generator().manual_seed(seed)
    k = target.shape[0] - 1
    if draft_tokens is None:
        draft_tokens = torch.multinomial(draft_probs, batch, replacement=True, generator=gen).T  # [batch, k]
    target_b = target.expand(batch, k + 1, VOCAB)
    draft_b = None if draft_probs is None else draft_probs.expand(batch, k, VOCAB)
    return rule(target_b, draft_tokens, draft_b, gen)


SAMPLES = 40_000


@pytest.mark.parametrize("k", [1, 2, 3])
def test_first_committed_token_follows_target(k: int) -> None:
    target, draft = disagreeing_pair(seed=10 + k, k=k)
    result = run_rule(speculative_accept, target, draft, SAMPLES, seed=k)
    assert chi2_pvalue(result.tokens[:, 0], target[0]) > 1e-3
    # Sanity of the setup: the draft alone is far from the target.
    draft_only = torch.multinomial(draft[0], SAMPLES, replacement=True, generator=torch.Generator().manual_seed(k))
    assert chi2_pvalue(draft_only, target[0]) < 1e-6


@pytest.mark.parametrize("k", [2, 3])
def test_second_committed_token_follows_target_given_first_accepted(k: int) -> None:
    target, draft = disagreeing_pair(seed=20 + k, k=k)
    result = run_rule(speculative_accept, target, draft, SAMPLES, seed=100 + k)
    second = result.tokens[result.num_accepted >= 1, 1]
    assert len(second) > 2000
    assert chi2_pvalue(second, target[1]) > 1e-3


@pytest.mark.parametrize("k", [1, 2, 3])
def test_bonus_token_follows_target_after_last_draft(k: int) -> None:
    target, draft = disagreeing_pair(seed=30 + k, k=k)
    # Make full acceptance common: the draft distributions are close to the target's.
    draft = 0.7 * target[:k] + 0.3 * draft
    result = run_rule(speculative_accept, target, draft, SAMPLES, seed=200 + k)
    bonus = result.tokens[result.num_accepted == k, k]
    assert len(bonus) > 5000
    assert chi2_pvalue(bonus, target[k]) > 1e-3


@pytest.mark.parametrize("k", [1, 3])
def test_wrong_rule_fails_the_same_test(k: int) -> None:
    target, draft = disagreeing_pair(seed=10 + k, k=k)
    result = run_rule(accept_all, target, draft, SAMPLES, seed=k)
    assert chi2_pvalue(result.tokens[:, 0], target[0]) < 1e-6


def test_total_variation_shrinks_with_samples() -> None:
    k = 2
    target, draft = disagreeing_pair(seed=40, k=k)
    distances = []
    for n in (500, 5_000, 100_000):
        result = run_rule(speculative_accept, target, draft, n, seed=n)
        distances.append(total_variation(result.tokens[:, 0], target[0]))
    assert distances[-1] < distances[0]
    assert distances[-1] < 0.015
    # The wrong rule stays far away however many samples it gets.
    wrong = run_rule(accept_all, target, draft, 100_000, seed=1)
    assert total_variation(wrong.tokens[:, 0], target[0]) > 0.2


@pytest.mark.parametrize("token", [0, 3, 5])
def test_deterministic_draft_rule_preserves_target_for_a_fixed_token(token: int) -> None:
    target, _ = disagreeing_pair(seed=50, k=1)
    draft_tokens = torch.full((SAMPLES, 1), token)
    result = run_rule(speculative_accept, target, None, SAMPLES, seed=token, draft_tokens=draft_tokens)
    # Accepted with probability target_probs[token].
    accept_rate = result.num_accepted.float().mean().item()
    assert accept_rate == pytest.approx(target[0, token].item(), abs=0.01)
    assert chi2_pvalue(result.tokens[:, 0], target[0]) > 1e-3
    # Taking the token as given would be wrong.
    assert chi2_pvalue(draft_tokens[:, 0], target[0]) < 1e-6


def test_deterministic_draft_rule_preserves_target_for_varying_tokens() -> None:
    k = 3
    target, draft = disagreeing_pair(seed=60, k=k)
    gen = torch.Generator().manual_seed(61)
    draft_tokens = torch.multinomial(draft, SAMPLES, replacement=True, generator=gen).T  # any proposal rule
    result = run_rule(speculative_accept, target, None, SAMPLES, seed=62, draft_tokens=draft_tokens)
    assert chi2_pvalue(result.tokens[:, 0], target[0]) > 1e-3
    assert chi2_pvalue(result.tokens[result.num_accepted >= 1, 1], target[1]) > 1e-3


# --- a whole step: rows with their own lengths, parameters and generators ---------------------


def test_accept_batch_matches_each_row_alone() -> None:
    from specdec.config import SamplingParams
    from specdec.sampling import accept_batch, logits_to_probs

    torch.manual_seed(3)
    vocab, n = 12, 3
    logits = torch.randn(4, n + 1, vocab) * 3  # [rows, n + 1, vocab]
    drafts = [[int(logits[0, i].argmax()) for i in range(2)], [], [5, 6, 7], [1]]
    padded = torch.tensor([d + [PAD_TOKEN] * (n - len(d)) for d in drafts])  # [rows, n]
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8, top_k=6)
    params = [greedy, greedy, sampled, sampled]
    draft_probs = [None, None, torch.softmax(torch.randn(3, vocab), -1), None]
    result = accept_batch(logits, padded, [len(d) for d in drafts], draft_probs, params,
                          [None, None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)])
    # Greedy rows: as greedy_accept on the row alone (row 0's drafts are the argmaxes: all kept).
    for i in (0, 1):
        k = len(drafts[i])
        alone = greedy_accept(logits[i : i + 1, : k + 1], torch.tensor([drafts[i]], dtype=torch.long).reshape(1, k))
        assert result.row(i) == alone.row(0)
    assert result.num_accepted[0] == 2
    # Sampled rows: the rule on the row's own filtered distributions, with the row's generator.
    for i, seed in ((2, 1), (3, 2)):
        k = len(drafts[i])
        target = logits_to_probs(logits[i, : k + 1], params[i])[None]
        probs = None if draft_probs[i] is None else draft_probs[i][None]
        alone = speculative_accept(target, torch.tensor([drafts[i]]), probs, torch.Generator().manual_seed(seed))
        assert result.row(i) == alone.row(0)
    # A row never keeps more than it drafted.
    assert all(int(result.num_accepted[i]) <= len(drafts[i]) for i in range(4))


def test_nothing_drafted_draws_the_bonus_token_as_the_general_rule_does() -> None:
    # A row with no draft (every plain sampled step) takes a short path; it must draw exactly what
    # the rule's step 2 draws for a full accept of nothing: the target renormalised, one uniform.
    target = torch.softmax(3 * torch.randn(4, 1, 500, generator=torch.Generator().manual_seed(3)), dim=-1)
    target[1, 0, :250] = 0.0  # rows that do not sum to one
    drawn, reference = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(300):
        result = speculative_accept(target, torch.empty(4, 0, dtype=torch.long), None, drawn)
        final = target[:, 0]
        mass = final.sum(dim=-1, keepdim=True)
        want = sample(torch.where(mass > 0, final / mass.clamp_min(1e-30), final), reference)
        assert torch.equal(result.tokens, want[:, None])
        assert torch.equal(result.num_accepted, torch.zeros(4, dtype=torch.long))
    assert torch.equal(drawn.get_state(), reference.get_state())
    # And it follows the target (a wrong short path, e.g. the top token, fails here).
    many = speculative_accept(target[:1].expand(4000, 1, 500), torch.empty(4000, 0, dtype=torch.long), None,
                              torch.Generator().manual_seed(9)).tokens[:, 0]
    assert chi2_pvalue(many, target[0, 0]) > 1e-3
