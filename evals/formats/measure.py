"""One weight-format arm of the formats benchmark, measured in the process that runs it.

An arm is the real pair loaded in one format (target dtype and quantization, draft quantization).
It is measured on its own process so its peak resident memory is its own: batch-1 greedy decode,
plain, speculative with the adaptive policy, and speculative with always k drafts (which the
acceptance and draft agreement are taken from), per prompt; one-row forward times of target and draft;
the target's perplexity on a held-out text.
"""

from __future__ import annotations

import math
import resource
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from specdec.engine.config import DEFAULT_DRAFT, DEFAULT_TARGET, EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.model_runner import ModelRunner, RunEntry
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.sequence import Sequence


@dataclass(frozen=True)
class Arm:
    """A target format, a draft format and a KV pool format:
    ``dtype:quantization/draft_quantization[@kv_cache_dtype]``."""

    dtype: str
    quantization: str
    draft_quantization: str
    kv_cache_dtype: str = "auto"

    @classmethod
    def parse(cls, text: str) -> Arm:
        try:
            weights, _, kv = text.partition("@")
            target, draft_quantization = weights.split("/")
            dtype, quantization = target.split(":")
        except ValueError:
            raise ValueError(
                f"arm {text!r}: expected DTYPE:QUANTIZATION/DRAFT_QUANTIZATION[@KV_CACHE_DTYPE], "
                "e.g. bfloat16:int8/int8-dynamic or bfloat16:none/none@fp8"
            ) from None
        arm = cls(dtype, quantization, draft_quantization, kv or "auto")
        arm.config(threads=1)  # validates every field with the engine's own checks
        return arm

    @property
    def name(self) -> str:
        kv = "" if self.kv_cache_dtype == "auto" else f"@{self.kv_cache_dtype}"
        return f"{self.dtype}:{self.quantization}/{self.draft_quantization}{kv}"

    def config(self, threads: int, max_model_len: int = 2048) -> EngineConfig:
        return EngineConfig(
            model=DEFAULT_TARGET,
            draft_model=DEFAULT_DRAFT,
            device="cpu",
            dtype=self.dtype,
            quantization=self.quantization,
            draft_quantization=self.draft_quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            num_threads=threads,
            max_model_len=max_model_len,
            kv_cache_memory=1.0,
            enable_prefix_caching=False,
        )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def decode_rate(out) -> float:
    """Tokens after the first per second of decode (prefill excluded)."""
    return (len(out.output_token_ids) - 1) / (out.finish_time - out.first_token_time)


# The context of the long-context step time: attention, and so the KV pool's format, weighs.
LONG_CONTEXT = 1984


def one_row_forward_ms(
    engine: LLMEngine, runner: ModelRunner, repeats: int, context: int = 64
) -> float:
    """Median time of a one-token forward after a ``context``-token context (a plain decode
    step)."""
    tokens = [100 + i % 1000 for i in range(context + 1)]
    seq = Sequence(-1, "timing", tokens, greedy(1), "off")
    engine.allocator.allocate(seq, seq.num_tokens)
    try:
        for start in range(0, context, 256):  # the context's keys, in prefill-sized chunks
            piece = tokens[start : min(start + 256, context)]
            runner.run([RunEntry(seq, piece, start, 1)])
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.run([RunEntry(seq, [tokens[context]], context, 1)])
            times.append(time.perf_counter() - start)
    finally:
        engine.allocator.free(seq)
    return 1000 * statistics.median(times)


def next_token_logprobs(
    engine: LLMEngine, token_ids: list[int], chunk: int = 256
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The target's next-token log-probabilities over a text, chunk by chunk (prefill-sized
    forwards): ``([n, vocab] float32, [n] next tokens)`` for every position whose next token is
    in the text. The KV blocks are handed back when the text ends (or the caller stops)."""
    seq = Sequence(-1, "heldout", list(token_ids), greedy(1), "off")
    engine.allocator.allocate(seq, seq.num_tokens)
    try:
        for start in range(0, len(token_ids) - 1, chunk):
            piece = token_ids[start : start + chunk]
            logits = engine.target_runner.run([RunEntry(seq, piece, start, len(piece))])
            targets = torch.tensor(token_ids[start + 1 : start + 1 + len(piece)])
            yield torch.log_softmax(logits[: len(targets)].float(), dim=-1), targets
    finally:
        engine.allocator.free(seq)


def perplexity(engine: LLMEngine, token_ids: list[int], chunk: int = 256) -> float:
    """exp(mean next-token negative log-likelihood) of the target over `token_ids`."""
    nll, count = 0.0, 0
    for logp, targets in next_token_logprobs(engine, token_ids, chunk):
        nll -= float(logp.gather(1, targets[:, None]).sum())
        count += len(targets)
    return math.exp(nll / count)


def measure_arm(
    arm: Arm,
    prompts: list[tuple[str, str, list[int]]],  # (id, category, token ids)
    heldout: str,
    max_tokens: int,
    threads: int,
    repeats: int = 9,
) -> dict:
    start = time.perf_counter()
    engine = LLMEngine(arm.config(threads), progress=False)
    load_seconds = time.perf_counter() - start
    assert engine.proposer is not None and engine.tokenizer is not None
    free0 = engine.allocator.num_free_blocks
    engine.generate([prompts[0][2]], greedy(4), speculative="auto")  # first-call overheads
    target_ms = one_row_forward_ms(engine, engine.target_runner, repeats)
    target_long_ms = one_row_forward_ms(engine, engine.target_runner, repeats, LONG_CONTEXT)
    draft_ms = one_row_forward_ms(engine, engine.proposer.runner, repeats)
    runs = []
    for prompt_id, category, ids in prompts:
        plain = engine.generate([ids], greedy(max_tokens), speculative="off")[0]
        spec = engine.generate([ids], greedy(max_tokens), speculative="auto")[0]
        # Always k drafts: acceptance and agreement of the draft whatever the policy decides.
        fixed = engine.generate([ids], greedy(max_tokens), speculative="on")[0]
        stats = fixed.spec_stats
        runs.append(
            {
                "id": prompt_id,
                "category": category,
                "plain_tok_s": decode_rate(plain),
                "spec_tok_s": decode_rate(spec),
                "fixed_k_tok_s": decode_rate(fixed),
                "auto_drafted": spec.spec_stats.num_draft_tokens,
                "plain_tokens": plain.output_token_ids,
                "spec_equals_plain": spec.output_token_ids == plain.output_token_ids
                and fixed.output_token_ids == plain.output_token_ids,
                "drafted": stats.num_draft_tokens,
                "accepted": stats.num_accepted_tokens,
                "first_position_judged": stats.judged_per_pos[0] if stats.judged_per_pos else 0,
                "first_position_accepted": stats.accepted_per_pos[0]
                if stats.accepted_per_pos
                else 0,
                "target_steps": stats.num_target_steps,
                "emitted": stats.num_emitted_tokens,
            }
        )
    ppl = perplexity(engine, engine.tokenizer.encode(heldout))
    leaked = engine.allocator.num_free_blocks != free0
    return {
        "arm": asdict(arm),
        "name": arm.name,
        "resolved_dtype": str(engine.dtype).removeprefix("torch."),
        "load_seconds": load_seconds,
        "target_step_ms": target_ms,
        "target_step_long_ms": target_long_ms,
        "kv_blocks": engine.allocator.num_free_blocks,
        "draft_step_ms": draft_ms,
        "perplexity": ppl,
        "runs": runs,
        "kv_blocks_leaked": leaked,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20),
    }
