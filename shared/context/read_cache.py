"""The read cache: a store keeps the entries of its last read of a context, and the next
read of that context asks Redis only for the entries it does not hold. Bounded in bytes
(``context.read_cache_bytes``), least recently read out first; a context is kept from its
``read_cache_admit_reads``-th read. See docs/context.md, "Read cache"."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec

from shared.config import ContextConfig
from shared.context.replies import Run, ScriptReplies, by_channel
from shared.types import ContextWindow, Entry

Key = tuple[str, str]  # (principal, context id)
Channel = tuple[int, tuple[Entry, ...], int]  # first seq, entries, bytes counted

_SEEN_MAX = 65536  # contexts the cache remembers reading without keeping them (~17 MiB at most with 20-character names)

# Bytes the read cache counts per entry besides its content: the Entry struct, its id,
# modality and role strings, its time (an int object), the content's bytes header — ~330
# measured with tracemalloc (test_the_read_cache_counts_what_an_entry_takes).
_HELD_ENTRY_OVERHEAD = 330


class Held(msgspec.Struct, gc=False):
    """Entries of one context a store keeps from its last read: per channel the first seq
    and the entries from there on, all of one life (``epoch``) of the context. Within one
    life an entry's (channel, seq) never names other content, so the next read of the
    context asks Redis only for the entries outside these ranges.

    Nothing here is tracked by Python's garbage collector: not this struct (no cycles: it
    holds strings, ints, and a dict of tuples), not ``Entry`` objects (see shared/types.py),
    and, after their first collection, not the tuples and dicts holding only those. So a
    cache of 10^5 entries costs collections nothing; with dataclass entries, full collections
    pause for tens of milliseconds (p99 90-175 ms in ``bench_context.py --full``), and with a
    tracked ``Held`` per context they cost first reads ~8 µs each."""

    epoch: str
    channels: dict[str, Channel]  # modality -> its channel
    nbytes: int = 0
    held_arg: str = ""  # spec(), computed at the first read that sends it
    # The read these channels are the window of: its arguments (modalities, last_n,
    # max_tokens) and the context's VER field then (see context.lua). A read with the same
    # arguments sends that token; if the context is still there, the script answers "unchanged".
    sig: str = ""
    token: str = ""
    version: int = 0
    packed: bytes = b""  # the script arguments of such a read, packed (see ContextStore.get_window)

    def spec(self) -> str:
        """The script's ``held`` argument (see held_set in context.lua)."""
        if len(self.channels) == 1:  # the usual case, without a generator
            for m, (first, es, _) in self.channels.items():
                return f"{self.epoch};{m}:{first}:{first + len(es) - 1}" if es else self.epoch + ";"
        return self.epoch + ";" + ";".join(f"{m}:{first}:{first + len(es) - 1}"
                                           for m, (first, es, _) in self.channels.items() if es)


def channel(first: int, entries: Sequence[Entry]) -> Channel:
    ents = tuple(entries)
    return first, ents, sum([len(e.content) for e in ents]) + _HELD_ENTRY_OVERHEAD * len(ents)


