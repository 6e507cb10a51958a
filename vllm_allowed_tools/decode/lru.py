"""A small thread-safe LRU map bounded by entries and by bytes: the built-tag cache (API server) and
the compiled-grammar cache (engine) hold objects whose size varies by orders of magnitude (a
compiled grammar at a 150K vocabulary: 2-15 MB), so a count alone does not bound their memory."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class LRU:
    """A small thread-safe LRU map (the API server builds tags from several threads), bounded by
    entries and by bytes: each entry is put with its size, and the least recently used go until
    both bounds hold (the newest entry always stays). ``limits``, when given, is read on every
    put: (entries, bytes) from the settings, so a module-level cache follows them."""

    def __init__(self, capacity: int = 0, max_bytes: int | None = None,
                 limits: Callable[[], tuple[int, int | None]] | None = None) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._limits = limits
        self._items: OrderedDict[Any, Any] = OrderedDict()
        self._sizes: dict[Any, int] = {}
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: Any) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
            self.misses += 1
            return None

    def peek(self, key: Any) -> Any:
        """The value or None, without counting a hit or a miss or touching its age."""
        with self._lock:
            return self._items.get(key)

    def put(self, key: Any, value: Any, size: int = 0) -> None:
        if self._limits is not None:
            self.capacity, self.max_bytes = self._limits()
        with self._lock:
            self.bytes -= self._sizes.pop(key, 0)
            self._items[key] = value
            self._items.move_to_end(key)
            self._sizes[key] = size
            self.bytes += size
            while len(self._items) > 1 and (len(self._items) > self.capacity or (
                    self.max_bytes is not None and self.bytes > self.max_bytes)):
                old, _ = self._items.popitem(last=False)
                self.bytes -= self._sizes.pop(old, 0)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._sizes.clear()
            self.bytes = 0
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._items)
