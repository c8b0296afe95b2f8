"""LLMEngine: add requests, step the batch, collect outputs. Synchronous; the server wraps it."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch
from specdec.engine.attention import create_backend
from specdec.engine.attention.flashinfer_backend import WORKSPACE_BYTES, FlashInferAttentionBackend
from specdec.engine.block_allocator import BlockAllocator
from specdec.engine.config import NATIVE_ONLY, EngineConfig, quantization_device_problem
from specdec.engine.cuda_graphs import GraphedForward, batch_buckets, num_scratch_blocks
from specdec.engine.device_memory import RuntimeShapes, runtime_bytes
from specdec.engine.errors import ConfigError, InvalidRequestError, PromptTooLongError
from specdec.engine.gpu_sampling import flashinfer_sampling_kernels, probs_for_rows, verify_drafts
from specdec.engine.kv_cache import (
    GIB,
    allocate_model_kv,
    bytes_per_block,
    num_blocks_for_budget,
    resolve_kv_dtype,
)
from specdec.engine.loader import (
    LoadedModel,
    check_quantization,
    load_model,
    resolve_device,
    resolve_draft_quantization,
    resolve_dtype,
)
from specdec.engine.model_runner import ModelRunner, RunEntry
from specdec.engine.models import native
from specdec.engine.models.arch import ModelArch
from specdec.engine.models.fp8 import check_fp8_device
from specdec.engine.models.fused_ops import FusedOps, probe_fused_ops
from specdec.engine.outputs import (
    OutputState,
    RequestOutput,
    StepTotals,
    append_and_check,
    make_output,
)
from specdec.engine.policy_setup import build_policy, tree_shape
from specdec.engine.sampling import RowContext, greedy_picks
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.scheduler import Scheduler, StepPlan
from specdec.engine.sequence import Sequence, SequenceStatus, SpecStats
from specdec.engine.tree_commit import (
    TreePath,
    commit_tree_kv,
    tree_row_contexts,
    tree_verify_entry,
)
from threadpoolctl import ThreadpoolController

from specdec.controller.policy import (
    PrefillShape,
    SeqOutcome,
    SpeculationPolicy,
    StepObservation,
)
from specdec.controller.step_cost import ForwardShape
from specdec.draft_vocab import resolve_draft_vocab
from specdec.proposers import DraftModelProposer, Drafts, NgramProposer, Proposal, Proposer
from specdec.rejection_sampler import coupled_verify
from specdec.tree_verify import verify_trees

logger = logging.getLogger(__name__)

# Draft steps feed one token, or two when catching up after a fully accepted verify.
DRAFT_Q_LENS = (1, 2)


class LLMEngine:
    # Whether the adaptive policy's step-cost table is cached per machine (a replay, whose
    # forwards are simulated, measures its own every time).
    cache_calibration = True

    def __init__(
        self,
        config: EngineConfig,
        target: LoadedModel | None = None,
        draft: LoadedModel | None = None,
        progress: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.device = resolve_device(config.device)
        # The draft's format, resolved once (a draft handed in built keeps its own under 'auto'):
        # everything after (loading, the calibration cache's key, /health) sees what runs.
        if draft is not None and config.draft_quantization == "auto":
            draft_format = draft.model.quantization
        else:
            draft_format = resolve_draft_quantization(config.draft_quantization, self.device)
        config = dataclasses.replace(config, draft_quantization=draft_format)
        self.config = config
        # Seconds for every step time the engine measures (a replay injects simulated time).
        self.clock = clock
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        # The model's threads own the cores. OpenBLAS (numpy and scipy, under the speculation
        # policy's cost fit: matrices of a few hundred rows) would wake threads of its own for
        # each product that spin on after it, beside the model's: one thread is all it needs.
        ThreadpoolController().select(internal_api="openblas").limit(limits=1)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        problem = quantization_device_problem(
            self.device.type, config.quantization, config.draft_quantization
        )
        if problem is not None:
            raise ConfigError(problem)
        if config.quantization == "fp8" or config.draft_quantization == "fp8":
            check_fp8_device(self.device)
        native_only = [
            f"--{flag} {scheme}"
            for flag, scheme, model in (
                ("quantization", config.quantization, target),
                ("draft-quantization", config.draft_quantization, draft),
            )
            if scheme in NATIVE_ONLY[flag] and model is None
        ]
        if native_only and native.library() is None:
            raise ConfigError(
                f"{' and '.join(native_only)} need the native CPU kernels: an x86 CPU with "
                "AVX-512 VNNI and a C compiler (docs/formats.md)"
            )
        if self.device.type != "cpu" and config.kv_cache_dtype == "int8":
            raise ConfigError("--kv-cache-dtype int8 is a CPU format: use fp8 on CUDA")
        torch.manual_seed(config.seed)
        self.target = target or load_model(
            config.model,
            self.dtype,
            self.device,
            progress=progress,
            quantization=config.quantization,
        )
        check_quantization(self.target, config.quantization, "target")
        self.tokenizer = self.target.tokenizer
        self.draft: LoadedModel | None = None
        if config.speculative_method == "draft_model":
            self.draft = draft or load_model(
                config.draft_model or "",
                self.dtype,
                self.device,
                progress=progress,
                quantization=config.draft_quantization,
                role="draft",
            )
            check_quantization(self.draft, config.draft_quantization, "draft")
            _check_same_vocabulary(self.target, self.draft)
        self.max_model_len = min(config.max_model_len, self.target.arch.max_position_embeddings)
        self.eos_token_ids = self._eos_ids()
        # The token ids the draft's head keeps (None: the whole vocabulary), checked before any
        # memory is set aside.
        self.draft_vocab_ids: torch.Tensor | None = None
        if self.draft is not None:
            self.draft_vocab_ids = resolve_draft_vocab(
                config.draft_vocab_size,
                config.draft_vocab_table,
                self.draft.arch.vocab_size,
                self.draft.tokenizer or self.tokenizer,
                self.eos_token_ids,
            )

        archs = [self.target.arch] + ([self.draft.arch] if self.draft else [])
        k_max = config.num_speculative_tokens if config.speculation_enabled else 0
        graph_q_lens = list(range(1, k_max + 2))
        # On CUDA: what workspaces, graphs and activations will take once the pool is fixed.
        self.runtime_reserve_bytes = (
            self._runtime_reserve(graph_q_lens) if self.device.type == "cuda" else 0
        )
        num_blocks = config.num_kv_blocks or self._num_blocks_from_budget(archs)
        if num_blocks * config.page_size < self.max_model_len + k_max:
            memory = (
                "--gpu-memory-utilization" if self.device.type == "cuda" else "--kv-cache-memory"
            )
            raise ConfigError(
                f"the KV pool ({num_blocks} blocks x {config.page_size} tokens) cannot hold one "
                f"sequence of max_model_len={self.max_model_len}: raise {memory} or "
                f"lower --max-model-len"
            )
        # CUDA graphs pad batches with rows that write only to scratch blocks: the pools hold
        # them past the allocator's last block id, so no sequence is ever given one.
        self._num_scratch = 0
        if self._uses_graphs:
            self._num_scratch = num_scratch_blocks(max(graph_q_lens), config.page_size)
        self._num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.allocator,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            config.scheduling_policy,
            draft_catches_up=self.draft is not None,
        )
        self.target_runner = self._make_runner(self.target, graph_q_lens)
        # FlashInfer's sampling kernels ride with its attention (same build, same start-up
        # checks); everywhere else the torch reference samples, with the same semantics.
        self.sampling_kernels = None
        if isinstance(self.target_runner.backend, FlashInferAttentionBackend):
            self.sampling_kernels = flashinfer_sampling_kernels(self.device)
        self.proposer: Proposer | None = None
        if config.speculative_method == "draft_model":
            draft_model = self.draft
            if self.draft_vocab_ids is not None:
                pruned = draft_model.model.with_output_rows(self.draft_vocab_ids)
                draft_model = dataclasses.replace(draft_model, model=pruned)
            runner = self._make_runner(draft_model, list(DRAFT_Q_LENS))
            shape = tree_shape(config)
            self.proposer = DraftModelProposer(runner, self.sampling_kernels, shape)
        elif config.speculative_method == "ngram":
            self.proposer = NgramProposer(config.ngram_n_min, config.ngram_n_max)
        self.policy: SpeculationPolicy | None = None
        if self.proposer is not None:
            draft_runner = getattr(self.proposer, "runner", None)
            self.policy = build_policy(
                config,
                self.proposer.name,
                self.target_runner,
                draft_runner,
                self.allocator,
                self.dtype,
                self.max_model_len,
                clock=self.clock,
                cache=self.cache_calibration,
            )
        self.spec_stats = SpecStats()
        self.step_totals = StepTotals()
        self._seq_ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self._states: dict[str, OutputState] = {}
        self.num_steps = 0
        per_block = bytes_per_block(archs, config.page_size, self.kv_dtype)
        logger.info(
            "KV pool: %d blocks x %d tokens (%.2f GiB, shared by %s); %d sequences of "
            "max_model_len=%d fit at once",
            num_blocks,
            config.page_size,
            num_blocks * per_block / GIB,
            " + ".join(a.architecture for a in archs),
            num_blocks * config.page_size // self.max_model_len,
            self.max_model_len,
        )

    # ---- construction helpers ---------------------------------------------------------------
    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.target.arch.eos_token_ids)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return tuple(sorted(ids))

    @property
    def _uses_graphs(self) -> bool:
        """Whether runners capture CUDA graphs (they do when FlashInfer attention is picked)."""
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and self.config.attention_backend != "torch"
        )

    def _num_blocks_from_budget(self, archs: list[ModelArch]) -> int:
        """CPU: ``kv_cache_memory`` GiB. CUDA: ``gpu_memory_utilization`` of the free memory,
        less what the runners will take later (workspaces, CUDA graphs, activations)."""
        if self.device.type != "cuda":
            budget = int(self.config.kv_cache_memory * GIB)
            return num_blocks_for_budget(archs, self.config.page_size, self.kv_dtype, budget)
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = int(free * self.config.gpu_memory_utilization) - self.runtime_reserve_bytes
        logger.info(
            "GPU memory: %.2f GiB free after weights; %.2f GiB of the %.0f%% used by the engine "
            "are set aside for workspaces, CUDA graphs and activations, the rest holds KV",
            free / GIB,
            self.runtime_reserve_bytes / GIB,
            100 * self.config.gpu_memory_utilization,
        )
        return num_blocks_for_budget(archs, self.config.page_size, self.kv_dtype, max(0, budget))

    def _runtime_reserve(self, target_q_lens: list[int]) -> int:
        """Estimated device bytes of both runners beyond weights and KV (`device_memory`), the
        target's graphs at ``target_q_lens`` (1 .. k_max + 1)."""
        cfg = self.config
        buckets = batch_buckets(cfg.max_num_seqs) if self._uses_graphs else []
        common = {
            # Both models: the scheduler holds the draft's catch-up to the same token budget.
            "max_batched_tokens": cfg.max_num_batched_tokens,
            "max_sampled_rows": cfg.max_num_seqs * max(target_q_lens),
            "float_workspace_bytes": WORKSPACE_BYTES,
        }
        total = runtime_bytes(
            self.target.arch,
            self.dtype,
            RuntimeShapes(graph_batch_sizes=buckets, graph_q_lens=target_q_lens, **common),
        )
        if self.draft is not None:
            shapes = RuntimeShapes(graph_batch_sizes=buckets, graph_q_lens=DRAFT_Q_LENS, **common)
            total += runtime_bytes(self.draft.arch, self.dtype, shapes)
        return total

    def _make_runner(self, loaded: LoadedModel, graph_q_lens: list[int]) -> ModelRunner:
        arch, page = loaded.arch, self.config.page_size
        total_blocks = self._num_blocks + self._num_scratch
        kv = allocate_model_kv(arch, total_blocks, page, self.kv_dtype, self.device)
        backend = create_backend(
            self.config.attention_backend,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.head_dim,
            self.device,
        )
        graphed = None
        if isinstance(backend, FlashInferAttentionBackend):
            backend.dtype = self.dtype  # plan kernels in plan(), not at the first layer
            backend.kv_dtype = self.kv_dtype if self.kv_dtype != self.dtype else None
            loaded.model.use_fused_ops(self._fused_ops)
            if self._num_scratch:
                k_max = max(graph_q_lens) - 1
                graphed = GraphedForward(
                    loaded.model,
                    kv.layers,
                    backend,
                    page,
                    max_pages_per_seq=-(-(self.max_model_len + k_max + 1) // page),
                    scratch_blocks=range(self._num_blocks, total_blocks),
                    dtype=self.dtype,
                )
                graphed.capture(batch_buckets(self.config.max_num_seqs), graph_q_lens)
        return ModelRunner(loaded.model, kv, backend, page, graphed)

    @functools.cached_property
    def _fused_ops(self) -> FusedOps | None:
        """FlashInfer's fused norm/activation/rope kernels, probed once per engine and only when
        a runner gets FlashInfer attention (None keeps the torch layers)."""
        ops = probe_fused_ops(self.device, self.dtype)
        logger.info("decoder element-wise ops: %s", "fused" if ops else "torch")
        return ops

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        speculative: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and enqueue. Raises (changing nothing) on bad input."""
        params = params or SamplingParams()
        mode = speculative or self.config.speculative_mode
        if mode not in ("auto", "on", "off"):
            raise InvalidRequestError(
                f"speculative must be 'auto', 'on' or 'off', got {mode!r}", param="speculative"
            )
        if mode == "on" and self.proposer is None:
            raise InvalidRequestError(
                "speculative='on' but this engine has no proposer (speculative_method='none')",
                param="speculative",
            )
        if request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = self._tokenize(prompt)
        self.check_lengths(len(prompt_ids), params)
        seq = Sequence(next(self._seq_ids), request_id, prompt_ids, params, mode, arrival_time)
        self._states[request_id] = OutputState(seq, self.tokenizer)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def _tokenize(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.target.arch.vocab_size
            if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {vocab})", param="prompt"
                )
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        return ids

    def check_lengths(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {num_prompt_tokens} tokens but max_model_len is {self.max_model_len} "
                f"(prompt and output must fit): shorten the prompt",
                param="prompt",
            )
        if (
            params.max_tokens is not None
            and num_prompt_tokens + params.max_tokens > self.max_model_len
        ):
            raise PromptTooLongError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len}): lower max_tokens or shorten the prompt",
                param="max_tokens",
            )

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self._states.pop(request_id, None)
        if not seq.is_finished:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step: plan, choose drafts, draft, verify in one target forward, commit.

        The data flows forward: the scheduler's plan goes to the policy, its decision back to the
        scheduler (trimmed to the budget and the pool) and to the proposer, the drafts to the
        verifier, and what the step measured to the policy."""
        t0 = self.clock()
        plan = self.scheduler.schedule_running()
        ready = plan.decode_ready if self.policy is not None else []
        stop = None
        if ready:
            assert self.policy is not None
            prefill = PrefillShape(*self.scheduler.pending_prefill(plan))
            decision = self.policy.decide([s.seq for s in ready], prefill)
            self.scheduler.add_drafts(plan, ready, decision.ks, decision.tree_nodes)
            stop = decision.stop
        self.scheduler.admit(plan)
        if plan.is_empty:
            return []
        drafting = [
            s for s in plan.scheduled if s.num_spec_tokens > 0 or s.num_draft_catchup_tokens > 0
        ]
        drafts = Drafts([])
        td = self.clock()
        if drafting:
            assert self.proposer is not None
            drafts = self.proposer.propose(drafting, stop)
            for item, prop in zip(drafting, drafts.proposals, strict=True):
                item.num_spec_tokens = len(prop.token_ids)
        proposals = {
            item.seq.seq_id: prop for item, prop in zip(drafting, drafts.proposals, strict=True)
        }
        draft_seconds = self.clock() - td
        target_shape = _target_shape(plan)
        outputs, outcomes = self._verify_and_commit(plan, proposals)
        self.num_steps += 1
        step_seconds = self.clock() - t0
        self.step_totals.add(
            StepTotals(1, step_seconds, draft_seconds, step_seconds - draft_seconds)
        )
        if self.policy is not None:
            # A lookup proposer's time is host work beside the target's: no draft forward to fit.
            if not drafts.forwards:
                draft_seconds = 0.0
            self.policy.observe(
                StepObservation(
                    target_shape,
                    step_seconds - draft_seconds,
                    drafts.forwards,
                    draft_seconds,
                    outcomes,
                )
            )
        return outputs

    def _verify_and_commit(
        self, plan: StepPlan, proposals: dict[int, Proposal]
    ) -> tuple[list[RequestOutput], list[SeqOutcome]]:
        entries: list[RunEntry] = []
        for s in plan.scheduled:
            seq = s.seq
            tree = proposals[seq.seq_id].tree if seq.seq_id in proposals else None
            if tree is not None:
                entries.append(tree_verify_entry(seq, tree))
                continue
            drafts = proposals[seq.seq_id].token_ids if seq.seq_id in proposals else []
            tokens = seq.token_ids[
                seq.num_computed_tokens : seq.num_computed_tokens + s.num_new_tokens
            ]
            num_logits = 1 + len(drafts) if s.completes_prompt else 0
            entries.append(RunEntry(seq, tokens + drafts, seq.num_computed_tokens, num_logits))
        logits = self.target_runner.run(entries)  # [rows needing sampling, vocab]

        sampling = [(s, e) for s, e in zip(plan.scheduled, entries, strict=True) if e.num_logits]
        accepted: dict[int, list[int]] = {}
        paths: dict[int, TreePath] = {}  # token trees: the accepted nodes
        outcomes: list[SeqOutcome] = []
        if sampling:
            accepted, paths = self._sample(sampling, proposals, logits)
        kv = getattr(self.target_runner, "kv", None)
        draft_kv = getattr(getattr(self.proposer, "runner", None), "kv", None)
        for s in plan.scheduled:
            path = paths.get(s.seq.seq_id)
            if path is not None:
                fed = proposals[s.seq.seq_id].tree_fed
                commit_tree_kv(s.seq, path.nodes, fed, self.config.page_size, kv, draft_kv)

        outputs = []
        for s in plan.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens + s.num_spec_tokens
            if seq.seq_id in accepted:
                new = accepted[seq.seq_id]
                is_first_token = seq.num_output_tokens == 0
                kept = append_and_check(
                    seq, self._states[seq.request_id], new, self.eos_token_ids, self.max_model_len
                )
                n_acc = len(new) - 1
                path = paths.get(seq.seq_id)
                # A tree drafted its depth's positions (its nodes are counted as draft tokens).
                drafted = s.num_spec_tokens if path is None else path.depth
                if not is_first_token:  # the prefill step is not a decode step: keep it out
                    tree = () if path is None else (s.num_spec_tokens, path.ranks)
                    seq.spec_stats.record(drafted, n_acc, kept, *tree)
                    self.spec_stats.record(drafted, n_acc, kept, *tree)
                ranks = None if path is None else list(path.ranks)
                outcomes.append(SeqOutcome(drafted, n_acc, ranks))
            # Rollback is arithmetic: only committed tokens minus the newest one are computed.
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
            seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, seq.num_tokens - 1)
            if seq.is_finished:
                seq.finish_time = time.monotonic()
                self.allocator.cache_computed_blocks(seq)
                self.scheduler.finish(seq, seq.status)
            else:
                self.allocator.truncate(seq, seq.num_tokens)
                self.allocator.cache_computed_blocks(seq)
            if seq.seq_id in accepted or seq.is_finished:
                outputs.append(self._output(seq))
        return outputs, outcomes

    def _sample(
        self, sampling, proposals, logits
    ) -> tuple[dict[int, list[int]], dict[int, TreePath]]:
        """The tokens each sampling item commits (chains and plain decodes by `verify_drafts`,
        token trees by `verify_trees`), and the accepted path of each tree."""
        rows: list[RowContext] = []
        starts: list[int] = []
        trees: list[int] = []
        for b, (s, e) in enumerate(sampling):
            seq, prop = s.seq, proposals.get(s.seq.seq_id)
            starts.append(len(rows))
            if prop is not None and prop.tree is not None:
                trees.append(b)
                rows += tree_row_contexts(seq, prop.tree)
                continue
            drafts = prop.token_ids if prop is not None else []
            out = seq.output_token_ids
            for j in range(e.num_logits):
                rows.append(RowContext(seq.params, seq.prompt_token_ids, out + drafts[:j]))
        # An all-greedy step of chains needs only the target's picks: no distribution per row.
        picks = None if trees else greedy_picks(logits, rows)
        if picks is not None:
            return self._verify_chains(sampling, starts, proposals, picks=picks), {}
        probs = probs_for_rows(logits, rows, self.sampling_kernels)  # [rows, vocab]
        tree_set = set(trees)
        chains = [b for b in range(len(sampling)) if b not in tree_set]
        accepted: dict[int, list[int]] = {}
        if chains:
            items = [sampling[b] for b in chains]
            accepted = self._verify_chains(items, [starts[b] for b in chains], proposals, probs)
        paths: dict[int, TreePath] = {}
        if trees:
            seqs = [sampling[b][0].seq for b in trees]
            tree_list = [proposals[seq.seq_id].tree for seq in seqs]
            result = verify_trees(
                tree_list,
                [probs[starts[b] : starts[b] + sampling[b][1].num_logits] for b in trees],
                [seq.params.greedy for seq in seqs],
                [seq.params.seed for seq in seqs],
                [seq.num_tokens for seq in seqs],  # where each root row's token goes
            )
            out_ids, counts = result.output_token_ids.tolist(), result.num_accepted.tolist()
            for i, seq in enumerate(seqs):
                accepted[seq.seq_id] = out_ids[i][: counts[i] + 1]
                paths[seq.seq_id] = TreePath(
                    result.accepted_nodes[i], result.accepted_ranks[i], tree_list[i].max_depth
                )
        return accepted, paths

    def _verify_chains(
        self, sampling, starts, proposals, probs=None, picks=None
    ) -> dict[int, list[int]]:
        """Verify chains (and plain decodes: no drafts) whose target rows start at ``starts``,
        from the target's ``probs`` per row, or from its ``picks`` when every row is greedy."""
        k_max = max(e.num_logits for _, e in sampling) - 1
        batch = len(sampling)
        rows = probs if picks is None else picks
        target = rows.new_zeros((batch, k_max + 1, *rows.shape[1:]))
        draft_ids = torch.full((batch, max(k_max, 1)), -1, dtype=torch.int64)
        draft_probs = None
        need_q = any(
            proposals.get(s.seq.seq_id) is not None and proposals[s.seq.seq_id].probs is not None
            for s, _ in sampling
        )
        if need_q:
            draft_probs = probs.new_zeros((batch, max(k_max, 1), probs.shape[-1]))
        num_drafts = [0] * batch
        for b, (s, e) in enumerate(sampling):
            target[b, : e.num_logits] = rows[starts[b] : starts[b] + e.num_logits]
            prop = proposals.get(s.seq.seq_id)
            n = e.num_logits - 1
            num_drafts[b] = n
            if n:
                draft_ids[b, :n] = torch.tensor(prop.token_ids)
                if draft_probs is not None:
                    if prop.probs is not None:
                        draft_probs[b, :n] = prop.probs
                    else:  # one-hot q for this sequence's drafts
                        draft_probs[b, torch.arange(n), draft_ids[b, :n]] = 1.0
        if picks is not None:
            drafts = draft_ids[:, :k_max].to(target.device)
            num = torch.tensor(num_drafts, dtype=torch.int64, device=target.device)
            result = coupled_verify(target, drafts, num)
        else:
            result = verify_drafts(
                target,
                draft_ids[:, :k_max] if k_max else draft_ids[:, :0],
                draft_probs[:, :k_max] if draft_probs is not None and k_max else None,
                num_drafts,
                [s.seq.params.greedy for s, _ in sampling],
                [s.seq.params.seed for s, _ in sampling],
                [s.seq.num_tokens for s, _ in sampling],  # where each row 0's token goes
                self.sampling_kernels,
            )
        out_ids = result.output_token_ids.tolist()
        counts = result.num_accepted.tolist()
        return {s.seq.seq_id: out_ids[b][: counts[b] + 1] for b, (s, _) in enumerate(sampling)}

    def _output(self, seq: Sequence) -> RequestOutput:
        state = self._states[seq.request_id]
        arm = "plain" if seq.spec_mode == "off" or self.proposer is None else "spec"
        out = make_output(seq, state, arm)
        if seq.is_finished:
            self._seqs.pop(seq.request_id, None)
            self._states.pop(seq.request_id, None)
        return out

    # ---- convenience ------------------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        speculative: str | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        base = next(self._seq_ids)
        ids = [f"gen-{base}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            self.add_request(rid, prompt, p, speculative)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in ids]


def _target_shape(plan: StepPlan) -> ForwardShape:
    """Rows, sequences, attended (query, key) pairs and sampled rows of the step's target
    forward."""
    attended = sampled = 0
    for s in plan.scheduled:
        q = s.num_query_tokens
        attended += q * (s.seq.num_computed_tokens + q)
        if s.completes_prompt and s.seq.params.warped:
            sampled += 1 + s.num_spec_tokens
    return ForwardShape(plan.num_batched_tokens, len(plan.scheduled), attended, sampled)


def _check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    if target.arch.vocab_size != draft.arch.vocab_size:
        raise ConfigError(
            f"draft vocabulary ({draft.arch.vocab_size}) differs from the target's "
            f"({target.arch.vocab_size}): the draft must share the target's tokenizer"
        )
    both = target.tokenizer is not None and draft.tokenizer is not None
    if (
        both
        and target.tokenizer.hf_tokenizer.get_vocab() != draft.tokenizer.hf_tokenizer.get_vocab()
    ):
        raise ConfigError(
            "draft tokenizer differs from the target's (same size, different tokens): "
            "choose a draft from the same model family"
        )
