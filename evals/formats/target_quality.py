"""How far a target in a lower-precision format is from the fp32 model, position by position.

    python -m specdec.evals.formats.target_quality --output-dir docs/results/formats \
        --arms bfloat16:none,bfloat16:int8,bfloat16:q8_0,bfloat16:int4

Every arm (``DTYPE:QUANTIZATION``, the target alone, no draft) reads the held-out text
(`evals/data/heldout/`) in prompt-sized forwards, as does the fp32 reference first. At every
position with some context (``MIN_CONTEXT``) the arm's next-token distribution is compared with
the reference's at the same position: the KL divergence KL(reference || arm) in nats (what
llama.cpp's ``perplexity --kl-divergence`` reports for its quantizations), whether the two put
the same token on top, and the change in the probability of the text's actual next token; beside
them each model's perplexity. Perplexity
alone resolves a quantized target poorly on a text this short: any change of rounding moves it by
about 1%, up or down, because the text's own difficulty dominates it. The divergence compares each
position with itself, so that cancels.

``DTYPE:QUANTIZATION:torch-layers`` runs the arm's norms, activation and rope on the torch layers
even where a quantized model would take the native element-wise kernels (`native_elementwise`),
and ``:native-layers`` on the native kernels where the engine would keep the torch layers (an
unquantized target), to price what the kernels' rounding does to quality.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from specdec.engine.config import DEFAULT_TARGET, EngineConfig

REFERENCE = "float32:none"
# Positions scored from this much context on. A text's first tokens, seen alone, carry the very
# large activations models keep for a sequence's start (no served prompt reaches a user's tokens
# without a template before them), and one such position can outweigh hundreds of others in a
# mean. llama.cpp's divergence likewise scores only the second half of each context window.
MIN_CONTEXT = 16
LAYERS = ("torch-layers", "native-layers")  # the element-wise layers an arm may pin


@dataclass(frozen=True)
class TargetArm:
    """A target format: ``DTYPE:QUANTIZATION[:torch-layers|:native-layers]``."""

    dtype: str
    quantization: str
    layers: str = ""  # "" keeps the engine's choice

    @classmethod
    def parse(cls, text: str) -> TargetArm:
        parts = text.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in LAYERS):
            raise ValueError(
                f"arm {text!r}: expected DTYPE:QUANTIZATION[:{'|:'.join(LAYERS)}], "
                "e.g. bfloat16:int8 or bfloat16:int4:torch-layers"
            )
        arm = cls(parts[0], parts[1], parts[2] if len(parts) == 3 else "")
        arm.config(threads=1)  # validates the dtype and quantization with the engine's checks
        return arm

    @property
    def name(self) -> str:
        return f"{self.dtype}:{self.quantization}" + (f":{self.layers}" if self.layers else "")

    def config(self, threads: int) -> EngineConfig:
        return EngineConfig(
            model=DEFAULT_TARGET,
            speculative_method="none",
            device="cpu",
            dtype=self.dtype,
            quantization=self.quantization,
            num_threads=threads,
            kv_cache_memory=1.0,
            enable_prefix_caching=False,
            controller_warmup=False,
        )


def divergence(reference: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(reference || logp) per row in nats, both given as log-probabilities ``[n, vocab]``."""
    return (reference.exp() * (reference - logp)).sum(-1)


@dataclass
class Tally:
    """Position-by-position comparison of an arm with the reference, accumulated chunk by
    chunk."""

    divergences: list[float] = field(default_factory=list)
    top_agree: int = 0
    nll: float = 0.0
    delta_p: list[float] = field(default_factory=list)  # p_arm - p_ref of the actual next token

    def add(self, reference: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor) -> None:
        self.divergences += divergence(reference, logp).clamp_min(0.0).tolist()
        self.top_agree += int((reference.argmax(-1) == logp.argmax(-1)).sum())
        picked, picked_ref = logp.gather(1, targets[:, None]), reference.gather(1, targets[:, None])
        self.nll -= float(picked.sum())
        self.delta_p += (picked.exp() - picked_ref.exp()).flatten().tolist()

    def summary(self) -> dict:
        n = len(self.divergences)
        ranked = sorted(self.divergences)
        return {
            "positions": n,
            "kld_mean": statistics.fmean(self.divergences),
            "kld_median": statistics.median(self.divergences),
            "kld_p99": ranked[min(n - 1, math.ceil(0.99 * n) - 1)],
            "kld_max": ranked[-1],
            "top1_agreement": self.top_agree / n,
            "perplexity": math.exp(self.nll / n),
            "delta_p_mean": statistics.fmean(self.delta_p),
            "delta_p_rms": math.sqrt(statistics.fmean(d * d for d in self.delta_p)),
        }


