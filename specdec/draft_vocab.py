"""A vocabulary-pruned draft head: the draft scores only the N most frequent tokens.

The draft's lm_head is its costliest matrix (152k rows for the Qwen2.5 vocabulary, more than a
quarter of the 0.5B draft's bytes read per step), yet almost every token a model writes comes from
a small part of its vocabulary. A frequency table (`FrequencyTable`, one JSON file: token ids,
most frequent first, built by ``python -m specdec.evals.draft_vocab.build_table``) names which rows
to keep; the draft's head is replaced by those rows, gathered once at start-up
(`specdec.engine.models.decoder.DecoderLM.with_output_rows`), so each draft step reads N rows.

Why the output stays exact: `embed_logits` puts the kept rows' logits back at their token ids and
``-inf`` everywhere else, and the draft's distribution q is then warped by the same rules as the
target's (penalties, temperature, top-k, top-p, min-p: `specdec.engine.sampling`). q is therefore
a full-vocabulary distribution with ``q(y) = 0`` for every pruned token: such a token is never
drafted (the argmax, the exponential race and the kernels all pick among positive entries), the
rejection rule ``accept x w.p. min(1, p(x)/q(x))``, residual ``max(0, p - q)`` covers the whole
vocabulary (a pruned token keeps its full target mass ``p(y)`` there), and the coupling used for
greedy and seeded requests commits the target's own pick whatever the draft proposed. Pruning
changes acceptance, never the output.

Tokens the model must be able to end or structure a turn with (every added token of the
tokenizer: ``<|im_end|>``, ``<|endoftext|>``, the chat template's control tokens, and the model's
end-of-sequence ids) must be among the kept rows; a table that lacks them is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.engine.errors import ConfigError

logger = logging.getLogger(__name__)

TABLE_FORMAT = "specdec-draft-vocab/1"
# The table shipped for the Qwen2.5 tokenizer (the default pair's), and the draft vocabulary size
# an unset --draft-vocab-size gives where that table fits the draft's tokenizer
# (measured: docs/results/draft_vocab/).
SHIPPED_TABLE = Path(__file__).parent / "vocab_tables" / "qwen2.5.json"
AUTO_DRAFT_VOCAB_SIZE = 65536


@dataclass(frozen=True)
class FrequencyTable:
    """Token ids ranked most frequent first, for one vocabulary.

    ``ranked_ids`` lists the tokens the table's corpus holds (special tokens first); the N kept
    rows are its first N entries, and where N exceeds its length the lowest unlisted ids follow
    (byte-pair vocabularies number their merges roughly in order of frequency).
    """

    ranked_ids: tuple[int, ...]
    vocab_size: int
    # `tokenizer_fingerprint` of the tokenizer it was built for; None for a vocabulary without a
    # tokenizer (test models)
    tokenizer_sha256: str | None
    source: dict
    path: str = ""

    def to_json(self) -> dict:
        return {
            "format": TABLE_FORMAT,
            "vocab_size": self.vocab_size,
            "tokenizer_sha256": self.tokenizer_sha256,
            "source": self.source,
            "ranked_ids": list(self.ranked_ids),
        }

    def write(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), separators=(",", ":")) + "\n")

    def kept_ids(self, n: int) -> torch.Tensor:  # [n] int64, ascending
        """The ids of the first ``n`` ranks (unlisted ids in id order past the table's end)."""
        if not 1 <= n <= self.vocab_size:
            raise ConfigError(
                f"draft_vocab_size must lie in [1, {self.vocab_size}] (the draft's vocabulary) "
                f"or be 0 for the full vocabulary, got {n}"
            )
        ids = list(self.ranked_ids[:n])
        if len(ids) < n:
            listed = set(ids)
            rest = (i for i in range(self.vocab_size) if i not in listed)
            ids.extend(next(rest) for _ in range(n - len(ids)))
        return torch.tensor(sorted(ids), dtype=torch.int64)


def load_table(path: str | Path) -> FrequencyTable:
    """Read and check a table file; a `ConfigError` naming the file for anything malformed."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read draft vocabulary table {path}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT:
        raise ConfigError(f"{path} is not a draft vocabulary table (format {TABLE_FORMAT!r})")
    vocab = data.get("vocab_size")
    ranked = data.get("ranked_ids")
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"{path}: vocab_size must be a positive integer, got {vocab!r}")
    if not isinstance(ranked, list) or not all(
        isinstance(i, int) and 0 <= i < vocab for i in ranked
    ):
        raise ConfigError(f"{path}: ranked_ids must be a list of token ids in [0, {vocab})")
    if len(set(ranked)) != len(ranked):
        raise ConfigError(f"{path}: ranked_ids lists a token twice")
    sha = data.get("tokenizer_sha256")
    return FrequencyTable(tuple(ranked), vocab, sha, dict(data.get("source") or {}), str(path))


def rank_tokens(
    corpora: Sequence[Iterable[int]], special_ids: Iterable[int], vocab_size: int
) -> list[int]:
    """Special ids (ascending), then every token of the corpora: the first corpus's tokens by
    count (ties by lower id), then tokens only a later corpus holds, by their count there."""
    ranked = sorted(set(special_ids))
    seen = set(ranked)
    for corpus in corpora:
        counts: dict[int, int] = {}
        for t in corpus:
            if not 0 <= t < vocab_size:
                raise ValueError(f"token id {t} outside the vocabulary [0, {vocab_size})")
            counts[t] = counts.get(t, 0) + 1
        for t in sorted(counts, key=lambda t: (-counts[t], t)):
            if t not in seen:
                ranked.append(t)
                seen.add(t)
    return ranked


def special_token_ids(tokenizer, eos_token_ids: Iterable[int]) -> set[int]:
    """Ids a draft must always be able to propose: every added token of the tokenizer (turn and
    tool-call markers, end of text) and the model's end-of-sequence ids."""
    ids = set(eos_token_ids)
    if tokenizer is not None:
        ids |= set(tokenizer.hf_tokenizer.added_tokens_decoder)
        ids |= set(tokenizer.eos_token_ids)
    return ids


# Every this-many-th id enters the tokenizer fingerprint (reading the whole 152k-entry map
# through the tokenizer library takes seconds).
_FINGERPRINT_STRIDE = 1009


def tokenizer_fingerprint(tokenizer) -> str | None:
    """sha256 of a sample of the tokenizer's id -> token map: its size, every
    `_FINGERPRINT_STRIDE`-th id and every added token (None without a tokenizer)."""
    if tokenizer is None:
        return None
    hf = tokenizer.hf_tokenizer
    ids = list(range(0, len(hf), _FINGERPRINT_STRIDE))
    sample = [len(hf), hf.convert_ids_to_tokens(ids)]
    sample.append(sorted((i, t.content) for i, t in hf.added_tokens_decoder.items()))
    return hashlib.sha256(json.dumps(sample, ensure_ascii=False).encode()).hexdigest()


def resolve_draft_vocab(
    size: int | None,
    table_path: str | None,
    vocab_size: int,
    tokenizer,
    eos_token_ids: Iterable[int],
) -> torch.Tensor | None:
    """The token ids the draft's head keeps ([n] int64, ascending), or None for all of them.

    ``size`` None (unset) keeps `AUTO_DRAFT_VOCAB_SIZE` rows of the table where it fits this
    vocabulary and tokenizer, else the full vocabulary; 0 keeps the full vocabulary; any other
    value must fit, or a `ConfigError` says why.
    """
    if size == 0:
        return None
    if size is not None and not 1 <= size <= vocab_size:
        raise ConfigError(
            f"draft_vocab_size must lie in [1, {vocab_size}] (the draft's vocabulary) or be 0 for "
            f"the full vocabulary, got {size}"
        )
    if size == vocab_size:
        return None
    table = load_table(table_path or SHIPPED_TABLE)
    special = special_token_ids(tokenizer, eos_token_ids)
    fingerprint = tokenizer_fingerprint(tokenizer)
    mismatch = _mismatch(table, vocab_size, fingerprint, auto=size is None)
    if mismatch:
        if size is None:
            logger.info("draft vocabulary: full (%s)", mismatch)
            return None
        raise ConfigError(f"draft vocabulary table {table.path}: {mismatch}")
    n = size if size is not None else min(AUTO_DRAFT_VOCAB_SIZE, vocab_size)
    missing = sorted(special - set(table.ranked_ids))
    if missing:
        raise ConfigError(
            f"draft vocabulary table {table.path} lacks special tokens {missing[:8]}: a draft "
            f"that cannot propose them cannot end a turn; rebuild the table with "
            f"`python -m specdec.evals.draft_vocab.build_table`"
        )
    ids = table.kept_ids(n)
    missing = sorted(special - set(ids.tolist()))
    if missing:
        raise ConfigError(
            f"draft_vocab_size {n} leaves out special tokens {missing[:8]} of table "
            f"{table.path}; it must keep at least the {len(special)} special tokens"
        )
    logger.info("draft vocabulary: %d of %d tokens (table %s)", n, vocab_size, table.path)
    return ids


def _mismatch(
    table: FrequencyTable, vocab_size: int, fingerprint: str | None, auto: bool
) -> str | None:
    """Why ``table`` does not fit the draft's vocabulary, or None when it does."""
    if table.vocab_size != vocab_size:
        return f"the table is for a vocabulary of {table.vocab_size}, the draft has {vocab_size}"
    if table.tokenizer_sha256 is None or (fingerprint is None and not auto):
        return None
    if fingerprint != table.tokenizer_sha256:
        return "the table was built for another tokenizer"
    return None


def embed_logits(
    logits: torch.Tensor,  # [rows, n] logits of the kept tokens, in `ids` order
    ids: torch.Tensor,  # [n] int64 token ids of the kept rows
    vocab_size: int,
) -> torch.Tensor:  # [rows, vocab_size]: the kept logits at their ids, -inf elsewhere
    """Full-vocabulary logits from a pruned head's: every later rule (penalties, warps, argmax,
    softmax) then gives the pruned tokens probability exactly 0."""
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    return full.index_copy_(1, ids.to(logits.device), logits)


def vocabulary_logits(
    kept: torch.Tensor | None, logits: torch.Tensor, vocab_size: int
) -> torch.Tensor:  # [rows, vocab_size]
    """``logits`` over the whole vocabulary: a pruned head's (rows for the token ids ``kept``) put
    back at their ids (`embed_logits`), a full head's (``kept`` None) returned as they are."""
    return logits if kept is None else embed_logits(logits, kept, vocab_size)
