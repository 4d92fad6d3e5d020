"""End to end through the Engine, temperature > 0: speculative sampling draws the first
tokens of a generation from exactly the target's distribution, whatever the drafter.

Tiny random models over 8 tokens make the target's distribution over whole 3-token
continuations enumerable (512 sequences, one batched forward pass without any cache) and a
generation cheap enough to sample thousands of times. With max_tokens=4 and k=2 the first
verification step drafts two tokens, so the 2nd and 3rd tokens go through the acceptance rule
at both draft positions, as accepted, recovered or bonus tokens."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from scipy.stats import chisquare

import specdec.engine.engine as engine_module
from specdec.config import SamplingParams
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter, EagleHead
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.lookahead import LookaheadDrafter
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.mtp import MtpDrafter, load_mtp
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixCache, SuffixDrafter
from specdec.engine import Engine
from specdec.engine.batch import BatchEngine, Sequence, draft_room
from specdec.methods import MedusaTrainOptions
from specdec.models.qlinear import QUANTIZED_FORMATS
from specdec.models import LoadedModel, ModelRunner
from specdec.models.quantize import quantize_int8
from specdec.sampling import AcceptResult, logits_to_probs
from specdec.training.heads import TrainConfig, new_head

VOCAB = 8
LENGTH = 3  # tokens of each continuation compared
PROMPT = [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 4]  # repeats itself, so prompt lookup finds drafts
SAMPLED = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
ROWS = 32  # requests sampled at once


# The suite runs on every backend and format: the target on hf, and on native in each format
# (its own exact distribution is the reference each time). Every drafter runs on the default path
# (native q4 on specdec's kernels); on hf, every drafter whose drafting goes through the
# backend's own code (a layer subset, an int8 copy, the target's states a head reads); on native
# float32, whose products are not row-invariant, one drafter per kind of proposal: a draft
# model's chain with its q, prompt lookup's deterministic chain, a head's tree. bfloat16, int8 and
# int4 products are row-invariant (tests/models/test_native.py), so a verification pass gives
# bitwise the logits of the plain steps it replaces: there one drafter, the draft model's chain,
# checks the format end to end. The rest (adaptive k, a resumed draft, the hybrid, suffix,
# lookahead, Medusa's tree) draft the same way over any backend. What does not depend on the
# backend at all (the filters, the drafter-invariant rule, a wrong rule's failure) runs on hf and
# the default path (SAMPLING_LOGIC_ON).
BACKENDS = ["hf", "native-float32", "native-bfloat16", "native-int8", "native-int4", "native-q4"]
EVERY_DRAFTER_ON = "native-q4"
DRAFTERS_ON_HF = ("layer_skip", "int8", "eagle", "medusa", "mtp")
DRAFTERS_ON_FLOAT32 = ("draft_model", "ngram", "eagle-tree")
DRAFTERS_ON_EVERY_BACKEND = ("draft_model",)
SAMPLING_LOGIC_ON = pytest.mark.parametrize("target", ["hf", EVERY_DRAFTER_ON], indirect=True)


def backend_matrix(drafters: list[str], on_every_backend=DRAFTERS_ON_EVERY_BACKEND) -> list:
    """(target backend, drafter) pairs: every drafter on EVERY_DRAFTER_ON, DRAFTERS_ON_HF on hf,
    DRAFTERS_ON_FLOAT32 on native float32 and hf, on_every_backend everywhere; for
    `parametrize(("target", "drafter"), ..., indirect=["target"])`."""
    return [pytest.param(backend, drafter, id=f"{backend}-{drafter}") for backend in BACKENDS for drafter in drafters
            if backend == EVERY_DRAFTER_ON or drafter in on_every_backend
            or (backend in ("hf", "native-float32") and drafter in DRAFTERS_ON_FLOAT32)
            or (backend == "hf" and drafter in DRAFTERS_ON_HF)]


def on_backend(loaded: LoadedModel, variant: str) -> LoadedModel:
    return loaded if variant == "hf" else loaded.native(variant.split("-")[1])


@pytest.fixture(scope="module", params=BACKENDS)
def target(small_model_factory, request: pytest.FixtureRequest) -> LoadedModel:
    return on_backend(small_model_factory(seed=1, vocab_size=VOCAB), request.param)


@pytest.fixture(scope="module")
def draft(small_model_factory) -> LoadedModel:
    """The separate draft model, on the native backend in float32 as a draft model loads by
    default (and at less than half hf's cost a call: thousands of drafts per test)."""
    return small_model_factory(seed=2, vocab_size=VOCAB).native("float32")


def exact_sequence_probs(loaded: LoadedModel, params: SamplingParams) -> torch.Tensor:
    """[VOCAB ** 3]: probability of each continuation (t1, t2, t3), index t1 * 64 + t2 * 8 + t3,
    from one pass of the model over each 2-token prefix into a fresh cache."""
    prefixes = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # [64, 2]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], dim=1)  # [64, P + 2]
    runner = ModelRunner(loaded)
    logits = torch.stack([runner.score(row.tolist()) for row in ids])[:, len(PROMPT) - 1 :]  # [64, 3, vocab]
    probs = logits_to_probs(logits.double(), params).double()  # [64, 3, vocab]
    first = probs[:, 0].gather(1, prefixes[:, :1]).squeeze(1)  # p(t1)
    second = probs[:, 1].gather(1, prefixes[:, 1:]).squeeze(1)  # p(t2 | t1)
    joint = (first * second)[:, None] * probs[:, 2]  # [64, vocab]: p(t1) p(t2 | t1) p(t3 | t1, t2)
    return joint.reshape(-1)


def sample_outputs(engine: Engine, prompt: list[int], params: SamplingParams, n: int, first_seed: int = 0,
                   rows: int = ROWS) -> list[list[int]]:
    """The tokens of n seeded generations (seeds first_seed, first_seed + 1, ...), in seed order:
    `engine`'s drafter, k, adaptive policy and rules (a request's own prediction drafting it
    instead, as admission decides for Engine.generate), run `rows` requests at a time in one
    batch engine (a seeded request samples the same tokens in any batch: tests/engine/test_batch.py)."""
    size = draft_room(engine.k, engine.drafter.proposal_size if engine.drafter else 0)
    batch = BatchEngine(engine.target, max_rows=rows, max_model_len=len(prompt) + params.max_tokens,
                        max_draft=max(size, 1), sampling_rule=engine.sampling_rule, tree_rule=engine.tree_rule)
    seeds = list(range(first_seed, first_seed + n))
    outputs: dict[int, list[int]] = {}

    def finish(seq: Sequence) -> None:
        outputs[seq.params.seed] = seq.result.token_ids
        batch.remove(seq)

    while seeds or batch.sequences:
        while seeds and batch.running < rows:
            seeded = dataclasses.replace(params, seed=seeds.pop(0))
            drafter = engine.drafter.fork() if engine.drafter is not None else None
            assert type(drafter) is type(engine.drafter), "a test's drafter class must fork into its own class"
            out = batch.admit(prompt, seeded, drafter, engine.k, engine.new_policy())
            if out.finished:
                finish(out.sequence)
        for out in batch.step() if batch.sequences else []:
            if out.finished:
                finish(out.sequence)
    return [outputs[seed] for seed in range(first_seed, first_seed + n)]


def sample_sequences(engine: Engine, params: SamplingParams, n: int, first_seed: int = 0, rows: int = ROWS) -> torch.Tensor:
    """[n] indices of the first 3 generated tokens of PROMPT's seeded generations (sample_outputs)."""
    indices = []
    for tokens in sample_outputs(engine, PROMPT, params, n, first_seed, rows):
        assert len(tokens) == params.max_tokens
        indices.append(tokens[0] * VOCAB**2 + tokens[1] * VOCAB + tokens[2])
    return torch.tensor(indices)


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit; cells expecting fewer than 5 samples are pooled into one."""
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs / probs.sum() * len(samples)
    assert counts[expected == 0].sum() == 0, "sampled a sequence the target gives probability 0"
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if len(obs) == 1:
        # The target puts all its mass on one sequence (a peaked tiny model under filters): no
        # degree of freedom is left, and the support check above is the whole test.
        return 1.0
    return float(chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)


def marginal_tv(samples: torch.Tensor, probs: torch.Tensor, position: int, vocab: int = VOCAB) -> float:
    """Total variation between sampled and exact marginals of token `position` (0, 1 or 2)."""
    tokens = samples // vocab ** (LENGTH - 1 - position) % vocab
    freq = torch.bincount(tokens, minlength=vocab).double() / len(samples)
    exact = probs.reshape(vocab, vocab, vocab).sum(dim=tuple(d for d in range(LENGTH) if d != position))
    return 0.5 * float((freq - exact).abs().sum())


def assert_first_tokens_follow(engine: Engine, prompt: list[int], params: SamplingParams, exact: torch.Tensor,
                               vocab: int, draws: int = 2000, end: int = -1, tv: float = 0.06) -> None:
    """Seeded generations' (sample_outputs) first 3 tokens follow `exact` ([vocab ** 3]) by
    chi-square and by each position's marginal; an output that ends before 3 tokens (a grammar's
    EOS) counts `end` there."""
    samples = []
    for tokens in sample_outputs(engine, prompt, params, draws):
        tokens = tokens + [end] * (LENGTH - len(tokens))
        samples.append(tokens[0] * vocab**2 + tokens[1] * vocab + tokens[2])
    samples_t = torch.tensor(samples)
    assert chi2_pvalue(samples_t, exact) > 1e-3
    for position in range(LENGTH):
        assert marginal_tv(samples_t, exact, position, vocab) < tv


def accept_all(target_probs, draft_tokens, draft_probs, generator=None) -> AcceptResult:
    """A WRONG rule: keep every drafted token, then draw the bonus token from the target."""
    batch, k = draft_tokens.shape
    bonus = torch.multinomial(target_probs[:, k], 1, generator=generator).squeeze(1)
    tokens = torch.cat([draft_tokens, bonus[:, None]], dim=1)
    return AcceptResult(tokens=tokens, num_accepted=torch.full((batch,), k, dtype=torch.long))


def recover_from_target(target_probs, draft_tokens, draft_probs, generator=None) -> AcceptResult:
    """A subtly WRONG rule: the right acceptance test, but at a rejection the recovered token is
    drawn from the target instead of the residual max(0, target - draft)."""
    batch, k = draft_tokens.shape
    assert batch == 1
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, target_probs.shape[-1]).to(target_probs.dtype)
    accepted = []
    for i, token in enumerate(draft_tokens[0].tolist()):
        ratio = target_probs[0, i, token] / draft_probs[0, i, token]
        if torch.rand((), generator=generator) >= ratio:
            break
        accepted.append(token)
    final = int(torch.multinomial(target_probs[0, len(accepted)], 1, generator=generator))
    tokens = accepted + [final] + [-1] * (k - len(accepted))
    return AcceptResult(tokens=torch.tensor([tokens]), num_accepted=torch.tensor([len(accepted)]))


def engine_with_rule(target: LoadedModel, drafter, rule, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """An engine whose sampled verification uses `rule` instead of speculative_accept."""
    if "sampling_rule" in inspect.signature(Engine).parameters:
        return Engine(target, drafter, 2, sampling_rule=rule)
    monkeypatch.setattr(engine_module, "speculative_accept", rule)
    return Engine(target, drafter, 2)


def test_setup_a_resumed_draft_sees_a_window(target: LoadedModel, draft: LoadedModel) -> None:
    drafter = make_engine("resumed", target, draft).drafter
    drafter.begin(PROMPT, 16)
    drafter.propose(PROMPT, 2, SAMPLED, torch.Generator().manual_seed(0))
    assert drafter.cached[:6] == PROMPT[:2] + PROMPT[-4:]


def test_setup_target_and_draft_disagree(target: LoadedModel, draft: LoadedModel) -> None:
    exact_target = exact_sequence_probs(target, SAMPLED)
    exact_draft = exact_sequence_probs(draft, SAMPLED)
    assert exact_target.sum().item() == pytest.approx(1.0)
    assert 0.5 * (exact_target - exact_draft).abs().sum().item() > 0.5


@pytest.fixture(scope="module")
def deep_target(small_model_factory, target: LoadedModel) -> LoadedModel:
    """Three layers, so that a subset of them is a different model (layer_skip); on the
    target's backend."""
    deep = small_model_factory(seed=3, vocab_size=VOCAB, layers=3)
    return deep if target.model is not None else deep.native(target.backend.weight_format)


