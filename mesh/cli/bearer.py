"""The API key a client of `mesh serve` sends (`mesh status`, `mesh bench`): the one it was
given, else $MESHPIPE_API_KEY, the variable `mesh serve` reads its own key from."""

from __future__ import annotations

import os

KEY_ENV = "MESHPIPE_API_KEY"


def auth_headers(key: str | None = None) -> dict[str, str]:
    """`Authorization: Bearer KEY`, or nothing when there is no key (an open server)."""
    key = (key or os.environ.get(KEY_ENV, "")).strip()
    return {"Authorization": f"Bearer {key}"} if key else {}
