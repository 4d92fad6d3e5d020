"""Memory accounting at start-up: what the weights take, what a cached token costs, and how
many sequences of max_model_len tokens the KV cache budget holds, with and without the draft.

A draft's weights (what it adds to the target's) are taken from the cache budget, and
every sequence then also needs the draft's own KV cache; `sequences_lost_to_draft` says how many
concurrent sequences that costs. A prefix cache given a size is taken from the budget too, before
the sequences; without one it gets what the sequences leave (:meth:`MemoryPlan.left_after`).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import asdict, dataclass
from typing import Any

from specdec.drafters.base import Drafter
from specdec.models.loader import LoadedModel


@dataclass(frozen=True)
class MemoryPlan:
    target_weight_bytes: int
    draft_weight_bytes: int  # what drafters add to the target's weights (0: none, or shared)
    target_kv_bytes_per_token: int
    draft_kv_bytes_per_token: int  # 0 without a draft model
    max_model_len: int
    cache_budget_bytes: int
    target_format: str = ""  # backend and weight format, e.g. "native int4 (LM head int8)"
    prefix_cache_bytes: int = 0  # set aside for the prefix cache before the sequences

    @property
    def bytes_per_sequence(self) -> int:
        return self.max_model_len * (self.target_kv_bytes_per_token + self.draft_kv_bytes_per_token)

    @property
    def max_sequences(self) -> int:
        """Sequences of max_model_len tokens that fit the budget once the draft is paid for."""
        return max(0, self.cache_budget_bytes - self.draft_weight_bytes - self.prefix_cache_bytes) // self.bytes_per_sequence

    @property
    def max_sequences_without_draft(self) -> int:
        return max(0, self.cache_budget_bytes - self.prefix_cache_bytes) // (self.max_model_len * self.target_kv_bytes_per_token)

    def left_after(self, sequences: int) -> int:
        """Budget bytes that the draft's weights, the prefix cache's share and `sequences` rows leave."""
        return max(0, self.cache_budget_bytes - self.draft_weight_bytes - self.prefix_cache_bytes
                   - sequences * self.bytes_per_sequence)

    @property
    def sequences_lost_to_draft(self) -> int:
        return self.max_sequences_without_draft - self.max_sequences

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "bytes_per_sequence": self.bytes_per_sequence,
            "max_sequences": self.max_sequences,
            "max_sequences_without_draft": self.max_sequences_without_draft,
            "sequences_lost_to_draft": self.sequences_lost_to_draft,
        }

    def describe(self) -> str:
        mib = 1 << 20
        text = (
            f"target weights {self.target_weight_bytes / mib:.1f} MiB ({self.target_format}); KV {self.target_kv_bytes_per_token} B/token; "
            f"cache budget {self.cache_budget_bytes / mib:.0f} MiB holds {self.max_sequences_without_draft} sequences "
            f"of {self.max_model_len} tokens"
        )
        if self.prefix_cache_bytes:
            text += f" besides {self.prefix_cache_bytes / mib:.0f} MiB for the prefix cache"
        if self.draft_weight_bytes or self.draft_kv_bytes_per_token:
            text += (
                f"; the draft takes {self.draft_weight_bytes / mib:.1f} MiB of weights and {self.draft_kv_bytes_per_token} "
                f"B/token of KV from it: {self.max_sequences} sequences ({self.sequences_lost_to_draft} fewer)"
            )
        return text


def plan_memory(target: LoadedModel, drafters: list[Drafter], max_model_len: int, cache_budget_bytes: int,
                prefix_cache_bytes: int = 0) -> MemoryPlan:
    """The memory plan for a target and its routes' drafters. A drafter's weights are what it
    adds to the target's (`added_memory_bytes`: 0 for the target drafting for itself or for
    layer_skip, the int8 copy for the quantized self-draft); a drafter that runs a model also
    needs KV per token for the layers it runs. Each draft model is counted once."""
    seen: set[tuple[int, tuple[int, ...] | None]] = set()
    weights = kv = 0
    for drafter in drafters:
        runner = drafter.model_runner()
        if runner is None:
            continue  # no model, no KV (ngram)
        loaded, layers = runner.loaded, runner.layers
        key = (id(loaded.backend), layers)
        if key in seen:
            continue
        seen.add(key)
        weights += drafter.added_memory_bytes
        kv += loaded.backend.kv_bytes_per_token(layers)
    return MemoryPlan(target.weight_bytes(), weights, target.backend.kv_bytes_per_token(), kv, max_model_len,
                      cache_budget_bytes, target.describe(), prefix_cache_bytes)


def resident_bytes() -> int:
    """This process's resident memory now (RSS, from /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


_libc = None


def release_free_memory() -> bool:
    """Hand the C allocator's free pages back to the system (glibc's malloc_trim). Requests of
    different lengths leave holes between long-lived blocks (the prefix cache's) that glibc keeps
    for itself; without this the server's resident memory grows past its plan while what it holds
    does not. False where there is no glibc."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    return bool(_libc) and bool(_libc.malloc_trim(0))