class ResumedDrafter(DraftModelDrafter):
    """A draft that every request finds resumed after a pause (as adaptive k resumes one): it
    runs on the prompt's first 2 tokens and last 4 only."""

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        super().begin(prompt_ids, max_len)
        self.resume()

    def fork(self) -> ResumedDrafter:
        return ResumedDrafter(self.runner.loaded, sink=self.sink, resume_window=self.resume_window)


def make_engine(name: str, target: LoadedModel, draft: LoadedModel, mtp_checkpoint=None, tmp_path=None) -> Engine:
    """Every drafter family on the tiny models: a separate draft, prompt lookup, a subset of
    the target's layers (self-speculation), the target in int8, a draft with adaptive k, and a
    draft resumed on a window of the context."""
    if name == "draft_model":
        return Engine(target, DraftModelDrafter(draft), 2)
    if name == "draft_model-confident":  # up to 3 tokens, ending where the draft's top token is below 0.4
        return Engine(target, DraftModelDrafter(draft, p_min=0.4), 3)
    if name == "draft_model-lookup":  # lookup where a 1-token match exists, the draft model elsewhere
        from specdec.drafters.draft_model import LookupFirst

        return Engine(target, LookupFirst(DraftModelDrafter(draft), NgramDrafter(1, 3)), 2)
    if name == "ngram":
        return Engine(target, NgramDrafter(1, 3), 2)
    if name == "layer_skip":
        return Engine(target, DraftModelDrafter(target, layers=[0, 2]), 2)
    if name == "int8":
        if target.backend.weight_format.startswith(QUANTIZED_FORMATS):
            pytest.skip("an int8 self-draft of an int8 or int4 target is refused (it would cost as much as the target)")
        return Engine(target, DraftModelDrafter(quantize_int8(target)), 2)
    if name == "adaptive":
        return Engine(target, DraftModelDrafter(draft), 2, adaptive=True)
    if name == "resumed":
        return Engine(target, ResumedDrafter(draft, sink=2, resume_window=4), 2)
    if name == "eagle":
        return Engine(target, EagleDrafter(eagle_head(target)), 2)
    if name == "eagle-tree":  # top-2 children at the 2 best nodes of each depth, 3 nodes kept
        return Engine(target, EagleDrafter(eagle_head(target), tree_width=2, tree_nodes=3), 2)
    if name == "eagle-confident":  # up to 3 tokens, the chain ending where its probability under the head would fall
        # below 0.3 (a floor at which ending on the drawn token's own probability, the wrong rule, fails this test)
        return Engine(target, EagleDrafter(eagle_head(target), min_confidence=0.3), 3)
    if name == "eagle-tree-confident":  # a tree of up to 4 nodes, only those whose path has probability >= 0.5
        return Engine(target, EagleDrafter(eagle_head(target), tree_width=2, tree_nodes=4, min_confidence=0.5), 3)
    if name in ("medusa", "medusa-tree"):  # tree: each head's top 2 at the 2 best nodes of each depth, 3 kept
        heads = new_head(target, torch.arange(6), TrainConfig(arch="medusa", head_options=MedusaTrainOptions(medusa_heads=2),
                                                              draft_vocab_size=6))
        with torch.no_grad():
            for param in heads.parameters():
                param.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
        width, nodes = (2, 3) if name == "medusa-tree" else (1, None)
        return Engine(target, MedusaDrafter(heads.eval(), target.num_layers, tree_width=width, tree_nodes=nodes), 2)
    if name == "mtp":
        return Engine(target, MtpDrafter(load_mtp(mtp_checkpoint(target, tmp_path, scale=1.0)[0], target)), 2)
    if name == "suffix":  # the engine's one drafter: later samples draft from the outputs of earlier ones
        return Engine(target, SuffixDrafter(SuffixCache(10_000, 2**26), min_prob=0.0), 2)
    if name == "suffix-tree":  # siblings: the continuations the earlier samples took, best first
        return Engine(target, SuffixDrafter(SuffixCache(10_000, 2**26), spec_factor=2.0, min_prob=0.0, tree=True), 3)
    if name == "lookahead":  # a window of 2 and up to 2 bigram guesses: trees of deterministic siblings
        return Engine(target, LookaheadDrafter(window=2, n=2, guesses=2, pool_size=4), 2)
    if name == "hybrid":  # lookup where a 2-token match exists (the prompt repeats), the head elsewhere
        return Engine(target, HybridDrafter(EagleDrafter(eagle_head(target)), NgramDrafter(2, 3)), 2)
    if name == "hybrid-branches":  # where lookup matches, the head's most likely tokens as a second branch
        return Engine(target, HybridDrafter(EagleDrafter(eagle_head(target)), NgramDrafter(1, 3), 2, branches_up_to=4), 2)
    raise ValueError(name)


