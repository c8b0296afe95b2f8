"""Turning engine outputs into OpenAI response bodies and stream chunks (chat and text)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.api.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    PromptTokensDetails,
    SpeculativeUsage,
    Usage,
)
from specdec.engine.outputs import RequestOutput


@dataclass(frozen=True)
class ResponseInfo:
    """What every body of one response repeats."""

    response_id: str
    created: int
    model: str
    arm: str
    mode: str
    num_prompt_tokens: int


def make_usage(info: ResponseInfo, out: RequestOutput) -> Usage:
    s = out.spec_stats
    completion = len(out.output_token_ids)
    return Usage(
        prompt_tokens=info.num_prompt_tokens,
        completion_tokens=completion,
        total_tokens=info.num_prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_prompt_tokens),
        speculative=SpeculativeUsage(
            arm=info.arm,
            mode=info.mode,
            draft_tokens=s.num_draft_tokens,
            accepted_tokens=s.num_accepted_tokens,
            acceptance_rate=s.acceptance_rate,
            mean_accepted_length=s.mean_accepted_length,
            nodes_per_tree_step=s.nodes_per_tree_step if s.num_tree_steps else None,
            accepted_per_rank=list(s.accepted_per_rank) if s.num_tree_steps else None,
        ),
    )


class ChatFormatter:
    """Bodies of /v1/chat/completions."""

    object_name = "chat.completion.chunk"

    def __init__(self, info: ResponseInfo) -> None:
        self.info = info

    def _chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        info = self.info
        chunk: dict[str, Any] = {
            "id": info.response_id,
            "object": self.object_name,
            "created": info.created,
            "model": info.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage.model_dump(mode="json")
        return chunk

    def opening_chunks(self) -> list[dict[str, Any]]:
        # OpenAI opens every chat stream with the role and empty content.
        delta = {"role": "assistant", "content": ""}
        return [
            self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])
        ]

    def delta_chunk(self, out: RequestOutput) -> dict[str, Any]:
        delta = {"content": out.new_text} if out.new_text else {}
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": out.finish_reason if out.finished else None,
        }
        if out.finished:
            choice["stop_reason"] = out.stop_reason
        return self._chunk([choice])

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        return self._chunk([], make_usage(self.info, out))

    def response(self, out: RequestOutput) -> dict[str, Any]:
        info = self.info
        body = ChatCompletionResponse(
            id=info.response_id,
            created=info.created,
            model=info.model,
            choices=[
                ChatChoice(
                    message=ChatMessageOut(content=out.text),
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                )
            ],
            usage=make_usage(info, out),
        )
        return body.model_dump(mode="json")


class CompletionFormatter(ChatFormatter):
    """Bodies of /v1/completions."""

    object_name = "text_completion"

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def delta_chunk(self, out: RequestOutput) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "text": out.new_text,
            "logprobs": None,
            "finish_reason": out.finish_reason if out.finished else None,
        }
        if out.finished:
            choice["stop_reason"] = out.stop_reason
        return self._chunk([choice])

    def response(self, out: RequestOutput) -> dict[str, Any]:
        info = self.info
        body = CompletionResponse(
            id=info.response_id,
            created=info.created,
            model=info.model,
            choices=[
                CompletionChoice(
                    text=out.text, finish_reason=out.finish_reason, stop_reason=out.stop_reason
                )
            ],
            usage=make_usage(info, out),
        )
        return body.model_dump(mode="json")
