"""The front door's checks, before any route runs (an ASGI middleware, `Guard`):

1. **Host** (against DNS rebinding): with an allow-list, a request whose `Host` header names
   another host gets 400 `invalid_host`. A web page on this machine can make a browser send
   requests to `http://evil.example:8000` after pointing that name at 127.0.0.1; the browser
   then lets the page read the answers. Its Host header still says `evil.example`, so an
   allow-list of the names this server is reached by stops it. An IP address in the Host
   header is always accepted: rebinding needs a name (`curl 0.0.0.0:8000` keeps working). On
   by default for a server bound to loopback (localhost, 127.0.0.1, ::1); off when bound
   elsewhere (its names are not known here: set `--allowed-hosts`).
2. **API keys**: with keys configured, every route but the exempt ones (`--api-key-exempt`,
   default /health, /health_generate, /metrics, /version) needs `Authorization: Bearer <key>`;
   the Anthropic Messages routes take `x-api-key: <key>` too and answer in Anthropic's error
   shape. A missing or wrong key gets 401 (OpenAI's `invalid_api_key`). Keys are compared in
   constant time (`hmac.compare_digest` of their SHA-256 digests, against every key).
3. **Content type**: a POST whose `Content-Type` is not JSON (`application/json`,
   `application/*+json`) gets 415. A browser page may POST `text/plain`, form or multipart
   bodies to any address without asking first (a CORS "simple request"); refusing them keeps
   such a page from starting generations here. A POST without the header is read as JSON, as
   FastAPI does (`requests.post(url, data=json.dumps(...))` sends none).

The order is the order above: a request from a foreign page learns nothing of the routes.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass

from tailored.server.errors import OpenAIError, shown
from tailored.server.http_io import error_response
from tailored.server.messages_protocol import anthropic_error_response

# the routes each `--api-key-exempt` name opens
EXEMPT_ROUTES = {
    "health": ("/health", "/health_generate"),
    "metrics": ("/metrics",),
    "version": ("/version",),
}
DEFAULT_EXEMPT = ("health", "metrics", "version")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ANTHROPIC_PREFIX = "/v1/messages"  # its routes answer in Anthropic's error shape


def is_loopback(host: str) -> bool:
    """Whether a listen address is loopback only (127.0.0.0/8, ::1, localhost)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_ip(name: str) -> bool:
    """Whether a host name is an IP address (no DNS name to rebind)."""
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class AccessPolicy:
    """What the front door lets in.

    api_keys: accepted keys (empty: no key needed). exempt_paths: routes that need no key.
    allowed_hosts: lower-case host names the Host header may name (its port aside); None: any.
    """

    api_keys: tuple[str, ...] = ()
    exempt_paths: frozenset[str] = frozenset(p for n in DEFAULT_EXEMPT for p in EXEMPT_ROUTES[n])
    allowed_hosts: frozenset[str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "_digests", tuple(_digest(k) for k in self.api_keys))

    # ---- host ----------------------------------------------------------------------------
    def host_error(self, host: str | None) -> OpenAIError | None:
        """400 for a Host header outside the allow-list (none sent: allowed, no browser does)."""
        if self.allowed_hosts is None or not host:
            return None
        name = host_name(host)
        if name in self.allowed_hosts or is_ip(name):
            return None
        return OpenAIError(
            f"Host {shown(name, 100)} is not one this server answers to (allowed: "
            f"{', '.join(sorted(self.allowed_hosts))}); set --allowed-hosts to the names it is "
            "reached by", code="invalid_host")

    # ---- keys ----------------------------------------------------------------------------
    def needs_key(self, path: str) -> bool:
        return bool(self.api_keys) and path not in self.exempt_paths

    def key_error(self, path: str, headers) -> OpenAIError | None:
        """401 unless the request carries one of the keys (`headers`: a case-insensitive
        mapping); None when the route needs none."""
        if not self.needs_key(path):
            return None
        given = bearer(headers.get("authorization"))
        if given is None and path.startswith(ANTHROPIC_PREFIX):
            given = headers.get("x-api-key")
        if given is not None and self.accepts(given):
            return None
        how = "'Authorization: Bearer <key>'" + (
            " or 'x-api-key: <key>'" if path.startswith(ANTHROPIC_PREFIX) else "")
        what = "Missing API key" if given is None else "Incorrect API key provided"
        return OpenAIError(f"{what}: this server needs {how}.", status=401,
                           code="invalid_api_key")

    def accepts(self, key: str) -> bool:
        """Whether `key` is one of the keys, in time independent of which (and of how much of
        it matches): every key's digest is compared."""
        d = _digest(key)
        ok = False
        for k in self._digests:
            ok |= hmac.compare_digest(d, k)
        return ok


def host_name(host: str) -> str:
    """The host name of a Host header, lower case, port and IPv6 brackets removed."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:  # name:port (a bare IPv6 address has several)
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def bearer(value: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def media_type_error(method: str, content_type: str | None) -> OpenAIError | None:
    """415 for a POST whose body is declared as something other than JSON."""
    if method not in ("POST", "PUT", "PATCH") or content_type is None:
        return None
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/")
                                       and media.endswith("+json")):
        return None
    return OpenAIError(
        f"Content-Type {shown(media, 60)} is not supported: send the body as JSON with "
        "'Content-Type: application/json' (curl: -H 'Content-Type: application/json')",
        status=415, code="unsupported_media_type")


class Guard:
    """ASGI middleware: the checks of the module docstring on every HTTP request."""

    def __init__(self, app, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _Headers(scope["headers"])
        path, p = scope["path"], self.policy
        err = (p.host_error(headers.get("host")) or p.key_error(path, headers)
               or media_type_error(scope["method"], headers.get("content-type")))
        if err is None:
            return await self.app(scope, receive, send)
        if path.startswith(ANTHROPIC_PREFIX):
            response = anthropic_error_response(err)
        else:
            response = error_response(err)
        if err.status == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


class _Headers:
    """The first value of each header of an ASGI scope, by lower-case name."""

    def __init__(self, raw) -> None:
        self._d: dict[str, str] = {}
        for k, v in raw:
            self._d.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))

    def get(self, name: str, default=None):
        return self._d.get(name, default)