def eagle_head(target: LoadedModel) -> EagleHead:
    """An untrained EAGLE head reading the target's states, over 6 of the 8 tokens (so it never
    proposes two of them, which the target may still sample)."""
    head = new_head(target, torch.arange(6), TrainConfig(draft_vocab_size=6, seed=2))
    with torch.no_grad():
        head.fc.weight.mul_(8.0)  # peaked draft distributions, far from the target's
    return head.eval()


def test_setup_self_drafts_differ_from_target(target: LoadedModel, deep_target: LoadedModel) -> None:
    # The self-drafts must not be the target's own distribution, or the test below is vacuous.
    for name, model in (("layer_skip", deep_target), ("int8", target)):
        drafter = make_engine(name, model, model).drafter
        if name == "int8" and target.model is None:
            # Native int8 (per-channel weights, bfloat16 activations) is so close to the float
            # target that rejections are rare: check that its distribution differs at all.
            tv = 0.5 * (exact_sequence_probs(drafter.runner.loaded, SAMPLED) - exact_sequence_probs(model, SAMPLED)).abs().sum()
            assert tv > 1e-4, name
            continue
        params = dataclasses.replace(SAMPLED, max_tokens=12)
        engine = Engine(model, drafter, 3)
        rates = [engine.generate(PROMPT, dataclasses.replace(params, seed=s)).stats.acceptance_rate for s in range(20)]
        assert 0 < sum(rates) / len(rates) < 0.98, name


