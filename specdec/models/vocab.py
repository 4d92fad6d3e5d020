"""Whether two models can be paired as draft and target: the same token ids for the same tokens."""

from __future__ import annotations


from specdec.errors import VocabularyMismatchError
from specdec.models.loader import LoadedModel, Vocabulary, load_vocabulary, model_file
from specdec.models.weights import gguf_logit_size


def vocabulary_differences(target: LoadedModel | Vocabulary, draft: LoadedModel | Vocabulary,
                           limit: int = 3) -> list[str]:
    """What differs between the two vocabularies, most telling first; empty when compatible."""
    problems: list[str] = []
    if target.vocab_size != draft.vocab_size:
        problems.append(f"logit sizes differ: target {target.vocab_size}, draft {draft.vocab_size}")
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft.tokenizer.get_vocab()
    if len(target_vocab) != len(draft_vocab):
        problems.append(f"tokenizer sizes differ: target {len(target_vocab)}, draft {len(draft_vocab)}")
    target_by_id = {i: t for t, i in target_vocab.items()}
    draft_by_id = {i: t for t, i in draft_vocab.items()}
    mismatched = [i for i in sorted(set(target_by_id) | set(draft_by_id)) if target_by_id.get(i) != draft_by_id.get(i)]
    if mismatched:
        examples = ", ".join(
            f"id {i}: target {target_by_id.get(i)!r} vs draft {draft_by_id.get(i)!r}" for i in mismatched[:limit]
        )
        problems.append(f"{len(mismatched)} token ids map to different tokens ({examples})")
    if target.eos_token_ids != draft.eos_token_ids:
        problems.append(f"end-of-sequence ids differ: target {sorted(target.eos_token_ids)}, draft {sorted(draft.eos_token_ids)}")
    return problems


def check_vocabulary_compatible(target: LoadedModel | Vocabulary, draft: LoadedModel | Vocabulary) -> None:
    """Raise VocabularyMismatchError naming what differs, unless draft and target match token for token."""
    problems = vocabulary_differences(target, draft)
    if problems:
        raise VocabularyMismatchError(
            f"draft model {draft.name} cannot draft for {target.name}: " + "; ".join(problems)
        )


def check_draft_vocabulary(target: LoadedModel, draft_name: str) -> None:
    """check_vocabulary_compatible for the model `draft_name` names, before its weights load: a
    GGUF file whose logit size differs is refused from its tensor table alone (converting a
    262k-token tokenizer takes tens of seconds); any other draft by its config and tokenizer."""
    path = model_file(draft_name)
    if path.is_file() and path.suffix == ".gguf":
        size = gguf_logit_size(path)
        if size != target.vocab_size:
            raise VocabularyMismatchError(f"draft model {path.name} cannot draft for {target.name}: "
                                          f"logit sizes differ: target {target.vocab_size}, draft {size}")
    check_vocabulary_compatible(target, load_vocabulary(draft_name))
