"""Optional authenticity for checkpoints: an HMAC-SHA256 over the manifest.

The manifest records every file's SHA-256, but whoever can write the checkpoint directory can
rewrite those too: without a key the hashes catch corruption, not tampering. With a key (the
`key` argument of `save`/`load`, else the `RECSHARD_CHECKPOINT_KEY` environment variable), the
manifest carries an HMAC over its canonical JSON (sorted keys, no spaces, the `hmac` field
left out); since the manifest pins every file's hash, the HMAC covers the whole checkpoint.
A load with a key refuses a manifest without a valid HMAC.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any, Dict

KEY_ENV = "RECSHARD_CHECKPOINT_KEY"
FIELD = "hmac"


def checkpoint_key(key: bytes | str | None) -> bytes | None:
    """The key to sign or check with: `key`, else `$RECSHARD_CHECKPOINT_KEY`, else None."""
    if key is None:
        text = os.environ.get(KEY_ENV)
        if text is None:
            return None
        if not text:
            raise ValueError(f"{KEY_ENV} is set but empty; unset it or set a key")
        return text.encode("utf-8")
    raw = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    if not raw:
        raise ValueError("the checkpoint key is empty")
    return raw


def _canonical(doc: Dict[str, Any]) -> bytes:
    body = {name: value for name, value in doc.items() if name != FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(doc: Dict[str, Any], key: bytes) -> str:
    return hmac.new(key, _canonical(doc), hashlib.sha256).hexdigest()


def verify(doc: Dict[str, Any], key: bytes, file: Path) -> None:
    """`ValueError` naming `file` unless `doc` carries a valid HMAC under `key`."""
    given = doc.get(FIELD) if isinstance(doc, dict) else None
    if not isinstance(given, str):
        raise ValueError(
            f"{file}: no HMAC, but a checkpoint key is configured (argument or {KEY_ENV}): "
            f"refusing a checkpoint that cannot be authenticated"
        )
    if not hmac.compare_digest(given, sign(doc, key)):
        raise ValueError(
            f"{file}: its HMAC does not match: the checkpoint was written with another key "
            f"or changed after it was saved"
        )