@pytest.mark.parametrize(("target", "drafter"), backend_matrix(
    ["draft_model", "draft_model-confident", "draft_model-lookup", "ngram", "layer_skip", "int8", "adaptive", "resumed", "eagle", "eagle-tree",
     "eagle-confident",
     "eagle-tree-confident", "hybrid", "hybrid-branches",
     "medusa", "medusa-tree", "mtp", "suffix", "suffix-tree", "lookahead"]), indirect=["target"])
def test_speculative_sampling_follows_target(
    target: LoadedModel, deep_target: LoadedModel, draft: LoadedModel, drafter: str, mtp_checkpoint, tmp_path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = deep_target if drafter == "layer_skip" else target
    engine = make_engine(drafter, model, draft, mtp_checkpoint, tmp_path)
    trees = []
    if drafter in ("suffix-tree", "hybrid-branches"):  # count the proposals with siblings: the test must see some
        propose = SuffixDrafter.propose if drafter == "suffix-tree" else HybridDrafter.propose

        def counted(self, *args):
            trees.append(propose(self, *args))
            return trees[-1]

        monkeypatch.setattr(SuffixDrafter if drafter == "suffix-tree" else HybridDrafter, "propose", counted)
    lengths = []
    if drafter.endswith("-confident"):  # the floor must cut some drafts short and leave some whole
        family = DraftModelDrafter if drafter.startswith("draft_model") else EagleDrafter
        family_propose = family.propose

        def measured(self, *args):
            proposal = family_propose(self, *args)
            lengths.append(len(proposal.tokens))
            return proposal

        monkeypatch.setattr(family, "propose", measured)
    samples = sample_sequences(engine, SAMPLED, 2500)
    if drafter in ("suffix-tree", "hybrid-branches"):
        assert sum(p.parents is not None for p in trees) > 100
    if lengths:
        whole = max(lengths)
        assert whole >= 2 and lengths.count(whole) > 100 and sum(n < whole for n in lengths) > 100
        assert drafter != "eagle-tree-confident" or lengths.count(0) > 100  # and trees to nothing
    exact = exact_sequence_probs(model, SAMPLED)
    assert chi2_pvalue(samples, exact) > 1e-3
    for position in range(LENGTH):
        assert marginal_tv(samples, exact, position) < 0.05


@pytest.mark.parametrize("rule", [accept_all, recover_from_target])
@pytest.mark.parametrize(("target", "drafter"), [
    *(pytest.param(EVERY_DRAFTER_ON, d, id=f"{EVERY_DRAFTER_ON}-{d}") for d in ("draft_model", "ngram", "eagle")),
    pytest.param("hf", "draft_model", id="hf-draft_model")], indirect=["target"])
def test_wrong_rules_fail_the_same_test(
    target: LoadedModel, draft: LoadedModel, drafter: str, rule, monkeypatch: pytest.MonkeyPatch
) -> None:
    instances = {"draft_model": lambda: DraftModelDrafter(draft), "ngram": lambda: NgramDrafter(1, 3),
                 "eagle": lambda: EagleDrafter(eagle_head(target))}
    instance = instances[drafter]()
    # The untrained head's drafts are rejected mostly where the target is near certain, so the
    # subtly wrong rule shows less per sample there: more samples.
    samples = sample_sequences(engine_with_rule(target, instance, rule, monkeypatch), SAMPLED,
                               2400 if drafter == "eagle" else 800)
    exact = exact_sequence_probs(target, SAMPLED)
    assert chi2_pvalue(samples, exact) < 1e-6


@SAMPLING_LOGIC_ON
def test_filtered_sampling_follows_filtered_target_in_both_modes(target: LoadedModel, draft: LoadedModel) -> None:
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.02, max_tokens=4, ignore_eos=True)
    exact = exact_sequence_probs(target, params)
    unfiltered = exact_sequence_probs(target, SAMPLED)
    assert (exact == 0).sum() > (unfiltered == 0).sum()  # the filters do remove tokens here
    for engine, n in ((Engine(target, DraftModelDrafter(draft), 2), 1500), (Engine(target), 800)):
        samples = sample_sequences(engine, params, n, first_seed=10_000)
        assert chi2_pvalue(samples, exact) > 1e-3  # also checks no filtered-out sequence appears


