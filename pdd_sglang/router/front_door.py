"""What a client of the router may do and see: its keys, and the internal detail of its answers.

The keys follow SGLang's own rules, taken from its code (``sglang.srt.utils.auth``): with
``--api-key`` every route but ``/health``, ``/ready`` and ``/metrics`` needs ``Authorization:
Bearer KEY`` (compared in constant time); the administrative routes (``/flush_cache``) are
SGLang's "admin optional" ones: with ``--admin-api-key`` they take that key alone. The admin key
opens every route (SGLang's normal routes take only ``--api-key`` once it is set). A refused
request is answered 401 (403 where SGLang answers so) before its body is read: it reaches no
server.

Internal detail (the servers' URLs, the placement, timing marks) is in answers only for the
operator: with ``--expose-internal-details``, or to a request bearing the admin key. Otherwise
``meta_info.pdd`` and OpenAI's ``metadata`` are left out, ``/health`` and ``/server_info`` name
each server by role and index (``main-0``), and so do ``/metrics``' labels.

TLS, both ways: the router's listener (``--ssl-keyfile``, ``--ssl-certfile``, SGLang's names)
and its calls to ``https://`` servers, verified against ``--server-ssl-ca-certs`` (default: the
system's CAs), presenting ``--server-ssl-certfile`` where the servers ask for a client
certificate.

Owner: the router's event loop; stateless past the config.
"""

from __future__ import annotations

import secrets
import ssl
from typing import Optional
from urllib.parse import urlsplit

from aiohttp import web
from sglang.srt.utils.auth import AuthLevel, decide_request_auth

from pdd_sglang.router.config import RouterConfig

# The router's administrative routes, at SGLang's level for the same routes.
ADMIN_ROUTES = {"/flush_cache": AuthLevel.ADMIN_OPTIONAL}
_DETAIL = web.RequestKey("pdd_internal_detail", bool)


def bearer(key: Optional[str]) -> Optional[bytes]:
    """The Authorization header's value for ``key`` (None: no key, no header)."""
    return None if not key else b"Bearer " + key.encode("latin-1")


def _holds_key(header: Optional[str], key: Optional[str]) -> bool:
    if not key or not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


class FrontDoor:
    def __init__(self, config: RouterConfig):
        self.api_key = config.api_key
        self.admin_api_key = config.admin_api_key
        self.expose = config.expose_internal_details

    @property
    def keyed(self) -> bool:
        return bool(self.api_key or self.admin_api_key)

    def middleware(self):
        """aiohttp middleware: SGLang's decision on each request's key; the answer's detail."""
        door = self

        @web.middleware
        async def check_key(request: web.Request, handler):
            header = request.headers.get("Authorization")
            if _holds_key(header, door.admin_api_key):  # the operator: every route, all detail
                request[_DETAIL] = True
                return await handler(request)
            decision = decide_request_auth(
                method=request.method, path=request.path, authorization_header=header,
                api_key=door.api_key, admin_api_key=door.admin_api_key,
                auth_level=ADMIN_ROUTES.get(request.path, AuthLevel.NORMAL))
            if not decision.allowed:
                status = decision.error_status_code
                return web.json_response({"error": "Unauthorized" if status == 401 else
                                          "Forbidden"}, status=status)
            request[_DETAIL] = door.expose
            return await handler(request)

        return check_key

    def detail(self, request: web.Request) -> bool:
        """Whether this request's answer may carry internal detail."""
        return request.get(_DETAIL, self.expose)


def server_names(pool) -> dict[str, str]:
    """URL -> the name it goes by in answers without detail (its role and index: ``relay-0``)."""
    return {u.url: f"{role}-{index}" for role, group in pool.by_role.items()
            for index, u in enumerate(group)}


def without_urls(text: bytes, pool) -> bytes:
    """``text`` (the metrics' exposition) with every server's URL label as its name."""
    for url, name in server_names(pool).items():
        text = text.replace(b'"%s"' % url.encode(), b'"%s"' % name.encode())
    return text


def without_addresses(message: str, pool) -> str:
    """A failure's message with each server's URL, and its host:port, as its name."""
    for url, name in server_names(pool).items():
        message = message.replace(url, name).replace(urlsplit(url).netloc, name)
    return message


def health_view(view: list[dict], pool) -> list[dict]:
    """The router's /health body with each server's name for its URL."""
    names = server_names(pool)
    return [{**row, "url": names[row["url"]]} for row in view]


def meta_for_client(meta: dict, detail: bool) -> dict:
    """A /generate chunk's meta_info: the router's ``pdd`` summary only with detail."""
    if detail or "pdd" not in meta:
        return meta
    return {key: value for key, value in meta.items() if key != "pdd"}


def upstream_keys(config: RouterConfig) -> tuple[Optional[bytes], Optional[bytes]]:
    """The Authorization values the router sends its servers: on every call, and on their
    administrative routes (their admin key, else the same key)."""
    key = bearer(config.server_api_key)
    return key, bearer(config.server_admin_api_key) or key


def listener_tls(config: RouterConfig) -> Optional[ssl.SSLContext]:
    """The router's own TLS (None: plain HTTP)."""
    if not config.ssl_certfile:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    return context


def upstream_tls(config: RouterConfig) -> ssl.SSLContext:
    """How the router checks https:// servers and proves itself to them."""
    context = ssl.create_default_context(cafile=config.server_ssl_ca_certs)
    if config.server_ssl_certfile:
        context.load_cert_chain(config.server_ssl_certfile, config.server_ssl_keyfile)
    return context
