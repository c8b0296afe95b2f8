"""The live A/B page: ``GET /dashboard`` (one self-contained HTML file, no external resources) and
``GET /dashboard/data`` (the JSON it polls).

The data is the server's rolling window (api.rolling_window: per served model and A/B arm, time
to first token and time per output token percentiles, tokens/s, acceptance rate and accepted
length per time bin) plus the speculative engine's latest published snapshot: the controller's
current decision and its inputs (engine.policy.stats() as the engine loop publishes it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from specdec.api.json_text import JSONText
from specdec.api.rolling_window import ControllerState, RollingWindow
from specdec.api.settings import ServerSettings
from specdec.engine.async_engine import AsyncEngine

PAGE = Path(__file__).with_name("dashboard.html")


def controller_source(engine: AsyncEngine):
    """What the window samples: the controller's latest decision, None without a policy."""

    def latest() -> ControllerState | None:
        if engine.engine.policy is None:
            return None
        snap = engine.snapshot
        return ControllerState(snap.mean_k, snap.speculating_fraction)

    return latest


def dashboard_data(
    engine: AsyncEngine, settings: ServerSettings, window: RollingWindow, models: list[str]
) -> dict[str, Any]:
    snap = engine.snapshot
    config = engine.engine.config
    data = window.snapshot()
    data["models"] = models
    data["engine"] = {
        "alive": engine.is_alive,
        "model": settings.model_name,
        "speculative_method": config.speculative_method,
        "speculative_policy": config.speculative_policy
        if engine.engine.policy is not None
        else None,
        "default_mode": config.speculative_mode,
        "num_speculative_tokens": config.num_speculative_tokens
        if config.speculation_enabled
        else 0,
        "ab_split": settings.ab_split,
        "num_running": snap.num_running,
        "num_waiting": snap.num_waiting,
        "kv_usage": snap.kv_usage,
        "mean_k": snap.mean_k,
        "speculating_fraction": snap.speculating_fraction,
        "acceptance_rate": snap.acceptance_rate,
        "mean_accepted_length": snap.mean_accepted_length,
        "cost_model": dict(snap.controller_costs),
        "acceptance_estimate": list(snap.acceptance_estimate),
    }
    return data


def install_dashboard(
    app: FastAPI,
    engine: AsyncEngine,
    settings: ServerSettings,
    window: RollingWindow,
    models: list[str],
) -> None:
    """Add the two routes to ``app``; the page is read once, here."""
    page = PAGE.read_text(encoding="utf-8")

    @app.get(
        "/dashboard", response_class=HTMLResponse, responses={200: {"content": {"text/html": {}}}}
    )
    async def dashboard_page() -> HTMLResponse:
        """The live A/B page (polls /dashboard/data)."""
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/data")
    async def dashboard_json() -> JSONText:
        """Per arm and time bin over the last minutes, and the controller's current decision."""
        return JSONText(
            dashboard_data(engine, settings, window, models),
            headers={"Cache-Control": "no-store"},
        )