def test_self_drafting_accepts_everything(target: LoadedModel) -> None:
    # A draft distribution equal to the target's is accepted with probability one.
    engine = Engine(target, DraftModelDrafter(target), 3)
    for seed in range(20):
        stats = engine.generate(PROMPT, dataclasses.replace(SAMPLED, max_tokens=12, seed=seed)).stats
        assert stats.drafted_tokens > 0
        assert stats.acceptance_rate == 1.0


@pytest.mark.parametrize("speculate", [False, True])
def test_same_seed_same_output(target: LoadedModel, draft: LoadedModel, speculate: bool) -> None:
    engine = Engine(target, DraftModelDrafter(draft), 3) if speculate else Engine(target)
    params = dataclasses.replace(SAMPLED, max_tokens=16)
    runs = [engine.generate(PROMPT, dataclasses.replace(params, seed=seed)).token_ids for seed in (1, 2, 1, 2)]
    assert runs[0] == runs[2] and runs[1] == runs[3]
    outputs = {tuple(engine.generate(PROMPT, dataclasses.replace(params, seed=s)).token_ids) for s in range(10)}
    assert len(outputs) > 5


# --- drafter-invariant sampling ---------------------------------------------------------------

INVARIANT = dataclasses.replace(SAMPLED, drafter_invariant=True)


