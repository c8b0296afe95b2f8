"""EngineConfig <-> command-line flags, 1:1 (field `max_num_seqs` is flag `--max-num-seqs`)."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from specdec.engine.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    DRAFT_QUANTIZATIONS,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    SPECULATIVE_MODES,
    SPECULATIVE_POLICIES,
    TREE_GROWTHS,
    EngineConfig,
)

from specdec.draft_vocab import AUTO_DRAFT_VOCAB_SIZE

HELP = {
    "model": "target model: a default name (see `specdec pull --list`), a Hugging Face "
    "directory or a .gguf file",
    "draft_model": "draft model for speculative_method=draft_model (same forms as --model)",
    "speculative_method": "how drafts are proposed",
    "num_speculative_tokens": "k: draft tokens per step (the most the adaptive policy drafts)",
    "speculative_mode": "default for requests that do not choose: auto (the policy decides), "
    "on (always k), off (plain decode)",
    "speculative_policy": "how 'auto' requests get their k: adaptive (goodput from measured "
    "acceptance and step cost, docs/controller.md) or fixed (always k)",
    "spec_tree_max_nodes": "token trees: each drafting sequence drafts a tree of at most this "
    "many nodes, k levels deep, verified in one target pass (0: chains; the adaptive policy "
    "picks trees, chains or plain per step; with ngram: several lookups merged; "
    "docs/token_trees.md)",
    "spec_tree_growth": "how a tree grows each level: dynamic (the nodes of highest path "
    "probability, about max_nodes / k a level) or static (--spec-tree-branching children each)",
    "spec_tree_branching": "children per node of a static tree",
    "ngram_n_min": "shortest suffix the n-gram proposer matches",
    "ngram_n_max": "longest suffix the n-gram proposer matches",
    "draft_vocab_size": "rows of the draft's lm_head: the N most frequent tokens of "
    "--draft-vocab-table (the draft never proposes the others; output is unchanged); 0: the full "
    f"vocabulary; unset: {AUTO_DRAFT_VOCAB_SIZE} where the table fits the draft's tokenizer, "
    "else full (docs/draft_vocab.md)",
    "draft_vocab_table": "frequency table for --draft-vocab-size (default: the one shipped for the "
    "Qwen2.5 tokenizer)",
    "dtype": "weights and KV dtype (auto: bfloat16 on CUDA and on CPUs with AMX or AVX-512 BF16, "
    "else float32; docs/formats.md)",
    "kv_cache_dtype": "KV pool format: auto (the model dtype); int8 (CPU; a scale per token and "
    "head) or fp8 (= fp8_e4m3) / fp8_e5m2 (no scale): one byte per element, about twice the "
    "tokens per GiB of bf16 (docs/formats.md)",
    "quantization": "target's linear-layer weights. CPU: int8 = int8 weights and per-row int8 "
    "activations; q8_0 = int8 weights and activations in groups of 32 (GGUF's Q8_0), int4 = "
    "4-bit weights in groups of 32, both through the native kernels (AVX-512 VNNI, a C "
    "compiler); greedy speculative output still equal to plain output of that model. CUDA: "
    "fp8 = e4m3 weights per channel and activations per row (H100/H200 FP8 tensor cores)",
    "draft_quantization": "draft's linear-layer weights: auto (int4 on AVX-512 CPUs, else none); "
    "int8, q8_0 and fp8 as for the target; int8-dynamic (one activation scale per batch); int4 "
    "(4-bit weights for a few rows, int8-dynamic beyond). Drafts may be lossy: outputs stay exact",
    "device": "where models run",
    "attention_backend": "attention kernels (auto: FlashInfer on CUDA when it works, else torch)",
    "page_size": "tokens per KV block",
    "kv_cache_memory": "GiB for the KV pool on CPU (shared by target and draft)",
    "gpu_memory_utilization": "fraction of the GPU memory free after the weights that the engine "
    "may use: the KV pool plus workspaces, CUDA graphs and activations (estimated, set aside first)",
    "num_kv_blocks": "exact KV block count (overrides the memory budget)",
    "max_model_len": "longest sequence (prompt + output) in tokens",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "token budget of one engine step (prefill chunk size)",
    "enable_prefix_caching": "reuse KV blocks of identical prompt prefixes",
    "scheduling_policy": "fcfs, or spf (shortest prompt first, with aging)",
    "seed": "engine seed for requests without their own",
    "num_threads": "torch CPU threads (default: torch's choice)",
    "controller_warmup": "time plain, verify and draft shapes at start-up to seed the adaptive "
    "policy's cost model (cached per machine under $SPECDEC_HOME/calibration)",
    "stop_drafts_early": "adaptive policy: drafting 'auto' sequences stop short of their k where "
    "the draft's confidence says more forwards do not pay",
    "enforce_eager": "never capture CUDA graphs (they need CUDA and the FlashInfer backend)",
}

CHOICES = {
    "speculative_method": SPECULATIVE_METHODS,
    "speculative_mode": SPECULATIVE_MODES,
    "speculative_policy": SPECULATIVE_POLICIES,
    "spec_tree_growth": TREE_GROWTHS,
    "dtype": DTYPES,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "quantization": QUANTIZATIONS,
    "draft_quantization": DRAFT_QUANTIZATIONS,
    "device": DEVICES,
    "attention_backend": ATTENTION_BACKENDS,
    "scheduling_policy": SCHEDULING_POLICIES,
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        hint = hints[f.name]
        kwargs: dict = {
            "default": f.default,
            "help": f"{HELP.get(f.name, '')} (default: %(default)s)",
        }
        if hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            base = typing.get_args(hint)[0] if typing.get_args(hint) else hint
            kwargs["type"] = base
            if f.name in CHOICES:
                kwargs["choices"] = CHOICES[f.name]
        group.add_argument(_flag(f.name), dest=f.name, **kwargs)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    if values.get("draft_model") in ("", "none"):
        values["draft_model"] = None
    if values["speculative_method"] != "draft_model":
        values["draft_model"] = None
    return EngineConfig(**values)
