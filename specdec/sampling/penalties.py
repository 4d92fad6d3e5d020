"""Logit bias and repetition penalties: what a request changes in the target's logits from the
tokens before each position.

A verification pass scores several positions at once, each after a different history: position j
of a chain comes after the committed tokens and the draft's first j tokens, a tree node's after
its ancestors. The adjustment at every position reads exactly that history, so the distribution
verified there is the one plain decoding would have sampled from at the same point, and the
acceptance rule keeps the output the target's (greedy: token-identical to plain decoding).

The adjustments, in this order (as vLLM applies them; OpenAI defines the first three):

- `logit_bias`: a constant added to the logits of the given token ids;
- `repetition_penalty` r (the CTRL paper's; HF's): a logit of a token that appeared in the
  prompt or the output so far is divided by r when positive, multiplied by r when not;
- `frequency_penalty`: minus the penalty times how often the token appeared in the output so far;
- `presence_penalty`: minus the penalty once if it appeared in the output at all.

Every step is an elementwise IEEE operation on one logit with integer counts, so a position's
adjusted logits are bitwise the same whether it is verified alone or among others.
"""

from __future__ import annotations

import torch

from specdec.errors import ConfigError
from specdec.sampling.params import SamplingParams


class History:
    """The token counts a request's penalties read: the prompt's tokens (for the repetition
    penalty) and the output's, kept up to date as tokens are committed.

    vocab: the target's vocabulary size (its logits' last dimension).
    """

    def __init__(self, params: SamplingParams, vocab: int, prompt_ids: list[int]) -> None:
        self.params = params
        self.vocab = vocab
        self.output = torch.zeros(vocab, dtype=torch.float32)  # times each token was generated
        self.seen = torch.zeros(vocab, dtype=torch.bool)  # in the prompt or the output
        self.seen[torch.tensor(prompt_ids, dtype=torch.long)] = True
        bias = params.logit_bias
        self.bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.long)
        self.bias_values = torch.tensor([b for _, b in bias], dtype=torch.float32)
        if bias and int(self.bias_ids.max()) >= vocab:
            raise ConfigError(f"logit_bias token id {int(self.bias_ids.max())} is outside the vocabulary (0..{vocab - 1})")

    def add(self, tokens: list[int]) -> None:
        """Committed output tokens."""
        if tokens:
            ids = torch.tensor(tokens, dtype=torch.long)
            self.output.index_add_(0, ids, torch.ones(len(tokens)))
            self.seen[ids] = True

    def adjust(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """logits: [n, vocab], the target's at n positions; paths[j]: the uncommitted tokens
        (drafts) between the committed output and position j. Returns new float32 logits."""
        params = self.params
        n = logits.shape[0]
        if len(paths) != n:
            raise ValueError(f"need one path per position: {n} positions, {len(paths)} paths")
        out = logits.float().clone()
        if params.logit_bias:
            out[:, self.bias_ids] += self.bias_values
        penalized = params.repetition_penalty != 1 or params.frequency_penalty != 0 or params.presence_penalty != 0
        if not penalized:
            return out
        counts = self.output.expand(n, -1).clone()  # [n, vocab]
        for j, path in enumerate(paths):
            if path:
                counts[j].index_add_(0, torch.tensor(path, dtype=torch.long), torch.ones(len(path)))
        if params.repetition_penalty != 1:
            seen = self.seen[None] | (counts > 0)
            r = params.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
        if params.frequency_penalty != 0:
            out = out - params.frequency_penalty * counts
        if params.presence_penalty != 0:
            out = out - params.presence_penalty * (counts > 0).float()
        return out


def chain_paths(draft: list[int]) -> list[list[int]]:
    """The histories of a chain's positions: after the fed token, then after each drafted token."""
    return [draft[:j] for j in range(len(draft) + 1)]


def tree_paths(tokens: tuple[int, ...], parents: tuple[int, ...]) -> list[list[int]]:
    """The histories of a tree's positions: after the fed token, then after each node (the node
    and its ancestors, root first)."""
    paths: list[list[int]] = [[]]
    for node, parent in enumerate(parents):
        paths.append((paths[1 + parent] if parent >= 0 else []) + [tokens[node]])
    return paths
