"""Rejection sampling: statistical losslessness, greedy exactness, padding.

The statistical tests simulate whole speculative decodes over a tiny vocabulary. Target and draft
are first-order Markov chains: the next-token distributions ``P[c]`` and ``Q[c]`` depend on the
previous token ``c``, so every verify row really depends on the accepted prefix (a sampler that
verified against the wrong row would be caught), yet the exact distribution of the first tokens is
cheap to compute: ``pos0 = P[start]``, ``pos_{t+1} = pos_t @ P``, ``joint(t0, t1) = P[start] x P``.
Each trial runs speculative steps (with a random number of drafts 0..K per step, padding filled
with NaN so any read of it would show) until it has emitted three tokens. The same check must
reject two deliberately wrong samplers, which shows it has the power to catch real mistakes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from scipy import stats
from specdec.engine.sampling import sample

from specdec.rejection_sampler import RejectionResult, rejection_sample

VOCAB = 8
K = 3
TRIALS = 24_000
NUM_TOKENS = 3
START = 0
# Family-wise threshold for the chi-square p-values of one check (a handful of tests per check).
P_THRESHOLD = 1e-4

Sampler = Callable[..., RejectionResult]


# ---------------------------------------------------------------- deliberately wrong samplers


def always_accept_sampler(
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_token_ids: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor | None,
    num_draft_tokens: torch.Tensor,  # [B]
) -> RejectionResult:
    """Wrong: accepts every draft, then a bonus token from p_n."""
    batch = target_probs.shape[0]
    n = num_draft_tokens.long()
    bonus = sample(target_probs[torch.arange(batch), n])
    return _assemble(draft_token_ids, n, bonus)


def resample_from_p_sampler(
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_token_ids: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor | None,  # [B, K, V]
    num_draft_tokens: torch.Tensor,  # [B]
) -> RejectionResult:
    """Wrong: accepts with probability min(1, p/q) but replaces from p instead of the residual."""
    batch, k_plus_1, _ = target_probs.shape
    k = k_plus_1 - 1
    n = num_draft_tokens.long()
    valid = torch.arange(k)[None, :] < n[:, None]
    drafts = torch.where(valid, draft_token_ids, 0)
    p = target_probs[:, :k].gather(2, drafts[:, :, None]).squeeze(2)
    q = (
        torch.ones_like(p)
        if draft_probs is None
        else draft_probs.gather(2, drafts[:, :, None]).squeeze(2)
    )
    accepted = (torch.rand(batch, k) * q < p) & valid
    num_accepted = accepted.long().cumprod(1).sum(1)
    final = sample(target_probs[torch.arange(batch), num_accepted])
    return _assemble(draft_token_ids, num_accepted, final)


def _assemble(drafts: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor):
    batch, k = drafts.shape
    out = torch.full((batch, k + 1), -1, dtype=torch.long)
    keep = torch.arange(k)[None, :] < num_accepted[:, None]
    out[:, :k] = torch.where(keep, drafts, -1)
    out.scatter_(1, num_accepted[:, None], final[:, None])
    return RejectionResult(output_token_ids=out, num_accepted=num_accepted)


# ---------------------------------------------------------------- simulation harness


def make_chains(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random target table P and draft table Q, [VOCAB, VOCAB] each, rows summing to 1.

    In every row, two tokens get zero target mass and two other tokens zero draft mass, so q has
    mass where p has none and vice versa.
    """
    gen = torch.Generator().manual_seed(seed)
    conc = torch.full((VOCAB,), 0.7)
    dirichlet = torch.distributions.Dirichlet(conc)
    torch.manual_seed(seed)
    p = dirichlet.sample((VOCAB,)).double()
    q = dirichlet.sample((VOCAB,)).double()
    for c in range(VOCAB):
        perm = torch.randperm(VOCAB, generator=gen)
        p[c, perm[:2]] = 0.0
        q[c, perm[2:4]] = 0.0
    return (p / p.sum(1, keepdim=True)).float(), (q / q.sum(1, keepdim=True)).float()


