"""Acceptance cost of verifying seeded requests by the Gumbel coupling instead of the rejection rule.

At one position with target distribution ``p`` and draft distribution ``q``, a draft is accepted

* by the rejection rule (unseeded requests) with probability ``sum_i min(p_i, q_i)``, the most
  any coupling of p and q can reach;
* by the coupling (seeded requests, `specdec.rejection_sampler.coupled_verify`) when both
  exponential races on the same noise ``E`` pick the same token. ``argmax p/E = argmax q/E = i``
  exactly when ``E_j > E_i * max(p_j/p_i, q_j/q_i)`` for every ``j != i``; given ``E_i = e`` that
  has probability ``exp(-e * (m_i - 1))`` with ``m_i = sum_j max(p_j/p_i, q_j/q_i)``, and
  integrating over ``e ~ Exp(1)`` gives ``P(agree) = sum_i 1 / m_i``. Each term is at most
  ``min(p_i, q_i)``, so summing over the tokens with the largest ``min(p_i, q_i)`` only gives a
  lower bound short by at most the ``min`` mass left out, which is reported.

Two modes:

    python -m specdec.evals.coupling_cost synthetic
        random pairs over a 1,000-token vocabulary: q is p's logits plus Gaussian noise of
        several scales (the draft's disagreement), p peaked like a language model's.
    python -m specdec.evals.coupling_cost pair --tiny
    python -m specdec.evals.coupling_cost pair --model DIR --draft-model DIR [--temperature T]
        real draft/target distributions: each prompt is decoded plainly by the target (seeded, at
        the temperature), then both models are run over the prompt and that output and both
        rules are computed at every output position from the warped distributions.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch

# Tokens per row over which the coupling's sum is taken (by largest min(p, q)).
TOP_TOKENS = 512


def rejection_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[rows]``: ``sum_i min(p_i, q_i)`` of each row of ``p`` and ``q`` ([rows, vocab])."""
    return torch.minimum(p.double(), q.double()).sum(dim=-1)


def coupled_acceptance(
    p: torch.Tensor, q: torch.Tensor, top: int = TOP_TOKENS
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([rows], [rows])``: P(argmax p/E == argmax q/E) summed over each row's ``top`` tokens of
    largest ``min(p, q)``, and the most the tokens left out can add (their ``min`` mass)."""
    p, q = p.double(), q.double()
    both = torch.minimum(p, q)  # [rows, vocab]
    m = min(top, p.shape[-1])
    mins, idx = both.topk(m, dim=-1)  # [rows, m]
    pi, qi = p.gather(1, idx), q.gather(1, idx)  # [rows, m]
    out = torch.zeros(p.shape[0], dtype=torch.float64)
    for r in range(p.shape[0]):
        live = mins[r] > 0
        a, b = pi[r, live][:, None], qi[r, live][:, None]  # [c, 1]
        # 1 / m_i = p_i q_i / sum_j max(p_j q_i, q_j p_i): no division by a vanishing p_i or q_i.
        denom = torch.maximum(p[r][None, :] * b, q[r][None, :] * a).sum(dim=-1)  # [c]
        out[r] = (a[:, 0] * b[:, 0] / denom).sum()
    left_out = both.sum(dim=-1) - mins.sum(dim=-1)
    return out, left_out


def summarize(p: torch.Tensor, q: torch.Tensor) -> dict[str, float]:
    rej = rejection_acceptance(p, q)
    cpl, left_out = coupled_acceptance(p, q)
    return {
        "positions": int(p.shape[0]),
        "rejection_rule": float(rej.mean()),
        "coupling": float(cpl.mean()),
        "ratio": float(cpl.mean() / rej.mean()) if float(rej.mean()) > 0 else float("nan"),
        "coupling_left_out_at_most": float(left_out.max()),
    }


def synthetic(
    noise_scales: Sequence[float] = (0.25, 0.5, 1.0, 2.0),
    rows: int = 200,
    vocab: int = 1000,
    logit_scale: float = 3.0,
    seed: int = 0,
) -> list[dict[str, float]]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * logit_scale
    p = torch.softmax(logits, dim=-1)
    out = []
    for s in noise_scales:
        q = torch.softmax(logits + s * torch.randn(rows, vocab, generator=gen).double(), dim=-1)
        out.append({"draft_logit_noise": s, **summarize(p, q)})
    return out


def real_pair(args: argparse.Namespace) -> dict[str, float]:
    """Both rules at every output position of seeded plain decodes of built-in prompts."""
    from specdec.engine.config import EngineConfig
    from specdec.engine.llm_engine import LLMEngine
    from specdec.engine.model_runner import RunEntry
    from specdec.engine.sampling import RowContext, compute_probs
    from specdec.engine.sampling_params import SamplingParams
    from specdec.engine.sequence import Sequence as Seq
    from specdec.evals.datasets import load_categories, prompt_token_ids

    from specdec.draft_vocab import vocabulary_logits

    target = draft = None
    if args.tiny:
        from specdec.evals.tiny_pair import tiny_pair

        target, draft = tiny_pair()
        models = dict(model="tiny", draft_model="tiny-draft", device="cpu", dtype="float32")
    else:
        models = dict(model=args.model, draft_model=args.draft_model, dtype=args.dtype)
    cfg = EngineConfig(
        **models,
        speculative_method="draft_model",
        speculative_mode="off",
        controller_warmup=False,
        max_model_len=2048,
    )
    engine = LLMEngine(cfg, target=target, draft=draft, progress=False)
    vocab = engine.target.arch.vocab_size
    ps, qs = [], []
    prompts = load_categories(["all"], limit=args.prompts_per_category)
    for i, prompt in enumerate(prompts):
        ids = prompt_token_ids(prompt, engine.tokenizer, vocab)
        params = SamplingParams(
            temperature=args.temperature, max_tokens=args.tokens, seed=i, ignore_eos=True
        )
        out = engine.generate([ids], params)[0].output_token_ids
        seq = Seq(-1 - i, f"coupling-cost-{i}", ids + out, params, "off")
        engine.allocator.allocate(seq, seq.num_tokens)
        try:
            run = RunEntry(seq, (ids + out)[:-1], 0, len(out))  # rows that predicted `out`
            rows = [RowContext(params, ids, out[:j]) for j in range(len(out))]
            for runner, dest in ((engine.target_runner, ps), (engine.proposer.runner, qs)):
                logits = vocabulary_logits(runner.output_token_ids, runner.run([run]), vocab)
                dest.append(compute_probs(logits, rows).cpu())
        finally:
            engine.allocator.free(seq)
    return {"temperature": args.temperature, **summarize(torch.cat(ps), torch.cat(qs))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    sub.add_parser("synthetic", help="random distribution pairs")
    pair = sub.add_parser("pair", help="a target/draft model pair")
    pair.add_argument("--tiny", action="store_true", help="the tiny random pair (smoke run)")
    pair.add_argument("--model", default=None, help="target model directory or name")
    pair.add_argument("--draft-model", default=None, help="draft model directory or name")
    pair.add_argument("--dtype", default="auto")
    pair.add_argument("--temperature", type=float, default=1.0)
    pair.add_argument("--tokens", type=int, default=64, help="output tokens per prompt")
    pair.add_argument("--prompts-per-category", type=int, default=2)
    args = parser.parse_args(argv)
    if args.mode == "pair" and not args.tiny and not (args.model and args.draft_model):
        parser.error("pair needs --tiny or both --model and --draft-model")
    result = synthetic() if args.mode == "synthetic" else real_pair(args)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
