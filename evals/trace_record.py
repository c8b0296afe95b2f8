"""Record a trace set (``specdec.evals.traces``) of a target/draft pair, and the machine's cost table.

1. The target generates every request's path on a plain engine (greedy at temperature 0, sampled
   with a per-request seed at temperature 1), batched, one round per temperature. A wrapper around the engine's target runner
   keeps each sampled position's logits row until the step has drawn its token, then stores the
   target's probability of that token and its top ``TARGET_TOP`` tokens at temperature 1: the
   distributions come from the very forwards that produced the path.
2. One teacher-forced forward of the draft over prompt + path per request gives the draft's
   top-``TOP_K`` tokens at every output position given the true prefix; the target's probability
   of each is looked up among its stored top tokens (0 below them: far below any acceptance).
3. The cost table is measured on the same two engines (``specdec.evals.cost_table``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from specdec.engine.block_allocator import BlockAllocator
from specdec.engine.config import EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.loader import LoadedModel
from specdec.engine.model_runner import ModelRunner, RunEntry
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.sequence import Sequence as EngineSeq
from specdec.evals.traces import TOP_K, RequestTrace

from specdec.draft_vocab import vocabulary_logits

logger = logging.getLogger(__name__)

TARGET_TOP = 128  # target tokens kept per position, to price the draft's top tokens


class _CapturingRunner:
    """Delegates to the engine's runner; keeps the logits row of each sequence's next token."""

    def __init__(self, inner: ModelRunner) -> None:
        self.inner = inner
        self.rows: list[tuple[EngineSeq, int, torch.Tensor]] = []  # (seq, position, logits)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def run(self, entries: Sequence[RunEntry]) -> torch.Tensor:
        logits = self.inner.run(entries)
        row = 0
        for e in entries:
            if e.num_logits:
                # the last row of an entry predicts the token after its last input token
                last = row + e.num_logits - 1
                self.rows.append((e.seq, e.start_pos + len(e.token_ids), logits[last].clone()))
            row += e.num_logits
        return logits


def plain_engine(
    loaded: LoadedModel,
    kv_gib: float,
    max_num_seqs: int,
    seed: int,
    dtype: str = "float32",
    quantization: str = "none",
) -> LLMEngine:
    config = EngineConfig(
        model=str(loaded.path),
        draft_model=None,
        speculative_method="none",
        device="cpu",
        dtype=dtype,
        quantization=quantization,
        kv_cache_memory=kv_gib,
        max_num_seqs=max_num_seqs,
        controller_warmup=False,
        seed=seed,
    )
    return LLMEngine(config, target=loaded, progress=False)


@dataclass
class DraftSide:
    """The draft as a speculative engine runs it (its weight format and pruned head), behind the
    few attributes the recorder and the cost table read of a plain engine."""

    target: LoadedModel  # the draft model (named as a plain engine names its one model)
    target_runner: ModelRunner
    allocator: BlockAllocator


def draft_side(
    target: LoadedModel,
    draft: LoadedModel,
    kv_gib: float,
    seed: int,
    dtype: str,
    quantization: str,
    draft_vocab_size: int | None = None,
    draft_vocab_table: str | None = None,
) -> DraftSide:
    """The draft of a speculative engine built from the pair with the engine's defaults and
    ``draft``'s own weight format."""
    config = EngineConfig(
        model=str(target.path),
        draft_model=str(draft.path),
        device="cpu",
        dtype=dtype,
        quantization=quantization,
        draft_quantization=draft.model.quantization,
        draft_vocab_size=draft_vocab_size,
        draft_vocab_table=draft_vocab_table,
        kv_cache_memory=kv_gib,
        controller_warmup=False,
        seed=seed,
    )
    engine = LLMEngine(config, target=target, draft=draft, progress=False)
    return DraftSide(draft, engine.proposer.runner, engine.allocator)