def exact_marginals(p: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    p = p.double()
    pos = [p[START]]
    for _ in range(NUM_TOKENS - 1):
        pos.append(pos[-1] @ p)
    joint01 = p[START][:, None] * p  # [V, V]
    return pos, joint01


def simulate(
    sampler: Sampler, p: torch.Tensor, q: torch.Tensor, seed: int, one_hot_draft: bool = False
) -> torch.Tensor:
    """Emit NUM_TOKENS tokens per trial by repeated speculative steps; returns [TRIALS, NUM_TOKENS].

    With ``one_hot_draft`` the draft deterministically proposes ``argmax Q[c]`` (like an n-gram or
    greedy draft) and ``draft_probs`` is None.
    """
    torch.manual_seed(seed)
    emitted = torch.full((TRIALS, NUM_TOKENS), -1, dtype=torch.long)
    count = torch.zeros(TRIALS, dtype=torch.long)
    last = torch.full((TRIALS,), START, dtype=torch.long)
    rows = torch.arange(TRIALS)
    nan = float("nan")
    while int(count.min()) < NUM_TOKENS:
        n = torch.randint(0, K + 1, (TRIALS,))
        context = [last]
        for _ in range(K):
            prev = context[-1]
            if one_hot_draft:
                context.append(q[prev].argmax(dim=1))
            else:
                context.append(torch.multinomial(q[prev], 1).squeeze(1))
        drafts = torch.stack(context[1:], dim=1)  # [T, K]
        target_probs = p[torch.stack(context, dim=1)].clone()  # [T, K+1, V]
        draft_probs = None if one_hot_draft else q[torch.stack(context[:-1], dim=1)].clone()
        # Padding: drafts past n are -1 and rows past n are NaN; a correct sampler never reads them.
        pad = torch.arange(K)[None, :] >= n[:, None]  # [T, K]
        drafts[pad] = -1
        target_probs[torch.cat([torch.zeros(TRIALS, 1, dtype=torch.bool), pad], dim=1)] = nan
        if draft_probs is not None:
            draft_probs[pad] = nan
        res = sampler(target_probs, drafts, draft_probs, n)
        out, acc = res.output_token_ids, res.num_accepted
        for i in range(K + 1):
            take = (i <= acc) & (count < NUM_TOKENS)
            emitted[take, count[take]] = out[take, i]
            count += take.long()
        last = out[rows, acc]
    return emitted


def lossless_p_values(emitted: torch.Tensor, p: torch.Tensor) -> list[float]:
    """Chi-square p-values of positions 0..NUM_TOKENS-1 and the joint of the first two tokens.

    A token emitted where the exact probability is zero returns p-value 0 (impossible outcome).
    """
    pos, joint01 = exact_marginals(p)
    cells = [(emitted[:, t], pos[t], VOCAB) for t in range(NUM_TOKENS)]
    cells.append((emitted[:, 0] * VOCAB + emitted[:, 1], joint01.reshape(-1), VOCAB * VOCAB))
    p_values = []
    for tokens, probs, size in cells:
        assert int(tokens.min()) >= 0
        observed = torch.bincount(tokens, minlength=size).double()
        support = probs > 1e-12
        if observed[~support].sum() > 0:
            p_values.append(0.0)
            continue
        expected = probs[support] / probs[support].sum() * TRIALS
        p_values.append(float(stats.chisquare(observed[support], expected).pvalue))
    return p_values


# ---------------------------------------------------------------- statistical tests


@pytest.mark.parametrize("chain_seed", [0, 1, 2])
def test_sampled_output_follows_target_distribution(chain_seed: int) -> None:
    p, q = make_chains(chain_seed)
    emitted = simulate(rejection_sample, p, q, seed=100 + chain_seed)
    p_values = lossless_p_values(emitted, p)
    assert min(p_values) > P_THRESHOLD, p_values


def test_one_hot_draft_output_follows_target_distribution() -> None:
    p, q = make_chains(3)
    emitted = simulate(rejection_sample, p, q, seed=7, one_hot_draft=True)
    p_values = lossless_p_values(emitted, p)
    assert min(p_values) > P_THRESHOLD, p_values


@pytest.mark.parametrize("wrong", [always_accept_sampler, resample_from_p_sampler])
@pytest.mark.parametrize("chain_seed", [0, 1])
def test_check_rejects_wrong_samplers(wrong: Sampler, chain_seed: int) -> None:
    p, q = make_chains(chain_seed)
    emitted = simulate(wrong, p, q, seed=100 + chain_seed)
    assert min(lossless_p_values(emitted, p)) < P_THRESHOLD


@pytest.mark.parametrize("wrong", [always_accept_sampler, resample_from_p_sampler])
def test_check_rejects_wrong_samplers_with_one_hot_draft(wrong: Sampler) -> None:
    p, q = make_chains(3)
    emitted = simulate(wrong, p, q, seed=7, one_hot_draft=True)
    assert min(lossless_p_values(emitted, p)) < P_THRESHOLD


def test_acceptance_rate_matches_overlap() -> None:
    """With one draft, P(accept) = sum_y min(p(y), q(y))."""
    p, q = make_chains(4)
    trials = 20_000
    torch.manual_seed(3)
    drafts = torch.multinomial(q[START], trials, replacement=True)[:, None]  # [T, 1]
    target = p[START].expand(trials, 2, VOCAB).contiguous()
    draft_probs = q[START].expand(trials, 1, VOCAB).contiguous()
    res = rejection_sample(target, drafts, draft_probs, torch.ones(trials))
    rate = res.num_accepted.double().mean().item()
    overlap = torch.minimum(p[START], q[START]).sum().item()
    stderr = (overlap * (1 - overlap) / trials) ** 0.5
    assert abs(rate - overlap) < 5 * stderr


# ---------------------------------------------------------------- greedy


def _one_hot(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(ids, vocab).float()


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_greedy_target_follows_argmax_prefix_rule(with_draft_probs: bool) -> None:
    batch, k, vocab = 400, 4, 6
    torch.manual_seed(11)
    argmaxes = torch.randint(0, vocab, (batch, k + 1))
    target = _one_hot(argmaxes, vocab)  # [B, K+1, V]
    # Drafts agree with the argmax often enough that every prefix length occurs.
    drafts = torch.where(
        torch.rand(batch, k) < 0.7, argmaxes[:, :k], torch.randint(0, vocab, (batch, k))
    )
    n = torch.randint(0, k + 1, (batch,))
    drafts[torch.arange(k)[None, :] >= n[:, None]] = -1
    draft_probs = None
    if with_draft_probs:
        # q puts mass on the drafted token and elsewhere, including on the target's argmax.
        draft_probs = torch.softmax(torch.randn(batch, k, vocab), dim=-1)
    res = rejection_sample(target, drafts, draft_probs, n)
    lengths = set()
    for b in range(batch):
        expected = []
        for j in range(int(n[b])):
            if drafts[b, j] != argmaxes[b, j]:
                break
            expected.append(int(drafts[b, j]))
        expected.append(int(argmaxes[b, len(expected)]))
        lengths.add(len(expected))
        padded = expected + [-1] * (k + 1 - len(expected))
        assert res.output_token_ids[b].tolist() == padded
        assert int(res.num_accepted[b]) == len(expected) - 1
    assert lengths == set(range(1, k + 2))


# ---------------------------------------------------------------- padding, shapes


def test_no_draft_slots_at_all() -> None:
    target = torch.softmax(torch.randn(2, 1, 10), dim=-1)
    res = rejection_sample(target, torch.empty(2, 0, dtype=torch.long), None, torch.zeros(2))
    assert res.output_token_ids.shape == (2, 1)
    assert res.num_accepted.tolist() == [0, 0]
    assert (res.output_token_ids >= 0).all()


def test_output_shape_dtype_and_padding_mixed_batch() -> None:
    batch, k, vocab = 64, 3, 12
    torch.manual_seed(8)
    target = torch.softmax(torch.randn(batch, k + 1, vocab), dim=-1)
    draft_probs = torch.softmax(torch.randn(batch, k, vocab), dim=-1)
    drafts = torch.multinomial(draft_probs.reshape(-1, vocab), 1).reshape(batch, k)
    n = torch.arange(batch) % (k + 1)
    drafts[torch.arange(k)[None, :] >= n[:, None]] = -1
    res = rejection_sample(target, drafts, draft_probs, n)
    out, acc = res.output_token_ids, res.num_accepted
    assert out.shape == (batch, k + 1) and out.dtype == torch.int64
    assert acc.shape == (batch,) and acc.dtype == torch.int64
    assert ((acc >= 0) & (acc <= n)).all()
    for b in range(batch):
        a = int(acc[b])
        assert out[b, :a].tolist() == drafts[b, :a].tolist()
        assert 0 <= int(out[b, a]) < vocab
        assert (out[b, a + 1 :] == -1).all()
    assert set(acc.tolist()) == {0, 1, 2, 3}


def test_residual_all_zero_falls_back_to_target() -> None:
    # Inconsistent input (the draft token has q == 0) with p == q, so max(0, p - q) is all zero;
    # the rule must still emit a valid token from p, never NaN garbage.
    target = torch.tensor([[[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]]])
    draft_probs = torch.tensor([[[0.0, 1.0, 0.0]]])
    drafts = torch.tensor([[0]])  # p(0) = 0 so it is rejected; residual max(0, p - q) == 0
    res = rejection_sample(target, drafts, draft_probs, torch.tensor([1]))
    assert res.output_token_ids.tolist() == [[1, -1]]
    assert res.num_accepted.tolist() == [0]


def test_validation_errors() -> None:
    target = torch.softmax(torch.randn(2, 3, 5), dim=-1)
    drafts = torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(ValueError):
        rejection_sample(target, drafts, None, torch.tensor([3, 0]))
    with pytest.raises(ValueError):
        rejection_sample(target, torch.zeros(2, 3, dtype=torch.long), None, torch.zeros(2))
    with pytest.raises(ValueError):
        rejection_sample(target, drafts, torch.zeros(2, 2, 4), torch.zeros(2))
