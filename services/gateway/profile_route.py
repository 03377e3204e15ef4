"""``POST /admin/profile?seconds=S[&stack=false]``: the whole stack's merged profile, from the gateway (off by default).

Registered only when the gateway runs with ``--enable-profiling``; otherwise the
path does not exist (404). With API keys on, it needs a valid key (401). It does
what ``pdserve profile`` does from the gateway's side: records the gateway and
every peer at once and answers the merged, clock-aligned Chrome trace (open it in
Perfetto). Processes that could not be profiled are listed in
``otherData.pdserve_not_profiled``; an idle stack answers 409, not an empty trace.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.errors import NothingRecordedError
from services.gateway.core import GatewayCore
from services.profiling import merge
from services.profiling.admin import Profiler


def profile_router(core: GatewayCore, profiler: Profiler) -> APIRouter:
    router = APIRouter()

    @router.post("/admin/profile")
    async def profile(request: Request, seconds: float = 5.0, stack: bool = True):
        core.authenticate(request.headers.get("authorization"))
        traces = await profiler.profile(seconds, fan_out=True, with_stack=stack)
        recorded = [t for t in traces if not t.error]
        if not any(t.activity for t in recorded):
            raise NothingRecordedError(f"nothing to record: no process served a request in the {seconds:g} s "
                                       f"window (the stack was idle); send requests while profiling")
        merged, _ = merge.align(recorded)
        merged["otherData"]["pdserve_not_profiled"] = [
            {"process": f"{t.role} {t.process_id}", "error": t.error} for t in traces if t.error]
        return Response(json.dumps(merged), media_type="application/json",
                        headers={"content-disposition": 'attachment; filename="merged.json"'})

    return router