def compare(
    reference: Iterable[torch.Tensor],
    engine,
    token_ids: list[int],
    min_context: int = MIN_CONTEXT,
) -> dict:
    """The `Tally` summary of ``engine``'s target against the reference's log-probabilities
    over ``token_ids`` (chunked as `measure.next_token_logprobs` chunks them), at the positions
    that see at least ``min_context`` tokens."""
    from specdec.evals.formats.measure import next_token_logprobs

    tally, seen = Tally(), 0
    chunks = next_token_logprobs(engine, token_ids)
    for ref, (logp, targets) in zip(reference, chunks, strict=True):
        skip = max(0, min(len(targets), min_context - 1 - seen))  # position i sees i + 1 tokens
        seen += len(targets)
        if skip < len(targets):
            tally.add(ref[skip:], logp[skip:], targets[skip:])
    return tally.summary()


def measure(arms: list[TargetArm], text: str, threads: int) -> dict:
    """The reference's log-probabilities once, then every arm against them (one engine at a
    time, each freed before the next is built)."""
    from specdec.engine.llm_engine import LLMEngine
    from specdec.evals.formats.measure import next_token_logprobs

    torch.set_num_threads(threads)
    engine = LLMEngine(TargetArm.parse(REFERENCE).config(threads), progress=False)
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode(text)
    reference = [logp for logp, _ in next_token_logprobs(engine, ids)]
    reference_row = compare(reference, engine, ids)
    del engine
    gc.collect()
    rows = {REFERENCE: {"arm": REFERENCE, "elementwise": "torch", **reference_row}}
    for arm in arms:
        engine = LLMEngine(arm.config(threads), progress=False)
        model = engine.target_runner.model
        if arm.layers:
            model.use_fused_ops(_layers(arm.layers, model))
        free = engine.allocator.num_free_blocks
        row = compare(reference, engine, ids)
        if engine.allocator.num_free_blocks != free:
            raise RuntimeError(f"{arm.name}: KV blocks not handed back")
        elementwise = "torch" if model.norm.ops is None else type(model.norm.ops).__name__
        rows[arm.name] = {"arm": arm.name, "elementwise": elementwise, **row}
        print(json.dumps(rows[arm.name]), flush=True)
        del engine, model
        gc.collect()
    return {"target": DEFAULT_TARGET, "tokens": len(ids), "min_context": MIN_CONTEXT, "rows": rows}


def _layers(name: str, model):
    """The element-wise ops an arm pins: None (the torch layers) or the native kernels."""
    if name == "torch-layers":
        return None
    from specdec.engine.models.registry import native_elementwise_ops

    ops = native_elementwise_ops(model.arch, next(model.parameters()).dtype)
    if ops is None:
        raise RuntimeError("native-layers: the native kernels do not build or fit here")
    return ops


def markdown(result: dict) -> str:
    from specdec.evals.environment import provenance_line

    reference = result["rows"][REFERENCE]
    lines = [
        "# Target formats against the fp32 model",
        "",
        f"{provenance_line(result)}. The target "
        f"({result['target']}) alone reads the held-out text ({result['tokens']} tokens) in "
        f"256-token forwards; at every position from {result['min_context']} tokens of context on "
        f"({reference['positions']} positions) its next-token distribution is compared with the "
        f"fp32 model's ({REFERENCE}, perplexity {reference['perplexity']:.3f}). KL divergence "
        "KL(fp32 || arm) in nats; top-1: the share of positions where both rank the same token "
        "first; delta p: the arm's probability of the text's next token minus fp32's; perplexity "
        "over the same positions. "
        "Element-wise: the layers computing norms, activation and rope.",
        "",
        "| arm | element-wise | mean KLD | median KLD | p99 KLD | max KLD | top-1 agreement "
        "| delta p mean | delta p RMS | perplexity |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["rows"].items():
        if name == REFERENCE:
            continue
        lines.append(
            f"| `{name}` | {row['elementwise']} | {row['kld_mean']:.5f} | {row['kld_median']:.5f} "
            f"| {row['kld_p99']:.4f} | {row['kld_max']:.4f} | {row['top1_agreement']:.3f} "
            f"| {row['delta_p_mean']:+.5f} | {row['delta_p_rms']:.4f} | {row['perplexity']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-dir", type=Path, required=True)
    ap.add_argument(
        "--arms",
        default="bfloat16:none,bfloat16:int8,bfloat16:q8_0,bfloat16:int4",
        help="DTYPE:QUANTIZATION[:torch-layers|:native-layers], comma-separated (the fp32 "
        "reference is implied)",
    )
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        arms = [TargetArm.parse(a.strip()) for a in args.arms.split(",") if a.strip()]
    except ValueError as e:
        ap.error(str(e))
    from specdec.evals.environment import result_header, write_result
    from specdec.evals.formats.bench_formats import heldout_text

    measured = measure(arms, heldout_text(), args.threads)
    header = result_header("specdec.evals.formats.target_quality", argv, args.threads)
    result = {**header, **measured}
    write_result(args.output_dir, "target_quality", result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
