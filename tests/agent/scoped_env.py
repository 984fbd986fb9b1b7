"""Environment variables for a module's tests: module-scoped fixtures set them (monkeypatch is function-scoped, and
hypothesis refuses function-scoped fixtures)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def scoped_env(values: dict[str, str | None]) -> Iterator[None]:
    """Environment variables set (a value) or unset (None) inside the block, restored after: for module-scoped
    fixtures, which monkeypatch cannot serve (hypothesis refuses function-scoped ones)."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
