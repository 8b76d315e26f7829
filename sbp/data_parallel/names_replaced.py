"""Names on other modules replaced while any thread needs them.

The data-parallel fast path replaces functions where libraries look them up as they call
them: torch.nn.functional's losses, transformers' mask functions. An attribute of a module
is global, so the replacements decide per thread what to do (their own thread-local state),
the names are replaced when a first thread needs them, and the originals come back when
the last leaves.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any


class NamesReplaced:
    """`install()` replaces some names and returns (owner, name, original) for each, where an
    owner is an object (an attribute) or a dict (a key); `held()` keeps them replaced."""

    def __init__(self, install: Callable[[], list[tuple[Any, Any, Any]]]):
        self._install = install
        self._lock = threading.Lock()
        self._users = 0  # threads inside `held`
        self._saved: list[tuple[Any, Any, Any]] = []

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if not self._users:
                self._saved = self._install()
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if not self._users:
                    for owner, name, original in reversed(self._saved):
                        if isinstance(owner, dict):
                            owner[name] = original
                        else:
                            setattr(owner, name, original)
                    self._saved = []
