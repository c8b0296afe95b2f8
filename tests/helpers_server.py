"""Real `specdec serve` processes on tiny models, for the API tests.

The target is a "script" model: a tiny Qwen2 whose attention and MLP outputs are zeroed, so its
next token depends only on the current one (a bigram table written into the embedding and LM
head). After a newline it spells ``SCRIPT`` over and over, a text whose byte-level tokens split
multi-byte characters (é, 中, 👋) across tokens; any other token leads to a random continuation. The
draft is the same model, so greedy drafts are always accepted. This gives deterministic,
checkable text through a real server without a real model.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from helpers_tokenizer import build_byte_level_tokenizer, save_tokenizer_dir
from tiny_models import tiny_hf_model

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "Hi é中👋!"  # its byte-level tokens are all distinct (checked in build_script_model)
TRIGGER = "\n"  # the chat template's generation prompt ends with it
SCRIPT_LOGIT = 5.0  # x8 after the final RMSNorm: far above the random rows' logits


def build_script_model(path: Path, seed: int = 0, text: str = SCRIPT) -> list[int]:
    """Save the script model + tiny tokenizer to ``path``; return the script's token ids.

    ``text`` replaces the script (its byte-level tokens must be distinct)."""
    tok = build_byte_level_tokenizer()
    script = tok.encode(text, add_special_tokens=False)
    (trigger,) = tok.encode(TRIGGER, add_special_tokens=False)
    assert len(set(script)) == len(script) and trigger not in script
    model = tiny_hf_model("qwen2", seed=seed, vocab=len(tok), layers=2)
    hidden = model.config.hidden_size
    chain = [*script, trigger]  # dims 0..len(chain)-1 identify the scripted tokens
    n = len(chain)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight  # [vocab, hidden]
        head = model.lm_head.weight  # [vocab, hidden]
        embed[:, :n] = 0.0
        head[:, :n] = 0.0
        for i, token in enumerate(chain):
            embed[token] = 0.0
            embed[token, i] = 1.0
            head[token] = 0.0
        # Token i of the script is followed by token i+1; the last one and the trigger by the first.
        for i in range(len(script) - 1):
            head[script[i + 1], i] = SCRIPT_LOGIT
        head[script[0], len(script) - 1] = SCRIPT_LOGIT
        head[script[0], n - 1] = SCRIPT_LOGIT
        assert hidden > n
    model.config.eos_token_id = tok.eos_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    save_tokenizer_dir(tok, path)
    return script


def script_text(num_tokens: int, text: str = SCRIPT) -> str:
    """What the script model says after the trigger in ``num_tokens`` tokens."""
    tok = build_byte_level_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    cycle = [ids[i % len(ids)] for i in range(num_tokens)]
    return tok.decode(cycle)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TINY_ENGINE_ARGS = [
    "--device", "cpu", "--dtype", "float32", "--num-threads", "1",
    "--page-size", "16", "--num-kv-blocks", "256", "--max-model-len", "256",
    "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--no-controller-warmup",
]  # fmt: skip


class ServerProcess:
    """`python -m specdec.api.cli serve ...` on a free port; ``start`` waits until /health is 200."""

    def __init__(
        self, model: Path | str, draft: Path | str | None, extra_args: list[str], log_path: Path,
        env: dict[str, str] | None = None, engine_args: list[str] = TINY_ENGINE_ARGS,
    ) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        drafting = ["--draft-model", str(draft)] if draft else ["--speculative-method", "none"]
        self.cmd = [
            sys.executable, "-m", "specdec.api.cli", "--log-level", "WARNING", "serve",
            "--model", str(model), *drafting, "--port", str(self.port),
            *engine_args, *extra_args,
        ]  # fmt: skip
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def launch(self) -> ServerProcess:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=self.env
        )
        return self

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def health(self) -> tuple[int, dict]:
        r = httpx.get(f"{self.url}/health", timeout=10)
        return r.status_code, r.json()

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until no sequence runs or waits and every KV block is free again."""
        deadline = time.monotonic() + timeout
        while True:
            status, health = self.health()
            idle = health["num_requests_running"] == 0 and health["num_requests_waiting"] == 0
            if status == 200 and idle and health["num_free_blocks"] == health["num_blocks"]:
                return health
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {health}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if hasattr(self, "_log"):
            self._log.close()


def start_servers(*servers: ServerProcess, timeout: float = 180.0) -> None:
    """Launch all, then wait for all: the processes load in parallel."""
    for s in servers:
        s.launch()
    try:
        for s in servers:
            s.wait_ready(timeout)
    except Exception:
        for s in servers:
            s.stop()
        raise


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        have = head[len(name) :]
        if all(f'{k}="{v}"' in have for k, v in labels.items()):
            total += float(value)
    return total


def sse_events(lines) -> list[dict | str]:
    """Parse ``data:`` lines of an SSE stream into JSON objects (and the final "[DONE]")."""
    events: list[dict | str] = []
    for line in lines:
        if line.startswith("data:"):
            data = line[len("data:") :].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@contextmanager
def run_uvicorn(app, **config) -> Iterator[str]:
    """Serve an ASGI ``app`` with uvicorn on a free port in a thread; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
