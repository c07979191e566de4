"""Sammie's front door (an ASGI middleware): tailored's Host allow-list and API keys, then the
checks an image API needs instead of tailored's JSON-only rule.

1. Host and keys: `tailored.server.guard.AccessPolicy` as is (400 `invalid_host`, 401
   `invalid_api_key`; exempt routes /health, /metrics, /version by default).
2. Cross-site requests: a POST whose `Origin` header names another host than its `Host` header
   gets 403. Multipart bodies are a CORS "simple request", so a web page could otherwise make
   a browser POST images here; browsers always send Origin on such a cross-site POST, curl and
   SDKs send none.
3. Content type: a POST must be JSON or multipart/form-data (415 otherwise); none given is
   read as JSON.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from tailored.server.errors import OpenAIError, shown
from tailored.server.guard import AccessPolicy
from tailored.server.http_io import error_response

MEDIA_TYPES = ("application/json", "multipart/form-data")


def origin_error(method: str, origin: str | None, host: str | None) -> OpenAIError | None:
    if method != "POST" or origin is None:
        return None
    try:
        netloc = urlsplit(origin).netloc.lower()
    except ValueError:
        netloc = ""
    if host and netloc and netloc == host.strip().lower():
        return None
    return _cross(origin)


def _cross(origin: str) -> OpenAIError:
    return OpenAIError(f"cross-site request refused (Origin {shown(origin, 80)} is not this "
                       "server): call the API from a program, not a web page",
                       status=403, code="cross_site_request")


def media_error(method: str, content_type: str | None) -> OpenAIError | None:
    if method != "POST" or content_type is None:
        return None
    media = content_type.split(";", 1)[0].strip().lower()
    if media in MEDIA_TYPES:
        return None
    return OpenAIError(f"Content-Type {shown(media, 60)} is not supported: send JSON "
                       "(-H 'Content-Type: application/json') or multipart/form-data "
                       "(curl -F image=@photo.jpg -F prompt=car)", status=415,
                       code="unsupported_media_type")


class SammieGuard:
    def __init__(self, app, policy: AccessPolicy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        h: dict[str, str] = {}
        for k, v in scope["headers"]:
            h.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        method, path, p = scope["method"], scope["path"], self.policy
        host = h.get("host")
        err = (p.host_error(host) or p.key_error(path, h)
               or origin_error(method, h.get("origin"), host)
               or media_error(method, h.get("content-type")))
        if err is None:
            return await self.app(scope, receive, send)
        response = error_response(err)
        if err.status == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