@pytest.mark.parametrize("drafter", ["draft_model", "ngram", "eagle", "eagle-tree", "adaptive", "resumed"])
def test_drafter_invariant_tokens_do_not_depend_on_the_drafter(target: LoadedModel, draft: LoadedModel,
                                                                drafter: str) -> None:
    # The same seed gives the same tokens as plain decoding, whatever drafts them.
    params = dataclasses.replace(INVARIANT, max_tokens=12)
    engine, plain = make_engine(drafter, target, draft), Engine(target)
    for seed in range(30):
        seeded = dataclasses.replace(params, seed=seed)
        assert engine.generate(PROMPT, seeded).token_ids == plain.generate(PROMPT, seeded).token_ids, seed


@SAMPLING_LOGIC_ON
def test_drafter_invariant_sampling_follows_target(target: LoadedModel, draft: LoadedModel) -> None:
    samples = sample_sequences(make_engine("draft_model", target, draft), INVARIANT, 2500)
    exact = exact_sequence_probs(target, SAMPLED)
    assert chi2_pvalue(samples, exact) > 1e-3
    for position in range(LENGTH):
        assert marginal_tv(samples, exact, position) < 0.05


def test_drafter_invariant_batch_rows_at_any_k(target: LoadedModel, draft: LoadedModel) -> None:
    # Rows joining at different steps, one drafting 3 tokens a step, one not drafting at all:
    # each row's tokens are its seed's plain tokens.
    params = [dataclasses.replace(INVARIANT, max_tokens=10, seed=s) for s in (7, 8, 9)]
    plain = [Engine(target).generate(PROMPT, p).token_ids for p in params]
    engine = BatchEngine(target, max_rows=3, max_model_len=32, max_draft=3)
    seqs = [engine.admit(PROMPT, params[0], DraftModelDrafter(draft), 3).sequence]
    engine.step()
    seqs.append(engine.admit(PROMPT, params[1]).sequence)
    engine.step()
    seqs.append(engine.admit(PROMPT, params[2], NgramDrafter(1, 3), 2).sequence)
    while not all(s.finished for s in seqs):
        engine.step()
    assert [s.result.token_ids for s in seqs] == plain


