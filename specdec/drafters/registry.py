"""The registry of drafters by method name: each entry is the method's factory and everything the
rest of specdec needs to know about it (options, default k, `tune`'s grid, whether it takes a
model, its one-line help).

Adding a drafter is one module, its import in `specdec/drafters/__init__.py`, and its tests. The
module defines its drafter (a :class:`~specdec.drafters.base.Drafter`), its options (a frozen
subclass of :class:`Options` whose `__post_init__` validates them) and registers its factory::

    @register("ngram", options=NgramOptions, default_k=4, summary="prompt lookup: ...",
              tune_ks=(1, 2, 3, 4, 6), tuned={})
    def build(config: SpeculativeConfig, target: LoadedModel) -> Drafter: ...

`SpeculativeConfig` holds only the keys every method shares (method, k, model, adaptive,
drafter_invariant) plus the method's options. Dependencies point one way: the config imports the
drafters (and so this registry); drafter modules name the config in type annotations only.
No code outside `specdec/drafters/` names a method (a test holds to that).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from specdec.errors import ConfigError

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig
    from specdec.drafters.base import Drafter
    from specdec.models.loader import LoadedModel

DrafterFactory = Callable[["SpeculativeConfig", "LoadedModel"], "Drafter"]


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

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def pinned(self, config: SpeculativeConfig, target: LoadedModel) -> SpeculativeConfig:
        """The config with whatever it leaves to the target (a shipped profile) made explicit,
        so that a recommendation names what was measured; unchanged by default."""
        return config


# The method a config or request gets when it names none.
DEFAULT_METHOD = "ngram"
# `tune`'s k grid for a method that gives none.
DEFAULT_TUNE_KS = (1, 2, 3, 4)


@dataclass(frozen=True)
class Method:
    """A registered drafter. `takes_model`: the config's `model` names what drafts (a label shows
    it); `tune_ks`: the k `tune` measures; `tune_trees`: the token trees `tune` measures beside
    them, (k, tree_width, tree_nodes) each; `tuned`: the config (beyond the method) `tune`
    measures when no methods are named, or None to measure it only when named; `head`: the family
    of trained head the method needs (`tune` includes it when such a head ships for the target)."""

    name: str
    build: DrafterFactory
    options: type[Options]
    default_k: int
    summary: str = ""
    takes_model: bool = False
    tune_ks: tuple[int, ...] = DEFAULT_TUNE_KS
    tuned: dict[str, Any] | None = None
    head: str | None = None
    tune_trees: tuple[tuple[int, int, int], ...] = ()

    def keys(self) -> list[str]:
        return [f.name for f in fields(self.options)]

    def make_options(self, values: dict[str, Any], common: tuple[str, ...] = ()) -> Options:
        """The options from the method's keys; a ConfigError names every unknown key (and which
        methods take it), and the keys this method knows besides the `common` ones."""
        unknown = sorted(set(values) - set(self.keys()))
        if unknown:
            owners = {key: sorted(m.name for m in _REGISTRY.values() if key in m.keys()) for key in unknown}
            where = "".join(f"; {key!r} is a key of {', '.join(names)}" for key, names in owners.items() if names)
            known = ", ".join(sorted([*common, *self.keys()]))
            raise ConfigError(f"unknown speculative config key(s) for method {self.name!r}: {', '.join(unknown)}{where}; "
                              f"known: {known}")
        return self.options(**values)


_REGISTRY: dict[str, Method] = {}


def register(name: str, *, options: type[Options] = Options, default_k: int = 4, summary: str = "",
             takes_model: bool = False, tune_ks: tuple[int, ...] = DEFAULT_TUNE_KS, tuned: dict[str, Any] | None = None,
             head: str | None = None, tune_trees: tuple[tuple[int, int, int], ...] = ()
             ) -> Callable[[DrafterFactory], DrafterFactory]:
    """Register a drafter factory under a method name, with what the rest of specdec reads of it
    (see :class:`Method`)."""

    def wrap(factory: DrafterFactory) -> DrafterFactory:
        if name in _REGISTRY:
            raise ValueError(f"drafter {name!r} is already registered")
        _REGISTRY[name] = Method(name, factory, options, default_k, summary, takes_model, tuple(tune_ks), tuned, head,
                                 tuple(tune_trees))
        return factory

    return wrap


def registered_methods() -> list[str]:
    return sorted(_REGISTRY)


# --- heads that `train-draft` trains -------------------------------------------------------

# The head family train-draft trains when none is named.
DEFAULT_HEAD = "eagle"
_HEADS: dict[str, type] = {}


def register_head(name: str) -> Callable[[type], type]:
    """Register a trainable head class (an `nn.Module`) under its family's name. The class gives
    `summary` (one line), `fresh(target, d2t_ids, heads=, seed=)` (a new head), `load(directory,
    target)`, `save(directory)`, `draft_ids`, `view_layers(target)` (the target layers it reads),
    `draft_positions(depth)` (how many draft positions it trains) and `draft_states(features,
    tokens, depth, begin)` over a batch [batch, n, ...] whose positions from begin [batch] on are
    counted: the offsets [batch] of the states' windows (column c is position offset + c), and
    per draft position the states, the shift s of the target row position t's state predicts,
    t + s, the first position where they mean something, and the function that turns states
    into draft logits."""

    def wrap(cls: type) -> type:
        if name in _HEADS:
            raise ValueError(f"head {name!r} is already registered")
        _HEADS[name] = cls
        return cls

    return wrap


def trainable_heads() -> list[str]:
    return sorted(_HEADS)


def head_class(name: str) -> type:
    """The head class of a family; ConfigError naming the trainable ones if there is none."""
    if name not in _HEADS:
        raise ConfigError(f"unknown head architecture {name!r}; train-draft trains: {', '.join(sorted(_HEADS))}")
    return _HEADS[name]


def methods() -> list[Method]:
    """Every registered method, by name."""
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def method(name: str) -> Method:
    """The registry entry of a method; ConfigError naming the known ones if there is none."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown speculative method {name!r}; choose one of: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def default_k(name: str) -> int:
    return method(name).default_k


def build_drafter(config: SpeculativeConfig, target: LoadedModel) -> Drafter:
    return method(config.method).build(config, target)


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
