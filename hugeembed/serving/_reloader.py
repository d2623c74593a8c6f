"""The server's delta reloads: on their own thread, opt-in, behind a token, never fatal.

* ``--watch SECONDS`` (default off) looks for new deltas that often; ``POST /reload`` applies them
  now, and only with ``Authorization: Bearer <token>`` where the server was given ``--admin-token
  FILE`` (without one it answers 403: reloads from the network are off).
* Reloads run on one thread of their own, never on the executor that runs model calls: a large
  delta never delays a prediction's turn.
* Any error is caught (the model keeps its last good version, ServingModel.reload), counted in
  /metrics (``reload_errors``) and shown in /healthz (``"status": "degraded"`` with the refused
  delta and the reason) until a reload succeeds past it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
from typing import Any

from ..errors import ArtifactError
from ._model import ServingModel

__all__ = ["Reloader"]


class Reloader:
    """Applies new deltas to `model` on its own thread; `metrics` (the server's) gets the counts."""

    def __init__(self, model: ServingModel, metrics, *, watch_s: float = 0.0, token: str | None = None) -> None:
        self.model, self.metrics, self.watch_s = model, metrics, watch_s
        self._token = token.encode() if token else None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hugeembed-reload")
        self._counted = model.refusals  # refusals already reported (at start-up: counted once here)
        self.metrics.reload_errors += model.refusals
        self._task: asyncio.Task | None = None

    # -- running ---------------------------------------------------------------------------------

    def _reload(self) -> list[str]:
        """One reload (on the reload thread): the deltas applied; errors are the model's refusal."""
        try:
            applied = self.model.reload()
        except ArtifactError:
            applied = []
        except Exception:  # noqa: BLE001 -- ServingModel.reload catches its own; anything else must not end us
            applied = []
            self.model.refusals += 1
        self.metrics.reloads += len(applied)
        self.metrics.reload_errors += self.model.refusals - self._counted
        self._counted = self.model.refusals
        return applied

    async def reload_now(self) -> list[str]:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._reload)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.watch_s)
            try:
                await self.reload_now()
            except Exception:  # noqa: BLE001 -- the watcher never ends by an error; _reload counted it
                continue

    def start(self) -> None:
        if self.watch_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- what the routes answer ------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """/healthz: ok, or degraded (still serving the version named) with the delta refused and why."""
        out: dict[str, Any] = {"status": "ok", "version": self.model.version}
        refused = self.model.refused
        if refused is not None:
            out.update(status="degraded", refused=refused.delta, reason=refused.reason)
        return out

    def authorize(self, authorization: str | None) -> tuple[int, str] | None:
        """None when a POST /reload with this Authorization header may run, else (status, reason)."""
        if self._token is None:
            return 403, "POST /reload is off: start the server with --admin-token FILE to allow it"
        given = (authorization or "").encode()
        if not hmac.compare_digest(given, b"Bearer " + self._token):
            return 401, "POST /reload needs the header 'Authorization: Bearer <token>' (the --admin-token file's)"
        return None
