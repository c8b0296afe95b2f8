"""Engine configuration: one frozen dataclass, validated on construction, mapped 1:1 onto CLI flags."""

from __future__ import annotations

from dataclasses import dataclass, fields

from specdec.engine.errors import ConfigError

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

SPECULATIVE_METHODS = ("draft_model", "ngram", "none")
SPECULATIVE_MODES = ("auto", "on", "off")
SPECULATIVE_POLICIES = ("adaptive", "fixed")
SCHEDULING_POLICIES = ("fcfs", "spf")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Weight formats of the linear layers: see specdec.engine.models.quant and docs/formats.md.
QUANTIZATIONS = ("none", "int8", "q8_0", "int4", "fp8")
# auto: int4 on CPUs with AVX-512 and fbgemm, where it measured faster than the other draft
# formats at equal acceptance; none elsewhere (engine/loader.py resolve_draft_quantization).
DRAFT_QUANTIZATIONS = ("auto", "none", "int8", "q8_0", "int8-dynamic", "int4", "fp8")
# The formats CUDA runs (fp8: H100/H200 tensor cores); every other one is a CPU format.
CUDA_QUANTIZATIONS = ("none", "auto", "fp8")
# Formats only the native kernels run (a draft's int4 falls back to torch's kernel), by flag.
NATIVE_ONLY = {"quantization": ("int4", "q8_0"), "draft-quantization": ("q8_0",)}
# KV pool formats: auto stores K/V in the model dtype; int8 (a scale per row, CPU) and fp8
# (= fp8_e4m3) and fp8_e5m2 (no scale) store one byte per element (engine/attention/kv_format.py).
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")

