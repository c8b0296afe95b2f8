"""A cluster ingress on a background thread of this process (ClusterServer + uvicorn on their own
event loop), for tests and benchmarks that drive it over HTTP and reach into Ray directly."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time

import uvicorn
from specdec.api.cluster.options import ClusterOptions
from specdec.api.cluster.server import ClusterServer
from specdec.api.settings import ServerSettings
from specdec.engine.config import EngineConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundCluster:
    def __init__(
        self,
        config: EngineConfig,
        settings: ServerSettings,
        options: ClusterOptions,
        admin_token: str | None = None,
    ) -> None:
        port = free_port()
        settings = dataclasses.replace(settings, port=port)
        self.server = ClusterServer(config, settings, options, admin_token=admin_token)
        self.url = f"http://127.0.0.1:{port}"
        self.uv = uvicorn.Server(
            uvicorn.Config(self.server, host="127.0.0.1", port=port, log_level="warning")
        )
        self.loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            try:
                await self.server.start()
            except BaseException as exc:
                self._error = exc
                raise
            await self.uv.serve()

        asyncio.run(main())

    def start(self, timeout: float = 300.0) -> BackgroundCluster:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uv.started:
            if self._error is not None:
                raise RuntimeError("cluster failed to start") from self._error
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("cluster did not start")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        self.uv.should_exit = True  # the lifespan's shutdown deletes the Serve applications
        self._thread.join(timeout=60)
