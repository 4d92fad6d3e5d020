"""The registry of speculative methods by name, and the options each takes: everything the config,
the CLI, `tune` and the server need to know of a drafter (its options, default k, `tune`'s grid,
whether it takes a model, its one-line help), without importing it. A method's drafter is built
by its factory, named here as `module:function` and imported only then
(:func:`build_drafter`); so `import specdec.config` loads no model code.

Adding a drafter is one module under `specdec/drafters/` (its drafter, a
:class:`~specdec.drafters.base.Drafter`, and a `build(config, target)` factory), its options
here (a frozen subclass of :class:`Options` whose `__post_init__` validates them; none: `Options`)
and one line in :data:`METHODS`. `SpeculativeConfig` holds only the keys every method shares
(method, k, model, adaptive, drafter_invariant) plus the method's options. No code outside this
module and `specdec/drafters/` names a method (a test holds to that).

The trainable heads (`train-draft`) are here too: each family's class, its one-line help and
its own training options, a frozen :class:`TrainOptions` subclass (:data:`HEADS`).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.errors import ConfigError

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig
    from specdec.drafters.base import Drafter
    from specdec.models.loader import LoadedModel

DrafterFactory = Callable[["SpeculativeConfig", "LoadedModel"], "Drafter"]

# The method a config or request gets when it names none.
DEFAULT_METHOD = "ngram"
# `tune`'s k grid for a method that gives none.
DEFAULT_TUNE_KS = (1, 2, 3, 4)
# Token trees `tune` measures for a head, (k, tree_width, tree_nodes) each.
TUNE_TREES = ((2, 2, 3), (3, 2, 4), (3, 2, 6), (4, 3, 8))
# Chains under a confidence floor `tune` measures for the EAGLE head, and for the hybrid, whose
# head then drafts up to k where lookup finds nothing: the keys each sets.
TUNE_FLOORS = tuple({"num_speculative_tokens": k, "draft_confidence": floor}
                    for k, floor in ((2, 0.2), (3, 0.2), (4, 0.15), (4, 0.3)))
HYBRID_FLOORS = tuple({"num_speculative_tokens": 4, "draft_confidence": floor, "hybrid_head_tokens": None}
                      for floor in (0.15, 0.2, 0.3))
# Chains under a floor on the draft's top probability `tune` measures for a draft model.
DRAFT_FLOORS = tuple({"num_speculative_tokens": k, "draft_p_min": floor}
                     for k, floor in ((4, 0.5), (6, 0.5), (6, 0.75)))
# What a draft model's linear layers may be quantized to.
QUANTIZATIONS = ("int8",)


def resolve(path: str) -> Any:
    """The object a `module:attribute` path names (imported now)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