class ReadCache:
    """The contexts one store keeps (``held``, least recently read first) and the contexts
    it has read but not kept yet (``seen``)."""

    def __init__(self, cfg: ContextConfig, replies: ScriptReplies) -> None:
        self.cfg = cfg
        self._replies = replies
        self.held: OrderedDict[Key, Held] = OrderedDict()
        self.nbytes = 0
        self.seen: OrderedDict[Key, int] = OrderedDict()  # contexts read but not kept -> their reads so far
        self.entries_reused = 0  # entries reads took from here instead of Redis

    def get(self, key: Key) -> Held | None:
        try:
            return self.held.get(key)
        except TypeError:  # unhashable: not a name (the store's checks say so)
            return None

    def unchanged(self, key: Key, same: tuple[dict[str, Channel], int], mods: str) -> ContextWindow:
        """The window of an "unchanged" reply: the held channels and version the read sent the
        token of (``same``), the channels asked for."""
        channels, version = same
        asked = mods.split(",") if mods else None
        out: dict[str, list[Entry]] = {}
        n = 0
        for mod, (_first, ents, _) in channels.items():
            if asked is None or mod in asked:
                out[mod] = list(ents)
                n += len(ents)
        win = ContextWindow(key[0], key[1], version, self._replies.in_order(out) if len(out) > 1 else out)
        self.entries_reused += n
        self.recently_read(key)
        return win

    def assemble(self, key: Key, version: int, runs: list[Run], wins: list[Any], ver: str, held: Held | None,
                 snap: dict[str, Channel], mods: str, sig: str) -> ContextWindow | None:
        """The window from the script's reply (runs of the entries not held, and the first and
        last seq of every channel's window) plus the entries held (``snap``: the channels of
        ``held`` when the read named them to the script — a concurrent read may have re-filled
        ``held`` since); then keep what was read for the next read. None if they do not cover
        the windows exactly."""
        win = ContextWindow(key[0], key[1], version)
        fetched = by_channel(runs)
        parts_of_ver = ver.split(";", 2)  # version, epoch (the context's life), channel ranges
        epoch = parts_of_ver[1] if len(parts_of_ver) > 1 else ""
        same_life = held is not None and held.epoch == epoch
        # keep what this read gets? (a context the cache holds: yes; else see _admit)
        keeping = bool(self.cfg.read_cache_bytes) and (held is not None or self._admit(key))
        kept: dict[str, Channel] = {}
        unchanged = same_life
        for i in range(0, len(wins), 3):
            mod = self._replies.mod(wins[i])
            got = self._merge(int(wins[i + 1]), int(wins[i + 2]), fetched.pop(mod, []),
                              snap.get(mod) if same_life else None, keeping)
            if got is None:
                return None
            win.channels[mod], ch, same = got
            if ch is not None:
                kept[mod] = ch
            unchanged = unchanged and same
        if fetched:  # entries outside every window
            return None
        if len(win.channels) > 1:
            win.channels = self._replies.in_order(win.channels)
        # `ver` is the token the next read with these arguments sends back as is: "unchanged"
        # if the context's VER is still this.
        current = held is not None and same_life and held.channels is snap  # not re-filled since
        if held is not None and current and unchanged and len(kept) == len(snap):
            held.sig, held.token, held.version = sig, ver, version
            held.packed = b""
            self.recently_read(key)
        elif keeping and epoch:
            if same_life and mods:  # channels this read did not ask for stay as they were
                asked = mods.split(",")
                for mod, ch in snap.items():
                    if mod not in asked:
                        kept.setdefault(mod, ch)
            if held is not None and current and self.held.get(key) is held:  # the usual read after appends
                held.channels, held.sig, held.token, held.version = kept, sig, ver, version
                held.held_arg, held.packed = "", b""
                self.keep(key, held, replace=False)
            else:
                self.keep(key, Held(epoch, kept, sig=sig, token=ver, version=version))
        return win

    def _merge(self, lo: int, hi: int, parts: list[tuple[int, list[Entry]]], ch: Channel | None,
               keeping: bool) -> tuple[list[Entry], Channel | None, bool] | None:
        """A channel's window ``lo..hi`` from the runs fetched and the channel held (``ch``,
        of the same life): its entries, what to keep of it (None: nothing) and whether it is
        as held; None if they do not cover ``lo..hi`` exactly."""
        if ch is not None:
            first, ents, nbytes = ch
            a, b = max(lo, first), min(hi, first + len(ents) - 1)
            if a <= b:
                self.entries_reused += b - a + 1
                if not parts and first == lo and len(ents) == hi - lo + 1:  # unchanged since the last read
                    return list(ents), ch, True
                mine = ents[a - first:b - first + 1]
                if a == lo and len(parts) == 1 and parts[0][0] == b + 1 and b + len(parts[0][1]) == hi:
                    # The usual read after appends: what we hold, then the new entries. The
                    # byte count follows from the held one (what left the window out, what
                    # came in) instead of a pass over every entry.
                    new = parts[0][1]
                    for e in new:  # a loop, not sum(): usually one to three entries
                        nbytes += len(e.content) + _HELD_ENTRY_OVERHEAD
                    for e in ents[:a - first]:
                        nbytes -= len(e.content) + _HELD_ENTRY_OVERHEAD
                    for e in ents[b - first + 1:]:
                        nbytes -= len(e.content) + _HELD_ENTRY_OVERHEAD
                    entries = [*mine, *new]
                    return entries, (lo, tuple(entries), nbytes), False
                parts.append((a, list(mine)))
                if len(parts) > 1:
                    parts.sort(key=lambda p: p[0])
        expect = lo
        for first, es in parts:  # contiguous and exactly lo..hi
            if first != expect:
                return None
            expect += len(es)
        if expect != hi + 1:
            return None
        entries = parts[0][1] if len(parts) == 1 else [e for _, es in parts for e in es]
        return entries, channel(lo, entries) if keeping else None, False

    def _admit(self, key: Key) -> bool:
        """Whether a read of ``key``, which the cache does not hold, keeps what it read: from
        the context's ``read_cache_admit_reads``-th read among the last _SEEN_MAX contexts
        read. A context read once (a one-shot session, a scan over many contexts) does not
        crowd out those read again and again, and its read does not pay for keeping its
        entries (a first read that keeps them costs the client ~40% more: docs/context.md,
        "Read cache")."""
        need = self.cfg.read_cache_admit_reads
        if need <= 1:
            return True
        seen = self.seen.pop(key, 0) + 1
        if seen >= need:
            return True
        self.seen[key] = seen
        if len(self.seen) > _SEEN_MAX:
            self.seen.popitem(last=False)
        return False

    def keep(self, key: Key, held: Held, *, replace: bool = True) -> None:
        """Keep ``held`` as the most recent record of ``key`` (``replace``: a new record; else
        the one kept, re-filled) within the cache's byte budget."""
        nbytes = 0
        for ch in held.channels.values():
            nbytes += ch[2]
        if replace:
            self.forget(key)
        else:
            self.nbytes -= held.nbytes
        held.nbytes = nbytes
        if nbytes > self.cfg.read_cache_bytes // 8:  # one context may not crowd out the rest
            if not replace:
                del self.held[key]
            return
        if replace:
            self.held[key] = held
        else:
            self.held.move_to_end(key)
        self.nbytes += nbytes
        while self.nbytes > self.cfg.read_cache_bytes:
            _, old = self.held.popitem(last=False)
            self.nbytes -= old.nbytes

    def forget(self, key: Key) -> None:
        old = self.held.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes

    def recently_read(self, key: Key) -> None:
        """The record of ``key`` (if still kept) becomes the most recently read."""
        try:
            self.held.move_to_end(key)
        except KeyError:  # dropped meanwhile (budget) or never kept
            pass