def generate_paths(
    engine: LLMEngine,
    requests: list[tuple[str, list[int], SamplingParams]],
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict]:
    """Run every request to completion; per request id: output tokens, the target's probability
    of each, and its top tokens/probabilities at each output position."""
    capture = _CapturingRunner(engine.target_runner)
    engine.target_runner = capture
    seqs: dict[str, EngineSeq] = {}
    per_pos: dict[str, dict[int, tuple[float, np.ndarray, np.ndarray]]] = {}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
        seqs[rid] = engine._seqs[rid]
        per_pos[rid] = {}
    done = steps = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        steps += 1
        if steps % 16 == 0:
            logger.info("paths: step %d, %.1f s", steps, time.perf_counter() - start)
        for out in engine.step():
            if out.finished:
                done += 1
                if on_progress:
                    on_progress(done, len(requests))
        for seq, pos, logits in capture.rows:
            if pos >= seq.num_tokens:
                continue  # the step did not keep this row's token (cannot happen in plain decode)
            probs = torch.softmax(logits.float(), dim=-1)
            top_p, top_i = probs.topk(TARGET_TOP)
            token = seq.token_ids[pos]
            per_pos[seq.request_id][pos - seq.num_prompt_tokens] = (
                float(probs[token]),
                top_i.numpy().astype(np.int32),
                top_p.numpy().astype(np.float32),
            )
        capture.rows.clear()
    engine.target_runner = capture.inner
    paths = {}
    for rid, seq in seqs.items():
        n = seq.num_output_tokens
        missing = [j for j in range(n) if j not in per_pos[rid]]
        if missing:
            raise AssertionError(f"{rid}: no target distribution at positions {missing[:5]}")
        paths[rid] = {
            "prompt": list(seq.prompt_token_ids),
            "tokens": np.array(seq.output_token_ids, np.int32),
            "target_prob": np.array([per_pos[rid][j][0] for j in range(n)], np.float32),
            "target_top_ids": np.stack([per_pos[rid][j][1] for j in range(n)]),
            "target_top_probs": np.stack([per_pos[rid][j][2] for j in range(n)]),
        }
    return paths


def draft_top(
    engine: LLMEngine | DraftSide, prompt: list[int], tokens: np.ndarray
) -> tuple[np.ndarray, ...]:
    """The draft's top-``TOP_K`` (ids, probs) at each output position, given the true prefix:
    one forward over prompt + tokens[:-1] keeping the last len(tokens) rows (a pruned head's
    rows put back at their token ids, so q is 0 off its kept tokens, as the engine drafts)."""
    ids = prompt + tokens[:-1].tolist()
    n = int(tokens.shape[0])
    seq = EngineSeq(-1, "trace-draft", ids, SamplingParams(), "off")
    engine.allocator.allocate(seq, len(ids))
    try:
        runner = engine.target_runner
        logits = runner.run([RunEntry(seq, ids, 0, n)])
        logits = vocabulary_logits(runner.output_token_ids, logits, runner.vocab_size)
    finally:
        engine.allocator.free(seq)
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top_i = probs.topk(TOP_K, dim=-1)
    return top_i.numpy().astype(np.int32), top_p.numpy().astype(np.float32)


def target_probs_of(top_ids: np.ndarray, top_probs: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """[n, K] target probability of each id in ``ids`` [n, K], from its [n, TARGET_TOP] top
    tokens (0 where an id is not among them)."""
    match = ids[:, :, None] == top_ids[:, None, :]  # [n, K, TARGET_TOP]
    return (match * top_probs[:, None, :]).sum(axis=-1).astype(np.float32)


def record_requests(
    target_engine: LLMEngine,
    draft_engine: LLMEngine | DraftSide,
    requests: list[tuple[str, str, list[int], SamplingParams]],
) -> list[RequestTrace]:
    """(id, category, prompt ids, params) each -> its trace along the target's path."""
    start = time.perf_counter()

    def progress(done: int, total: int) -> None:
        logger.info("paths: %d/%d requests (%.0f s)", done, total, time.perf_counter() - start)

    # One round per temperature: the second round's prompts hit the prefix cache the first
    # round filled, so each prompt is prefilled once.
    paths: dict[str, dict] = {}
    for temperature in sorted({params.temperature for *_, params in requests}):
        group = [
            (rid, p, params) for rid, _, p, params in requests if params.temperature == temperature
        ]
        paths.update(generate_paths(target_engine, group, progress))
    logger.info("paths generated in %.0f s", time.perf_counter() - start)
    out = []
    for rid, category, _, params in requests:
        path = paths[rid]
        d_ids, d_probs = draft_top(draft_engine, path["prompt"], path["tokens"])
        out.append(
            RequestTrace(
                id=rid,
                category=category,
                temperature=params.temperature,
                seed=params.seed,
                prompt_ids=np.array(path["prompt"], np.int32),
                tokens=path["tokens"],
                target_prob=path["target_prob"],
                draft_ids=d_ids,
                draft_probs=d_probs,
                target_probs_of_draft=target_probs_of(
                    path["target_top_ids"], path["target_top_probs"], d_ids
                ),
            )
        )
    logger.info("draft forwards done at %.0f s", time.perf_counter() - start)
    return out