# --- options ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """A drafter's own speculative-config keys (none here); subclasses add fields with defaults
    and validate them in `__post_init__`."""

    def check(self, config: SpeculativeConfig) -> None:
        """Checks that need the common keys too (k, model); raise ConfigError."""

    def label(self) -> list[str]:
        """Words for the config's short label, between the method and k."""
        return []

    def label_after_k(self) -> list[str]:
        """Words for the label after k (the shape of a tree)."""
        return []

    @property
    def proposal_nodes(self) -> int:
        """The most tokens a proposal may hold beyond k (a tree's nodes); 0: at most k."""
        return 0

    def proposal_tokens(self, k: int) -> int:
        """The most tokens a proposal of a config with this k may hold."""
        return max(k, self.proposal_nodes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class NgramOptions(Options):
    """prompt_lookup_min / prompt_lookup_max: the n-gram sizes tried, longest first."""

    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 6

    def __post_init__(self) -> None:
        require_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        require_int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max ({self.prompt_lookup_max})")


@dataclass(frozen=True)
class BigramOptions(Options):
    """bigram_min_count: how often a successor must have been seen to be drafted."""

    bigram_min_count: int = 2

    def __post_init__(self) -> None:
        require_int("bigram_min_count", self.bigram_min_count, 1)


@dataclass(frozen=True)
class SuffixOptions(Options):
    """vLLM's names: the longest suffix matched, the most tokens proposed per matched token, the
    least empirical probability of a proposal, and the route's cache of earlier outputs: at most
    so many requests and MiB (0 requests: no cache)."""

    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_cache_mib: float = 64.0
    # Propose a tree of the most probable continuations (at most k tokens) instead of one chain.
    suffix_decoding_use_tree: bool = False

    def __post_init__(self) -> None:
        require_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1)
        require_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0)
        require_number("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor, 0, math.inf, low_open=True)
        require_number("suffix_decoding_max_cache_mib", self.suffix_decoding_max_cache_mib, 0, math.inf, low_open=True)
        require_number("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob, 0, 1)

        if not isinstance(self.suffix_decoding_use_tree, bool):
            raise ConfigError(f"suffix_decoding_use_tree must be true or false, got {self.suffix_decoding_use_tree!r}")

    def label(self) -> list[str]:
        return (["tree"] if self.suffix_decoding_use_tree else []) + (
            ["no cache"] if self.suffix_decoding_max_cached_requests == 0 else [])


@dataclass(frozen=True)
class LookaheadOptions(Options):
    """lookahead_window: W, the Jacobi window's length (0: no lookahead branch, the pool fed by
    the output alone); lookahead_ngram: N, the n-gram size (guesses of N - 1 tokens);
    lookahead_guesses: G, the most pool n-grams verified per pass; lookahead_pool: the most
    n-grams kept per first token (the most recent)."""

    # Defaults: the best measured configuration with a window (docs/drafters.md, "Lookahead decoding"): at
    # most 3 nodes, so a pass stays within the rows the CPU's int4 kernel verifies at little more
    # than a plain step (`specdec costs`).
    lookahead_window: int = 1
    lookahead_ngram: int = 3
    lookahead_guesses: int = 1
    lookahead_pool: int = 8

    def __post_init__(self) -> None:
        require_int("lookahead_window", self.lookahead_window, 0)
        require_int("lookahead_ngram", self.lookahead_ngram, 2)
        require_int("lookahead_guesses", self.lookahead_guesses, 0)
        require_int("lookahead_pool", self.lookahead_pool, 1)

    def label(self) -> list[str]:
        return [f"W{self.lookahead_window} N{self.lookahead_ngram} G{self.lookahead_guesses}"]

    @property
    def proposal_nodes(self) -> int:
        """The most tokens one pass verifies beyond the root: the window and G guesses."""
        return self.lookahead_window + self.lookahead_guesses * (self.lookahead_ngram - 1)


@dataclass(frozen=True)
class LayerSkipOptions(Options):
    """layers: the target's layers (0-based) the draft runs; profile: a calibration profile file
    (`specdec calibrate`) naming them. Without either, the profile shipped for the model, else
    :func:`default_layers`."""

    layers: tuple[int, ...] | None = None
    profile: str | None = None

    def __post_init__(self) -> None:
        if self.layers is not None:
            layers = self.layers
            if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
                raise ConfigError(f"layers must be a list of layer indices, got {layers!r}")
            layers = tuple(layers)
            if not layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
                raise ConfigError(f"layers must be a non-empty list of integers >= 0, got {list(layers)!r}")
            if len(set(layers)) != len(layers):
                raise ConfigError(f"layers must not repeat a layer, got {list(layers)!r}")
            object.__setattr__(self, "layers", tuple(sorted(layers)))
            if self.profile is not None:
                raise ConfigError("give 'layers' or 'profile' for layer_skip, not both")
        if self.profile is not None and not Path(self.profile).expanduser().is_file():
            raise ConfigError(f"layer_skip profile not found: {self.profile}")

    def label(self) -> list[str]:
        if self.profile:
            return [Path(self.profile).stem]
        return [] if self.layers is None else [f"{len(self.layers)} layers"]



@dataclass(frozen=True)
class DraftModelOptions(Options):
    """quantization: `int8` quantizes the draft's linear layers (weight-only int8) in a copy that
    shares the target's embeddings; with `"model": "target"` this is the quantized self-draft.
    draft_p_min: the draft stops at the first position where its most likely token has a
    probability below this (llama.cpp's p-min), drafting nothing there; None: always k tokens.
    draft_lookup_min: prompt lookup in front of the draft model: a step whose context ends in
    n >= this tokens that occurred before drafts what followed them (free), the draft model the
    other steps; None: the draft model every step."""

    quantization: str | None = None
    draft_p_min: float | None = None
    draft_lookup_min: int | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"unknown quantization {self.quantization!r}; choose one of: {', '.join(QUANTIZATIONS)}")
        if self.draft_p_min is not None:
            require_number("draft_p_min", self.draft_p_min, 0, 1, low_open=True)
        require_int("draft_lookup_min", self.draft_lookup_min, 1, optional=True)

    def check(self, config: SpeculativeConfig) -> None:
        # No model: the target's known draft (specdec.models.catalog), looked up when the drafter
        # is built for its target, which refuses a target that has none.
        if config.model is not None and not config.model:
            raise ConfigError("method 'draft_model' needs a draft model: set 'model' in the speculative config")

    def label(self) -> list[str]:
        return [self.quantization] if self.quantization else []

    def label_after_k(self) -> list[str]:
        return ([f"p>={self.draft_p_min:g}"] if self.draft_p_min else []) + (
            [f"lookup>={self.draft_lookup_min}"] if self.draft_lookup_min else [])


@dataclass(frozen=True)
class TreeOptions(Options):
    """tree_width, tree_nodes: draft a token tree instead of a chain: the head's top `tree_width`
    tokens at each of the `tree_width` best nodes of each depth (k deep), the `tree_nodes` best
    kept (default 4 x width). 1: a chain."""

    tree_width: int = 1
    tree_nodes: int | None = None

    def __post_init__(self) -> None:
        require_int("tree_width", self.tree_width, 1)
        require_int("tree_nodes", self.tree_nodes, 1, optional=True)

    def check(self, config: SpeculativeConfig) -> None:
        if self.tree_width > 1 and self.tree_width * config.num_speculative_tokens > 64:
            raise ConfigError("a tree of tree_width x num_speculative_tokens > 64 expanded nodes is too large")

    def label_after_k(self) -> list[str]:
        return [f"tree {self.tree_width}x{self.proposal_nodes}"] if self.tree_width > 1 else []

    @property
    def proposal_nodes(self) -> int:
        """The most tokens one proposal holds beyond k (0 for a chain)."""
        return (self.tree_nodes or 4 * self.tree_width) if self.tree_width > 1 else 0


@dataclass(frozen=True)
class HeadOptions(TreeOptions):
    """A trained head's draft shape (TreeOptions) and draft_confidence: where the head's draft
    so far (a chain's tokens, or a tree node's path) has a probability under the head below this,
    the step drafts no further, or nothing at all. The head's probabilities track how often the
    target accepts, so a step drafts far where the head is sure and not at all where it is lost.
    None: always k tokens (or the whole tree)."""

    draft_confidence: float | None = None

    def __post_init__(self) -> None:
        TreeOptions.__post_init__(self)
        if self.draft_confidence is not None:
            require_number("draft_confidence", self.draft_confidence, 0, 1, low_open=True)

    def label_after_k(self) -> list[str]:
        return super().label_after_k() + ([f"conf>={self.draft_confidence:g}"] if self.draft_confidence else [])


@dataclass(frozen=True)
class HybridOptions(HeadOptions, NgramOptions):
    """Prompt lookup's n-gram sizes (here from 2 tokens by default), the most tokens the head
    drafts in a step (None: k), the head's tree shape, and whether a step where lookup proposes
    verifies the head's draft too, as a second branch of one tree (hybrid_branches)."""

    prompt_lookup_min: int = 2
    hybrid_head_tokens: int | None = 1
    hybrid_branches: bool = False

    def __post_init__(self) -> None:
        NgramOptions.__post_init__(self)
        HeadOptions.__post_init__(self)
        require_int("hybrid_head_tokens", self.hybrid_head_tokens, 1, optional=True)
        if not isinstance(self.hybrid_branches, bool):
            raise ConfigError(f"hybrid_branches must be true or false, got {self.hybrid_branches!r}")

    def label_after_k(self) -> list[str]:
        return ([f"head k={self.hybrid_head_tokens or 'k'}"] if self.hybrid_head_tokens != 1 else []) + (
            [f"lookup>={self.prompt_lookup_min}"] if self.prompt_lookup_min != 2 else []) + (
            ["branches"] if self.hybrid_branches else []) + super().label_after_k()

    def proposal_tokens(self, k: int) -> int:
        if not self.hybrid_branches:
            return super().proposal_tokens(k)
        head = self.proposal_nodes or min(k, self.hybrid_head_tokens or k)
        return k + head  # lookup's chain and the head's draft beside it


# --- the methods --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """A registered drafter. `takes_model`: the config's `model` names what drafts (a label shows
    it); `tune_ks`: the k `tune` measures; `tune_trees`: the token trees `tune` measures beside
    them, (k, tree_width, tree_nodes) each; `tuned`: the config (beyond the method) `tune`
    measures when no methods are named, or None to measure it only when named; `head`: the family
    of trained head the method needs (`tune` includes it when such a head ships for the target);
    `tune_floors`: the chains under a confidence floor `tune` measures, each the keys it sets."""

    name: str
    factory: str  # "module:function", a DrafterFactory, imported when a drafter is built
    options: type[Options]
    default_k: int
    summary: str = ""
    takes_model: bool = False
    tune_ks: tuple[int, ...] = DEFAULT_TUNE_KS
    tuned: dict[str, Any] | None = None
    head: str | None = None
    tune_trees: tuple[tuple[int, int, int], ...] = ()
    tune_floors: tuple[dict[str, Any], ...] = ()
    pin: str | None = None  # "module:function": the config with what it leaves to the target made explicit
    offer: str | None = None  # "module:function": the configs of this method a target brings (target_methods)

    def build(self, config: SpeculativeConfig, target: LoadedModel) -> Drafter:
        factory: DrafterFactory = resolve(self.factory)
        return factory(config, target)

    def keys(self) -> list[str]:
        return [f.name for f in fields(self.options)]

    def make_options(self, values: dict[str, Any], common: tuple[str, ...] = ()) -> Options:
        """The options from the method's keys; a ConfigError names every unknown key (and which
        methods take it), and the keys this method knows besides the `common` ones."""
        unknown = sorted(set(values) - set(self.keys()))
        if unknown:
            owners = {key: sorted(m.name for m in METHODS.values() if key in m.keys()) for key in unknown}
            where = "".join(f"; {key!r} is a key of {', '.join(names)}" for key, names in owners.items() if names)
            known = ", ".join(sorted([*common, *self.keys()]))
            raise ConfigError(f"unknown speculative config key(s) for method {self.name!r}: {', '.join(unknown)}{where}; "
                              f"known: {known}")
        return self.options(**values)




# One line a method; the drafter's module under specdec/drafters/ defines `build`.
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ngram", "specdec.drafters.ngram:build", NgramOptions, 4,
           "prompt lookup: what followed the context's last n-gram before", tune_ks=(1, 2, 3, 4, 6), tuned={}),
    Method("suffix", "specdec.drafters.suffix:build", SuffixOptions, 6, "the request's and the route's earlier outputs",
           tune_ks=(4, 6, 8), tuned={}),
    Method("bigram", "specdec.drafters.bigram:build", BigramOptions, 3, "the request's most frequent successor of each token",
           tune_ks=(1, 2, 3, 4)),
    Method("lookahead", "specdec.drafters.lookahead:build", LookaheadOptions, 2,
           "a Jacobi window and the target's own n-grams", tune_ks=(2, 3), tuned={}),
    Method("draft_model", "specdec.drafters.draft_model:build", DraftModelOptions, 4,
           "a smaller model with the target's tokenizer, or the target itself quantized", takes_model=True,
           tuned={"model": "target", "quantization": "int8"}, pin="specdec.drafters.draft_model:pinned",
           offer="specdec.drafters.draft_model:offered", tune_floors=DRAFT_FLOORS),
    Method("layer_skip", "specdec.drafters.layer_skip:build", LayerSkipOptions, 1,
           "the target with some of its layers skipped", tuned={}, pin="specdec.drafters.layer_skip:pinned"),
    Method("eagle", "specdec.drafters.eagle:build", HeadOptions, 1, "a head trained on the target's states",
           takes_model=True, tune_ks=(2, 3, 4, 5, 6), head="eagle", tune_trees=TUNE_TREES,
           tune_floors=TUNE_FLOORS),
    Method("hybrid", "specdec.drafters.hybrid:build", HybridOptions, 4, "prompt lookup, else the EAGLE head",
           takes_model=True, tune_ks=(2, 3, 4, 5, 6), head="eagle", tune_trees=TUNE_TREES, tune_floors=HYBRID_FLOORS),
    Method("medusa", "specdec.drafters.medusa:build", TreeOptions, 3, "heads on the target's last state, one per position",
           takes_model=True, tune_ks=(1, 2, 3), head="medusa", tune_trees=((2, 2, 4), (3, 2, 6), (3, 3, 8))),
    Method("mtp", "specdec.drafters.mtp:build", TreeOptions, 1, "a checkpoint's multi-token-prediction layer",
           takes_model=True),
)}


def registered_methods() -> list[str]:
    return sorted(METHODS)


def methods() -> list[Method]:
    """Every registered method, by name."""
    return [METHODS[name] for name in sorted(METHODS)]


def method(name: str) -> Method:
    """The registry entry of a method; ConfigError naming the known ones if there is none."""
    if name not in METHODS:
        raise ConfigError(f"unknown speculative method {name!r}; choose one of: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def default_k(name: str) -> int:
    return method(name).default_k


def build_drafter(config: SpeculativeConfig, target: LoadedModel) -> Drafter:
    """The drafter a config names, for this target (its module imported now)."""
    return method(config.method).build(config, target)


def target_methods(target: LoadedModel) -> list[dict[str, Any]]:
    """The configs a target brings of its own, which `tune` measures by default (draft_model
    with the target's known draft, for a catalog target that has one): each method's `offer`."""
    return [config for m in methods() if m.offer is not None for config in resolve(m.offer)(target)]


def pinned(config: SpeculativeConfig, target: LoadedModel) -> SpeculativeConfig:
    """The config with whatever it leaves to the target (a shipped profile) made explicit, so
    that a recommendation names what was measured; unchanged for most methods."""
    pin = method(config.method).pin
    return resolve(pin)(config, target) if pin is not None else config


# --- heads that `train-draft` trains -------------------------------------------------------------


@dataclass(frozen=True)
class TrainOptions:
    """A head family's own `train-draft` options (none here); each family subclasses it with
    fields that have defaults, validated in `__post_init__`. A field's name is its CLI flag
    (`ttt_steps`: `--ttt-steps`), unique across families, so that a flag names its family."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class EagleTrainOptions(TrainOptions):
    """ttt_steps: the draft depths training unrolls (training-time test): the head learns to
    draft from its own output state this many tokens deep, and a step trains that many positions."""

    ttt_steps: int = 3

    def __post_init__(self) -> None:
        require_int("ttt_steps", self.ttt_steps, 1)


@dataclass(frozen=True)
class MedusaTrainOptions(TrainOptions):
    """medusa_heads: how many heads a fresh Medusa head has (tokens drafted per step); a head
    trained further (--init) keeps its own count."""

    medusa_heads: int = 3

    def __post_init__(self) -> None:
        require_int("medusa_heads", self.medusa_heads, 1)


@dataclass(frozen=True)
class HeadFamily:
    """A trainable head: its class (a :class:`~specdec.drafters.head_parts.TrainableHead`, named
    as "module:Class" and imported when asked for), its one-line help, and its own `train-draft`
    options (a :class:`TrainOptions` subclass), which reach only its head."""

    name: str
    head: str
    summary: str
    options: type[TrainOptions] = TrainOptions

    def head_class(self) -> type:
        return resolve(self.head)

    def keys(self) -> list[str]:
        return [f.name for f in fields(self.options)]

    def make_options(self, values: dict[str, Any]) -> TrainOptions:
        """The family's options from the keys given (the rest at their defaults); a ConfigError
        names a key of another family (this one would not read it) or of none."""
        for key in sorted(set(values) - set(self.keys())):
            owners = [h.name for h in HEADS.values() if key in h.keys()]
            own = ", ".join(self.keys()) or "none"
            if owners:
                raise ConfigError(f"{key} is an option of {', '.join(owners)} heads; a {self.name} head does not "
                                  f"read it ({self.name}'s: {own})")
            raise ConfigError(f"unknown training option {key!r} for {self.name} heads ({self.name}'s: {own})")
        return self.options(**values)


# The head family train-draft trains when none is named.
DEFAULT_HEAD = "eagle"
HEADS: dict[str, HeadFamily] = {h.name: h for h in (
    HeadFamily("eagle", "specdec.drafters.eagle:EagleHead", "one decoder layer on three of the target's layers",
               EagleTrainOptions),
    HeadFamily("medusa", "specdec.drafters.medusa:MedusaHeads", "residual heads on the target's last state",
               MedusaTrainOptions),
)}


def trainable_heads() -> list[str]:
    return sorted(HEADS)


def head_family(name: str) -> HeadFamily:
    """A trainable head family; ConfigError naming the trainable ones if there is none."""
    if name not in HEADS:
        raise ConfigError(f"unknown head architecture {name!r}; train-draft trains: {', '.join(sorted(HEADS))}")
    return HEADS[name]


def head_class(name: str) -> type:
    """The head class of a family (its module imported now)."""
    return head_family(name).head_class()


def train_option_keys() -> list[str]:
    """Every family's own `train-draft` option keys."""
    return sorted(key for family in HEADS.values() for key in family.keys())


# --- validation helpers for options ---------------------------------------------------------


def require_int(name: str, value: Any, low: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")


def require_number(name: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    """A finite number in [low, high] ((low, high] when low_open)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bounds = f"{'>' if low_open else '>='} {low}" if high == math.inf else f"in {'(' if low_open else '['}{low}, {high}]"
        raise ConfigError(f"{name} must be a number {bounds}, got {value!r}")
