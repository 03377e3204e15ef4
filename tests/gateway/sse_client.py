"""Reading the gateway's SSE streams byte for byte, as a browser's EventSource would."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class Event:
    id: str | None
    data: str

    @property
    def json(self):
        return json.loads(self.data)

    @property
    def done(self) -> bool:
        return self.data == "[DONE]"


def events(response, limit: int | None = None) -> list[Event]:
    """Events of a streaming httpx response, or of an iterator of its lines (comments skipped).

    Stops after ``limit`` events or [DONE]; an iterator can be read on from there.
    """
    out: list[Event] = []
    event_id, data = None, []
    for line in response.iter_lines() if hasattr(response, "iter_lines") else response:
        if line.startswith(":"):
            continue
        if line == "":
            if data:
                out.append(Event(event_id, "\n".join(data)))
                if out[-1].done or (limit is not None and len(out) >= limit):
                    return out
            event_id, data = None, []
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "id":
            event_id = value
        elif name == "data":
            data.append(value)
    return out


def chat_text(evs: list[Event]) -> str:
    return "".join((e.json["choices"][0]["delta"].get("content") or "") for e in evs
                   if not e.done and "choices" in e.json and e.json["choices"])
