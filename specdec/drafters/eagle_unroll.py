"""Training-time test for an EAGLE head (EAGLE-3's): the head unrolled several draft steps over
whole sequences at once, each depth attending to the target's states and to the head's own
earlier depths, as drafting will. `train-draft` calls it (through
:meth:`~specdec.drafters.eagle.EagleHead.draft_states`); drafting never does."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdec.drafters.eagle import EagleHead


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  visible: torch.Tensor) -> torch.Tensor:
    """Attention at depth j = len(keys) - 1 of training-time test.

    q: [..., heads, m, head_dim], the queries at m positions; keys[0], values[0]: [..., kv_heads,
    n, head_dim], depth 0's entries at every position, seen where `visible` [..., 1, m, n] is
    true (position t sees positions <= t - j); keys[i], values[i] for i >= 1: [..., kv_heads, m,
    head_dim], depth i's entries at the queries' positions, of which position t reads the one at
    t - j + i. Leading dims are a batch. Returns [..., heads, m, head_dim].
    """
    j = len(keys) - 1
    m, head_dim = q.shape[-2:]
    repeat = q.shape[-3] // keys[0].shape[-3]
    expand = lambda t: t.repeat_interleave(repeat, dim=-3)  # noqa: E731  [..., heads, ·, head_dim]
    scale = head_dim ** -0.5
    scores = [(q @ expand(keys[0]).transpose(-1, -2)).mul(scale).masked_fill(~visible, float("-inf"))]  # [..., heads, m, n]
    n = scores[0].shape[-1]
    shifted_values = []
    for i in range(1, j + 1):
        shift = j - i
        k_i, v_i = expand(keys[i]), expand(values[i])
        if shift:
            pad = k_i.new_zeros(*k_i.shape[:-2], shift, head_dim)
            k_i, v_i = torch.cat([pad, k_i[..., :-shift, :]], -2), torch.cat([pad, v_i[..., :-shift, :]], -2)
        score = (q * k_i).sum(-1, keepdim=True) * scale  # [..., heads, m, 1]
        score[..., :shift, :] = float("-inf")
        scores.append(score)
        shifted_values.append(v_i)
    weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1).to(q.dtype)  # [..., heads, m, n + j]
    out = weights[..., :n] @ expand(values[0])
    for i, v_i in enumerate(shifted_values):
        out = out + weights[..., n + i : n + i + 1] * v_i
    return out


def ttt_states(head: EagleHead, features: torch.Tensor, tokens: torch.Tensor, depth: int,
               begin: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The head unrolled `depth` draft steps over whole sequences.

    features: [batch, n, len(target_layers) * hidden], the target's states at positions 0 .. n - 1;
    tokens: [batch, n], token t + 1 for each position t (a shorter sequence padded at its end is
    exact, since no position reads a later one). begin: [batch], the first position each
    sequence needs the last depth's states at (default 0).

    Positions before begin - (depth - 1) feed nothing but depth 0's keys and values, so each
    sequence runs its layer from there on only: a window of m positions from offset[b] = begin[b]
    - (depth - 1) (at least 0). Returns the offsets and each depth's output states [batch, m,
    hidden], column c for position offset[b] + c; at depth j a column c < j means nothing (nor
    does a position < j).
    """
    batch, n = features.shape[:2]
    device = features.device
    offset = (begin - (depth - 1)).clamp(min=0) if begin is not None else torch.zeros(batch, dtype=torch.long, device=device)
    m = int((n - offset).max())
    columns = torch.arange(m, device=device)
    where = (offset[:, None] + columns[None]).clamp(max=n - 1)  # [batch, m] positions (past the end: padding)
    fused = head.fc(features)  # [batch, n, hidden]
    _, k0, v0 = head.project(fused, tokens, torch.arange(n, device=device), query=False)
    x = fused.gather(1, where[..., None].expand(-1, -1, fused.shape[-1]))  # [batch, m, hidden]
    window_tokens = tokens.gather(1, where)
    keys, values, states = [k0], [v0], []
    for j in range(depth):
        q, k, v = head.project(x, window_tokens, where, query=True)
        if j:
            keys.append(k)
            values.append(v)
        visible = (torch.arange(n, device=device)[None, None] <= (where - j)[..., None])[:, None]  # [batch, 1, m, n]
        state = head.finish(x, ttt_attention(q, keys, values, visible))  # [batch, m, hidden]
        states.append(state)
        x = torch.cat([torch.zeros_like(state[:, :1]), state[:, :-1]], dim=1)  # t reads depth j's state at t - 1
    return offset, states


def ttt_forward(head: EagleHead, features: torch.Tensor, tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Each depth's draft logits [n, draft_vocab] of :func:`ttt_states` over one whole sequence
    (features [n, ·], tokens [n])."""
    _, states = ttt_states(head, features[None], tokens[None], depth)
    return [head.logits(state[0]) for state in states]
