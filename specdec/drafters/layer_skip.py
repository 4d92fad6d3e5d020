"""Self-speculation: the target drafts for itself running only some of its layers.

The draft is the target's embedding, a subset of its decoder layers, and its own final norm
and LM head: no second copy of any weight. Its KV cache holds only the layers it runs, kept in
step with the committed context like any draft model's (`DraftModelDrafter`).

Which layers: a profile file written by `specdec calibrate` (measured acceptance and cost on
sample prompts), named by the config's `profile`; or an explicit `layers` list; or the
profile shipped for the model (`specdec/data/profiles/<model name>.json`); or, for a model
with neither, :func:`default_layers`.

The draft's layers are not a prefix of the target's, so the target cannot reuse the draft's
KV for its own: early exit (a prefix) would allow it, but measured on SmolLM2-135M a prefix
of 24 of 30 layers agrees with the full model on only a third of greedy tokens (docs/drafters.md,
"Self-speculation"), far too few to pay for a draft that costs most of a target step.
"""

from __future__ import annotations

import dataclasses

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.drafters.draft_model import DraftModelDrafter
from specdec.errors import ConfigError
from specdec.models.loader import LoadedModel

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig


@dataclass(frozen=True)
class LayerSkipProfile:
    """The layers a model's self-draft runs, and what calibration measured for them.

    acceptance: fraction of the target's greedy tokens the draft's greedy choice matched.
    cost_ratio: a draft step's time over a target step's.
    num_speculative_tokens: the k with the best expected speedup for that acceptance and cost.
    candidates: every layer set calibration measured, with the same fields.
    """

    model: str
    num_layers: int
    layers: tuple[int, ...]
    acceptance: float | None = None
    cost_ratio: float | None = None
    num_speculative_tokens: int | None = None
    expected_speedup: float | None = None
    calibration: dict[str, Any] = field(default_factory=dict)
    candidates: list[dict[str, Any]] = field(default_factory=list)

    def save(self, path: str | Path) -> None:
        data = asdict(self)
        data["layers"] = list(self.layers)
        Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> LayerSkipProfile:
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(**{**data, "layers": tuple(data["layers"])})
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"not a layer_skip profile: {path} ({exc})") from None


def shipped_profile(model_name: str) -> LayerSkipProfile | None:
    """The profile calibrated for a model and shipped with specdec, if there is one."""
    resource = resources.files("specdec.data").joinpath("profiles", f"{model_name}.json")
    if not resource.is_file():
        return None
    with resources.as_file(resource) as path:
        return LayerSkipProfile.load(path)


def default_layers(num_layers: int) -> tuple[int, ...]:
    """For an uncalibrated model: the first and last quarter of the layers, and every other
    layer between them. The first and last layers matter most to agreement with the full
    model (calibration on SmolLM2 keeps both and drops from the middle)."""
    edge = max(1, num_layers // 4)
    middle = range(edge, num_layers - edge)
    keep = set(range(edge)) | set(range(num_layers - edge, num_layers)) | set(middle[::2])
    return tuple(sorted(keep))


def resolve_layers(config: SpeculativeConfig, target: LoadedModel) -> tuple[int, ...]:
    """The layers a layer_skip config means for this target."""
    num_layers = target.num_layers
    if config.layers is not None:
        return config.layers
    profile = LayerSkipProfile.load(config.profile) if config.profile else shipped_profile(target.name)
    if profile is None:
        return default_layers(num_layers)
    if profile.num_layers != num_layers:
        raise ConfigError(
            f"layer_skip profile is for a {profile.num_layers}-layer model ({profile.model}); "
            f"{target.name} has {num_layers} layers"
        )
    return profile.layers


def pinned(config: SpeculativeConfig, target: LoadedModel) -> SpeculativeConfig:
    """Without layers or a profile: the layers of the profile shipped for the target
    (:func:`specdec.methods.pinned`)."""
    if config.layers is not None or config.profile is not None:
        return config
    return dataclasses.replace(config, layers=resolve_layers(config, target))


def build(config: SpeculativeConfig, target: LoadedModel) -> DraftModelDrafter:
    return DraftModelDrafter(target, resolve_layers(config, target))
