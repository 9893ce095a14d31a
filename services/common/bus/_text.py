"""Small text helpers of the bus: Redis replies, SCAN patterns, URLs for messages."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from redis.exceptions import ResponseError


def text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def is_missing_group(exc: ResponseError) -> bool:
    message = str(exc)
    return "NOGROUP" in message or "no such key" in message


def mask_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
