"""Isolation scopes of the `suffix` drafter's store (issue 24): whose earlier text a request may
draft from.

Drafts never change a reply (verification keeps the target's output), but they change how fast
it comes: a request that repeats text stored from earlier traffic is drafted well and answered
sooner. With one store for everyone, a user could time requests to learn whether another user
sent some text (a document, a name, a code snippet). So by default (`user`) each request drafts
only from text stored under its own scope, and is stored under it; `shared` is one scope for
all, for a single-tenant deployment.

A scope is what identifies a user to this server: the credential presented (the bearer token,
checked against --api-key when one is set, otherwise taken as the client sent it) together with
the OpenAI `user` field (the end-user id a front end passes for its own users). The scope key is
an HMAC-SHA256 of both under a secret drawn when the server starts: the raw credential or user id
is never kept (the store's keys are these digests, and no metric names them), and a digest means
nothing outside this process.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping

from specdecode.limits import SUFFIX_ISOLATION as MODES

KEY_HEX = 32  # 128 bits of the digest: collisions between users are out of reach


class Isolation:
    """Turns a request's identity into its store scope (None: the shared scope)."""

    def __init__(self, mode: str = "user") -> None:
        if mode not in MODES:
            raise ValueError(f"isolation must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self._secret = secrets.token_bytes(32)

    def key(self, credential: str | None, user: str | None) -> str | None:
        """The scope of a request presenting `credential` (None: none) on behalf of `user`
        (None: not given). Requests presenting neither share one scope: nothing tells them
        apart. Each part is length-prefixed, so no two (credential, user) pairs join into the
        same message."""
        if self.mode == "shared":
            return None
        message = b"".join(_part(value) for value in (credential, user))
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:KEY_HEX]


def _part(value: str | None) -> bytes:
    """A length-prefixed field; None (absent) differs from "" (given empty)."""
    if value is None:
        return b"-"
    data = value.encode("utf-8", "surrogatepass")
    return b"%d:" % len(data) + data


def credential(headers: Mapping[str, str]) -> str | None:
    """The credential a request presents: the token of `Authorization: Bearer TOKEN` (the
    scheme's case ignored, as the API key check does), else the header as sent; None without
    one."""
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else value.strip()