def test_drafter_invariant_self_draft_accepts_everything(target: LoadedModel) -> None:
    # A draft equal to the target picks the same Gumbel-max token: every draft is kept.
    engine = Engine(target, DraftModelDrafter(target), 3)
    for seed in range(10):
        stats = engine.generate(PROMPT, dataclasses.replace(INVARIANT, max_tokens=12, seed=seed)).stats
        assert stats.drafted_tokens > 0 and stats.acceptance_rate == 1.0


def test_config_drafter_invariant_applies_with_and_without_speculation(target: LoadedModel) -> None:
    from specdec import LLM

    llm = LLM(loaded=target, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                 "drafter_invariant": True})
    prompt = " ".join(f"t{t}" for t in PROMPT)
    for seed in range(5):
        params = dataclasses.replace(SAMPLED, max_tokens=12, seed=seed)  # the rule comes from the config
        assert llm.generate(prompt, params)[0].token_ids == llm.generate(prompt, params, speculate=False)[0].token_ids


class MinPMismatchDrafter(DraftModelDrafter):
    """A WRONG draft: samples from its distribution without min_p but reports the min_p-filtered
    one as the distribution it sampled from."""

    def propose(self, context, k, params, generator):
        unfiltered = dataclasses.replace(params, min_p=0.0)
        proposal = super().propose(context, k, unfiltered, generator)
        # The distributions it sampled from, min_p-filtered as logits_to_probs filters last.
        probs = proposal.probs
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        return dataclasses.replace(proposal, probs=probs / probs.sum(-1, keepdim=True))

    def fork(self) -> MinPMismatchDrafter:
        return MinPMismatchDrafter(self.runner.loaded)


@pytest.mark.parametrize("target", ["hf"], indirect=True)
def test_min_p_draft_must_report_what_it_sampled_from(target: LoadedModel, draft: LoadedModel) -> None:
    # With a strong min_p the right draft passes and the mismatched one fails the same test.
    # A high temperature flattens the distributions, so min_p leaves several tokens and removes
    # real mass from the draft's. The error is the drafter's, not the backend's: one backend.
    params = SamplingParams(temperature=3.0, min_p=0.2, max_tokens=4, ignore_eos=True)
    exact = exact_sequence_probs(target, params)
    right = sample_sequences(Engine(target, DraftModelDrafter(draft), 2), params, 1500)
    assert chi2_pvalue(right, exact) > 1e-3
    wrong = sample_sequences(Engine(target, MinPMismatchDrafter(draft), 2), params, 5000, first_seed=10_000)
    assert chi2_pvalue(wrong, exact) < 1e-5
