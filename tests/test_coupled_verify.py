"""Verification of seeded requests by the Gumbel coupling: lossless, and independent of the drafts.

The harness of ``test_rejection_sampler`` (first-order Markov target and draft chains over a tiny
vocabulary, random draft counts 0..K per step, NaN padding) runs here with seeded requests: trial
``i`` is a request with its own seed, every token it emits lies at an absolute position, the draft
proposes by the exponential race on the noise of (seed, position), and the target verifies through
`specdec.engine.gpu_sampling.verify_drafts`. The committed tokens must follow the target chain exactly
(chi-square), two deliberately wrong couplings must fail the same check, and every trial's tokens
must equal those of plain decode with the same seed whatever the draft counts and the draft.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from specdec.engine import noise
from specdec.engine.gpu_sampling import TorchKernels, verify_drafts
from specdec.engine.sampling import sample
from test_rejection_sampler import (
    NUM_TOKENS,
    P_THRESHOLD,
    START,
    TRIALS,
    VOCAB,
    K,
    lossless_p_values,
    make_chains,
)

from specdec.rejection_sampler import RejectionResult, coupled_verify

# (target_probs [T, K+1, V], drafts [T, K], n [T], seeds, positions of row 0) -> result
Verify = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]], RejectionResult]
# (q rows [T, V], seeds, positions) -> drafted tokens [T]
Draft = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


def coupled(kernels: TorchKernels | None = None) -> Verify:
    def verify(target, drafts, n, seeds, positions):
        trials = len(seeds)
        greedy = [False] * trials
        return verify_drafts(target, drafts, None, n.tolist(), greedy, seeds, positions, kernels)

    return verify


def race_draft(q_rows: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """The draft of a seeded request: the same race as the target's, on its own distribution."""
    return sample(q_rows, seeds, positions)


