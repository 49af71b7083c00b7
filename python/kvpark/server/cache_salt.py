"""Which requests may share cached pages: one 64-bit salt per request.

Without a salt every request finds every cached prefix, and ``usage.prompt_tokens_details.
cached_tokens`` then tells a client whether anyone sent the same prompt start before it: a
side channel on a shared server that needs no timing (one request probes a guessed system prompt or
document and reads the count). A request's ``cache_salt`` (vLLM's field) scopes the prefix cache:
the pool starts its pages' hash chain from the salt, so pages are found only by requests of the same
salt. ``--cache-salt-by-key`` folds the API key that let the request in into every salt, so tenants
with different keys never share a page, whatever they send.

The salt text and the key's digest are hashed together (BLAKE2b, length-prefixed so no two pairs
meet); 0 is kept for "no salt", the unscoped cache.
"""

from __future__ import annotations

import hashlib

NO_SALT = 0


def request_salt(cache_salt: str | None, key_digest: bytes | None) -> int:
    """The pool's salt for a request with this ``cache_salt`` and (by option) key digest."""
    if cache_salt is None and key_digest is None:
        return NO_SALT
    h = hashlib.blake2b(digest_size=8, person=b"kvpark-salt")
    for part in (
        key_digest,
        None if cache_salt is None else cache_salt.encode("utf-8", "surrogatepass"),
    ):
        if part is None:
            h.update(b"\x00")
        else:
            h.update(b"\x01" + len(part).to_bytes(8, "little") + part)
    return int.from_bytes(h.digest(), "little") or 1
