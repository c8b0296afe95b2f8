"""transformers ``generate`` as a baseline: plain greedy, and assisted generation with the draft as
``assistant_model`` drafting a constant k tokens per step (no confidence cut-off, no schedule), so
it is the same algorithm the engine runs, in transformers' implementation, at batch size 1.

Both load the same converted Hugging Face directories the engine loads (engine.weights
.resolve_model), in float32 on the CPU unless told otherwise, and are fed the same prompt ids.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch


class HFGenerateBaseline:
    """Generates greedily with transformers; ``generate(ids, max_tokens, k)`` -> (ids, seconds).

    ``k=None`` is plain decode; an int k is assisted generation with k draft tokens per step.
    """

    def __init__(
        self,
        target_dir: str | Path,
        draft_dir: str | Path | None,
        eos_token_ids: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids)
        self.target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype)
        self.target.to(self.device).eval()
        self.draft = None
        if draft_dir is not None:
            self.draft = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=dtype)
            self.draft.to(self.device).eval()

    @property
    def has_assistant(self) -> bool:
        return self.draft is not None

    def _config(self, max_tokens: int):
        from transformers import GenerationConfig

        # A fresh config: the checkpoint's own generation_config may turn sampling on.
        pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        return GenerationConfig(
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=self.eos_token_ids or None,
            pad_token_id=pad,
        )

    def generate(
        self, token_ids: Sequence[int], max_tokens: int, k: int | None
    ) -> tuple[list[int], float]:
        input_ids = torch.tensor([list(token_ids)], device=self.device)  # [1, prompt_len]
        kwargs: dict = {"generation_config": self._config(max_tokens)}
        if k is not None:
            if self.draft is None:
                raise ValueError("assisted generation needs a draft model")
            from transformers import GenerationConfig

            self.draft.generation_config = GenerationConfig(
                num_assistant_tokens=k,
                num_assistant_tokens_schedule="constant",
                assistant_confidence_threshold=0.0,
            )
            kwargs["assistant_model"] = self.draft
        start = time.perf_counter()
        with torch.no_grad():
            out = self.target.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), **kwargs
            )
        seconds = time.perf_counter() - start
        return out[0, input_ids.shape[1] :].tolist(), seconds