# k above this buys nothing measurable (acceptance^k vanishes) and inflates verify batches.
TREE_GROWTHS = ("dynamic", "static")
MAX_TREE_NODES = 64  # a node is a verify row and a scratch KV slot per tree
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option. ``help`` metadata becomes the CLI flag's help text."""

    model: str = DEFAULT_TARGET
    draft_model: str | None = DEFAULT_DRAFT
    speculative_method: str = "draft_model"
    num_speculative_tokens: int = 6
    speculative_mode: str = "auto"
    speculative_policy: str = "adaptive"
    ngram_n_min: int = 2
    ngram_n_max: int = 4
    spec_tree_max_nodes: int = 0
    spec_tree_growth: str = "dynamic"
    spec_tree_branching: int = 2
    draft_vocab_size: int | None = None
    draft_vocab_table: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str = "none"
    draft_quantization: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    page_size: int = 16
    kv_cache_memory: float = 2.0
    gpu_memory_utilization: float = 0.85
    num_kv_blocks: int | None = None
    max_model_len: int = 4096
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    num_threads: int | None = None
    controller_warmup: bool = True
    stop_drafts_early: bool = True
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        check(
            self.speculative_policy in SPECULATIVE_POLICIES,
            f"speculative_policy must be one of {SPECULATIVE_POLICIES}, "
            f"got {self.speculative_policy!r}",
        )
        check(
            self.speculative_method in SPECULATIVE_METHODS,
            f"speculative_method must be one of {SPECULATIVE_METHODS}, got {self.speculative_method!r}",
        )
        check(
            self.speculative_mode in SPECULATIVE_MODES,
            f"speculative_mode must be one of {SPECULATIVE_MODES}, got {self.speculative_mode!r}",
        )
        check(
            self.scheduling_policy in SCHEDULING_POLICIES,
            f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}",
        )
        check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        check(
            not (self.kv_cache_dtype == "int8" and self.device == "cuda"),
            "--kv-cache-dtype int8 is a CPU format: use fp8 on CUDA",
        )
        # The batch-dependent draft formats may serve a model that never verifies drafts (the
        # draft served as its own model, or a plain server): no speculative output to keep
        # equal to plain output there, only rows that depend on their batch-mates.
        plain_only = tuple(q for q in DRAFT_QUANTIZATIONS if q not in QUANTIZATIONS + ("auto",))
        check(
            self.quantization in QUANTIZATIONS
            or (self.quantization in plain_only and self.speculative_method == "none"),
            f"quantization must be one of {QUANTIZATIONS} ({', '.join(plain_only)} only with "
            f"speculative_method none: their rows depend on the batch), got {self.quantization!r}",
        )
        check(
            self.draft_quantization in DRAFT_QUANTIZATIONS,
            f"draft_quantization must be one of {DRAFT_QUANTIZATIONS}, "
            f"got {self.draft_quantization!r}",
        )
        if self.device in ("cpu", "cuda"):
            problem = quantization_device_problem(
                self.device, self.quantization, self.draft_quantization
            )
            check(problem is None, problem or "")
        check(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        check(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        check(
            1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}] (beyond that the "
            f"chance that every draft is accepted is negligible and verify batches only grow), "
            f"got {self.num_speculative_tokens}",
        )
        check(
            0 <= self.spec_tree_max_nodes <= MAX_TREE_NODES,
            f"spec_tree_max_nodes must be in [0, {MAX_TREE_NODES}] (0: chains), "
            f"got {self.spec_tree_max_nodes}",
        )
        check(
            self.spec_tree_growth in TREE_GROWTHS,
            f"spec_tree_growth must be one of {TREE_GROWTHS}, got {self.spec_tree_growth!r}",
        )
        check(
            self.spec_tree_branching >= 1,
            f"spec_tree_branching must be >= 1, got {self.spec_tree_branching}",
        )
        check(
            self.spec_tree_max_nodes == 0 or self.speculative_method != "none",
            "token trees (--spec-tree-max-nodes > 0) need a proposer (draft_model or ngram)",
        )
        check(
            self.draft_vocab_size is None or self.draft_vocab_size >= 0,
            f"draft_vocab_size must be >= 0 (0: the full vocabulary), got {self.draft_vocab_size}",
        )
        check(
            1 <= self.ngram_n_min <= self.ngram_n_max,
            f"need 1 <= ngram_n_min <= ngram_n_max, got {self.ngram_n_min} and {self.ngram_n_max}",
        )
        check(
            self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
            f"page_size must be a power of two, got {self.page_size}",
        )
        check(
            self.kv_cache_memory > 0, f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}"
        )
        check(
            0 < self.gpu_memory_utilization <= 1,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        check(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}",
        )
        check(self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}")
        check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        check(
            self.max_num_batched_tokens >= 1 + MAX_SPECULATIVE_TOKENS,
            f"max_num_batched_tokens must be >= {1 + MAX_SPECULATIVE_TOKENS} so a verify fits, "
            f"got {self.max_num_batched_tokens}",
        )
        check(
            self.num_threads is None or self.num_threads >= 1,
            f"num_threads must be >= 1, got {self.num_threads}",
        )
        if self.speculative_method == "draft_model":
            check(
                bool(self.draft_model),
                "speculative_method 'draft_model' needs --draft-model (or use 'ngram' or 'none')",
            )

    @property
    def speculation_enabled(self) -> bool:
        return self.speculative_method != "none"


def config_field_names() -> list[str]:
    return [f.name for f in fields(EngineConfig)]


def quantization_device_problem(
    device: str, quantization: str, draft_quantization: str
) -> str | None:
    """Why the weight formats cannot run on ``device`` ("cpu" or "cuda"), or None."""
    formats = {"--quantization": quantization, "--draft-quantization": draft_quantization}
    if device == "cuda":
        cpu_only = [f"{flag} {q}" for flag, q in formats.items() if q not in CUDA_QUANTIZATIONS]
        if cpu_only:
            return f"{' and '.join(cpu_only)}: a CPU format; on CUDA use none or fp8"
    elif "fp8" in formats.values():
        flags = " and ".join(f"{flag} fp8" for flag, q in formats.items() if q == "fp8")
        return (
            f"{flags}: fp8 weights are a CUDA format (FP8 tensor cores, H100/H200); on CPU use "
            "int8, q8_0 or int4"
        )
    return None
