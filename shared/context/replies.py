"""The context script's replies (their shapes are described in context.lua) as windows and
entries. Modality names come back as the configured strings, not a new string per entry."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from shared import metrics
from shared.context.entries import decode_run
from shared.text import as_str
from shared.types import ContextWindow, Entry

_V = TypeVar("_V")
Run = tuple[str, int, list[Entry]]  # modality, first seq, entries


def evicted(flat: Sequence[Any]) -> list[str]:
    """The contexts of a reply's ``[context, reason, ...]`` pairs, each eviction counted."""
    out = []
    for i in range(0, len(flat), 2):
        out.append(as_str(flat[i]))
        metrics.CONTEXT_EVICTIONS.labels(as_str(flat[i + 1])).inc()
    return out


def by_channel(runs: list[Run]) -> dict[str, list[tuple[int, list[Entry]]]]:
    """Runs as modality -> [(first seq, entries)]."""
    chans: dict[str, list[tuple[int, list[Entry]]]] = {}
    for mod, first, ents in runs:
        chans.setdefault(mod, []).append((first, ents))
    return chans


class ScriptReplies:
    """Decodes replies for one configuration of modalities; counts the entries read from Redis."""

    def __init__(self, modalities: Sequence[str]) -> None:
        self._order = {m: i for i, m in enumerate(modalities)}
        self._names = {m.encode(): m for m in modalities}
        self.entries_fetched = 0  # entries read from Redis

    def mod(self, name: Any) -> str:
        """A modality name from a reply (the configured str, not a new one per entry)."""
        return self._names.get(name) or as_str(name)

    def in_order(self, channels: dict[str, _V]) -> dict[str, _V]:
        """Channels in the configured modality order."""
        order = self._order
        return {m: channels[m] for m in sorted(channels, key=lambda m: order.get(m, len(order)))}

    def runs(self, flat: list[Any], pos: int) -> list[Run]:
        """Decode the runs of entries at ``flat[pos:]`` (see runs_reply in context.lua)."""
        runs = []
        end = len(flat)
        while pos < end:
            mod, first, n = self.mod(flat[pos]), int(flat[pos + 1]), int(flat[pos + 2])
            vals = flat[pos + 3:pos + 3 + n]
            pos += 3 + n
            if None in vals:  # an entry not stored (never expected): the run splits there
                parts, start = [], 0
                for i, v in enumerate([*vals, None]):
                    if v is None:
                        if i > start:
                            parts.append((first + start, vals[start:i]))
                        start = i + 1
            else:
                parts = [(first, vals)]
            for seq, part in parts:
                ents = decode_run(part)
                runs.append((mod, seq, ents))
                self.entries_fetched += len(ents)
        return runs

    def window_reply(self, flat: list[Any]) -> tuple[Any, list[Run], list[Any], str, list[Any]]:
        """Split ops.window's flat reply (see context.lua) into version, runs, window ranges
        ``[mod, first, last, ...]``, the context's VER token ("<version>;<epoch>;<ranges>",
        see context.lua) and the ``[context, reason, ...]`` pairs of the evictions it reports."""
        nwin = int(flat[2])
        pos = 3 + 3 * nwin
        wins = flat[3:pos]
        nev = int(flat[pos])
        gone = flat[pos + 1:pos + 1 + 2 * nev]
        return flat[0], self.runs(flat, pos + 1 + 2 * nev), wins, as_str(flat[1]), gone

    def window(self, principal: str, context_id: str, version: Any, runs: list[Run]) -> ContextWindow:
        """The window of the script's runs."""
        win = ContextWindow(principal=principal, context_id=context_id, version=int(version))
        for mod, parts in self.in_order(by_channel(runs)).items():
            if len(parts) == 1:
                win.channels[mod] = parts[0][1]
            else:  # linked entries resolved outside the window come as runs of their own
                parts.sort(key=lambda p: p[0])
                win.channels[mod] = [e for _, ents in parts for e in ents]
        return win