def one_hot_draft(q_rows: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """A deterministic proposer (n-gram lookup, greedy draft): q one-hot at its argmax."""
    return q_rows.argmax(dim=-1)


# ---------------------------------------------------------------- deliberately wrong couplings


def same_noise_every_position(target, drafts, n, seeds, positions):
    """Wrong: the noise is keyed by the seed only, so every position races on the same noise."""
    return coupled()(target, drafts, n, seeds, [0] * len(seeds))


OWN_PURPOSE = noise.TOKEN + 1  # a stream independent of the target's


def own_noise_draft(q_rows: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    keys = noise.stream_keys(seeds, positions, OWN_PURPOSE, "cpu")
    return (q_rows / noise.exponentials(keys, q_rows.shape[1])).argmax(dim=-1)


def accept_on_draft_noise(target, drafts, n, seeds, positions):
    """Wrong: a draft is accepted when it wins the target's race on the draft's own noise, while
    the token emitted at a mismatch wins the race on the target's noise."""
    trials, k_plus_1, vocab = target.shape
    own = torch.stack(
        [
            own_noise_draft(target[:, j].nan_to_num(0.0), seeds, [p + j for p in positions])
            for j in range(k_plus_1)
        ],
        dim=1,
    )  # [T, K+1]
    accepted = coupled_verify(own, drafts, n).num_accepted
    out = torch.full((trials, k_plus_1), -1, dtype=torch.long)
    keep = torch.arange(k_plus_1 - 1)[None, :] < accepted[:, None]
    out[:, :-1] = torch.where(keep, drafts, -1)
    # The emitted token at the stop row: the target's pick there (its own race at that row).
    rows = torch.arange(trials)
    stop = target[rows, accepted].nan_to_num(0.0)
    final = sample(stop, seeds, [p + int(a) for p, a in zip(positions, accepted, strict=True)])
    out[rows, accepted] = final
    return RejectionResult(output_token_ids=out, num_accepted=accepted)


# ---------------------------------------------------------------- harness


def simulate_seeded(
    verify: Verify,
    draft: Draft,
    p: torch.Tensor,
    q: torch.Tensor,
    seed: int,
    max_drafts: int = K,
    trials: int = TRIALS,
) -> tuple[torch.Tensor, float]:
    """Emit NUM_TOKENS tokens per seeded trial; returns ([trials, NUM_TOKENS], acceptance rate).

    Draft counts are drawn uniformly from 0..max_drafts each step (0 throughout = plain decode).
    """
    gen = torch.Generator().manual_seed(seed)
    seeds = list(range(seed * trials, (seed + 1) * trials))
    emitted = torch.full((trials, NUM_TOKENS), -1, dtype=torch.long)
    count = torch.zeros(trials, dtype=torch.long)
    last = torch.full((trials,), START, dtype=torch.long)
    rows = torch.arange(trials)
    drafted = accepted = 0
    while int(count.min()) < NUM_TOKENS:
        n = torch.randint(0, max_drafts + 1, (trials,), generator=gen)
        positions = count.tolist()
        context = [last]
        for j in range(K):
            context.append(draft(q[context[-1]], seeds, [c + j for c in positions]))
        drafts = torch.stack(context[1:], dim=1)  # [T, K]
        target_probs = p[torch.stack(context, dim=1)].clone()  # [T, K+1, V]
        pad = torch.arange(K)[None, :] >= n[:, None]
        drafts[pad] = -1
        target_probs[torch.cat([torch.zeros(trials, 1, dtype=torch.bool), pad], dim=1)] = float(
            "nan"
        )
        res = verify(target_probs, drafts, n, seeds, positions)
        out, acc = res.output_token_ids, res.num_accepted
        drafted += int(n.sum())
        accepted += int(acc.sum())
        for i in range(K + 1):
            take = (i <= acc) & (count < NUM_TOKENS)
            emitted[take, count[take]] = out[take, i]
            count += take.long()
        last = out[rows, acc]
    return emitted, accepted / max(drafted, 1)


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize(
    ("chain_seed", "kernels"), [(0, None), (1, TorchKernels())], ids=["reference", "torch_kernels"]
)
def test_coupled_output_follows_target_distribution(chain_seed, kernels) -> None:
    p, q = make_chains(chain_seed)
    emitted, rate = simulate_seeded(coupled(kernels), race_draft, p, q, seed=chain_seed)
    p_values = lossless_p_values(emitted, p)
    assert min(p_values) > P_THRESHOLD, p_values
    assert 0.1 < rate < 0.9  # drafts are really accepted and rejected


def test_coupled_output_with_one_hot_drafts_follows_target_distribution() -> None:
    p, q = make_chains(3)
    emitted, rate = simulate_seeded(coupled(), one_hot_draft, p, q, seed=3)
    assert min(lossless_p_values(emitted, p)) > P_THRESHOLD
    assert rate > 0.02


@pytest.mark.parametrize(
    ("verify", "draft"),
    [(same_noise_every_position, race_draft), (accept_on_draft_noise, own_noise_draft)],
    ids=["same_noise_every_position", "accept_on_draft_noise"],
)
@pytest.mark.parametrize("chain_seed", [0, 1])
def test_check_rejects_wrong_couplings(verify, draft, chain_seed) -> None:
    p, q = make_chains(chain_seed)
    emitted, _ = simulate_seeded(verify, draft, p, q, seed=chain_seed)
    assert min(lossless_p_values(emitted, p)) < P_THRESHOLD


def test_committed_tokens_equal_plain_decode_for_any_drafts() -> None:
    """The invariant itself: with the same seeds, plain decode, speculation at any draft counts,
    a different draft and a deterministic draft commit exactly the same tokens."""
    p, q = make_chains(0)
    _, other_q = make_chains(5)
    n = 4000
    plain, _ = simulate_seeded(coupled(), race_draft, p, q, seed=4, max_drafts=0, trials=n)
    spec, rate = simulate_seeded(coupled(), race_draft, p, q, seed=4, trials=n)
    other, _ = simulate_seeded(coupled(TorchKernels()), race_draft, p, other_q, seed=4, trials=n)
    lookup, _ = simulate_seeded(coupled(), one_hot_draft, p, q, seed=4, trials=n)
    assert torch.equal(spec, plain) and torch.equal(other, plain) and torch.equal(lookup, plain)
    assert rate > 0.1
    # Not vacuous: other seeds commit other tokens.
    shifted, _ = simulate_seeded(coupled(), race_draft, p, q, seed=6, max_drafts=0, trials=n)
    assert (shifted != plain).any(dim=1).float().mean() > 0.5


def test_acceptance_is_the_chance_both_races_agree() -> None:
    """One draft per trial: the acceptance rate equals P(argmax q/E == argmax p/E), computed
    exactly, which is below the rejection rule's sum(min(p, q))."""
    from specdec.evals.coupling_cost import coupled_acceptance, rejection_acceptance

    p, q = make_chains(4)
    trials = TRIALS
    seeds, positions = list(range(trials)), [0] * trials
    target = p[START].expand(trials, VOCAB)
    drafts = sample(q[START].expand(trials, VOCAB), seeds, positions)[:, None]
    grid = torch.stack([target, p[drafts[:, 0]]], dim=1)  # [T, 2, V]
    res = verify_drafts(grid, drafts, None, [1] * trials, [False] * trials, seeds, positions)
    rate = res.num_accepted.double().mean().item()
    exact = float(coupled_acceptance(p[START : START + 1], q[START : START + 1])[0])
    stderr = (exact * (1 - exact) / trials) ** 0.5
    assert abs(rate - exact) < 5 * stderr
    assert exact < float(rejection_acceptance(p[START : START + 1], q[START : START + 1])[0])


def test_coupled_verify_layout_and_validation() -> None:
    picks = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6]])
    drafts = torch.tensor([[3, 4, 9], [3, 4, 5], [7, -1, -1]])
    res = coupled_verify(picks, drafts, torch.tensor([3, 2, 1]))
    assert res.num_accepted.tolist() == [2, 2, 0]
    assert res.output_token_ids.tolist() == [[3, 4, 5, -1], [3, 4, 5, -1], [3, -1, -1, -1]]
    with pytest.raises(ValueError):
        coupled_verify(picks, drafts, torch.tensor([4, 0, 0]))
    with pytest.raises(ValueError):
        coupled_verify(picks, drafts[:, :2], torch.tensor([1, 0, 0]))
