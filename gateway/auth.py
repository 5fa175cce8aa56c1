"""API keys, tenants and admin access.

Trust model, in short (README has the whole of it):

* **Keys name tenants.** A client's tenant is the one its API key was configured with, never a
  value the client sends. Keys are held only as digests: ``--api-key KEY:TENANT`` keeps the
  SHA-256 of the key in memory, ``--api-keys-file`` holds salted digests
  (``TENANT sha256$SALT$DIGEST``, written by ``python -m gateway.auth hash-key``) and is read
  again on SIGHUP.
* **Tenants leave the process only as keyed hashes.** :class:`TenantHasher` turns a tenant name
  into an HMAC-SHA256 id under a server secret (``--tenant-secret``): that id is what Redis
  telemetry and fingerprints see. The cache namespace sent to workers is a second HMAC over that
  id *and* the client's ``cache_salt``, so a salt can narrow a tenant's namespace but never
  select another tenant's.
* **Admin is separate.** ``/admin/*``, the status page's data (``/ui/data``; the page itself is
  static and asks for the token) and ``/metrics`` with ``--metrics-auth`` need the admin
  token, or a request on the loopback ``--admin-port``. With no key, no token and no admin port
  configured the gateway is open, as for local development (it listens on 127.0.0.1 then).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from gateway.contracts.engine_paths import is_client_api
from gateway.errors import GatewayError
from gateway.values import value

log = logging.getLogger(__name__)

HASH_SCHEME = "sha256"
ROUTE_HEADER_PREFIXES = ("x-route-", "x-prefix-", "x-cache-", "server-timing")
ADMIN_TOKEN_HEADER = "x-admin-token"
_OPEN_MODE_SECRET = b"affinity-gateway/open-mode"
_VERIFIED_CACHE = 4096


class Unauthorized(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": 'Bearer realm="gateway"'})


class Forbidden(GatewayError):
    status = 403
    type = "invalid_request_error"
    code = "forbidden"


@value
class Identity:
    """Who sent a request: the tenant (as configured), its keyed id, admin rights."""

    tenant: str
    tenant_id: str
    admin: bool = False


ANONYMOUS = Identity("", "")  # a request no key identified
IDENTITY_KEY = web.RequestKey("identity", Identity)


def read_secret(value: str, path: str, what: str) -> str:
    """A secret given directly or in a file (its first line); the file wins."""
    if not path:
        return value
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {path!r}: {exc.strerror}") from exc
    if not text:
        raise ValueError(f"the {what} file {path!r} is empty")
    return text.splitlines()[0].strip()


def _key_bytes(key: str) -> bytes:
    # A header that was not UTF-8 arrives with surrogates in it; it still hashes (and fails).
    return key.encode("utf-8", "surrogatepass")


def hash_key(key: str, salt: bytes | None = None) -> str:
    """The stored form of an API key: ``sha256$SALT$DIGEST`` (hex), digest of salt + key."""
    salt = secrets.token_bytes(16) if salt is None else salt
    digest = hashlib.sha256(salt + _key_bytes(key)).hexdigest()
    return f"{HASH_SCHEME}${salt.hex()}${digest}"


@dataclass(frozen=True, slots=True)
class _SaltedKey:
    tenant: str
    salt: bytes
    digest: bytes


def parse_keys_file(text: str, source: str = "keys file") -> list[_SaltedKey]:
    """Lines ``TENANT sha256$SALT$DIGEST``; blank lines and ``#`` comments are skipped."""
    entries: list[_SaltedKey] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        fields = parts[1].split("$") if len(parts) == 2 else []
        if len(fields) != 3 or fields[0] != HASH_SCHEME:
            raise ValueError(f"{source} line {number}: expected 'TENANT {HASH_SCHEME}$SALT$DIGEST'"
                             " (a salted hash, never a key)")
        try:
            salt, digest = bytes.fromhex(fields[1]), bytes.fromhex(fields[2])
        except ValueError as exc:
            raise ValueError(f"{source} line {number}: salt and digest must be hex") from exc
        if len(digest) != 32 or len(salt) < 8:
            raise ValueError(f"{source} line {number}: digest must be 32 bytes, salt >= 8")
        entries.append(_SaltedKey(parts[0], salt, digest))
    return entries


class KeyStore:
    """API key -> tenant. Plain keys are kept as SHA-256 digests; file entries are salted."""

    def __init__(self, plain: Sequence[str] = (), keys_file: str = "") -> None:
        self._plain: dict[bytes, str] = {}
        for spec in plain:
            key, sep, tenant = spec.rpartition(":")
            if not sep:
                key, tenant = spec, ""
            if not key:
                raise ValueError("an --api-key must not be empty")
            digest = hashlib.sha256(_key_bytes(key)).digest()
            self._plain[digest] = tenant or "key-" + digest.hex()[:12]
        self._file = keys_file
        self._salted: list[_SaltedKey] = []
        self._verified: dict[bytes, str] = {}
        if keys_file:
            self.reload()

    @property
    def configured(self) -> bool:
        return bool(self._plain or self._salted or self._file)

    def __len__(self) -> int:
        return len(self._plain) + len(self._salted)

    def reload(self) -> int:
        """Read the keys file again; on any error the keys in use stay as they were."""
        try:
            text = Path(self._file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read --api-keys-file {self._file!r}: {exc.strerror}") from exc
        self._salted = parse_keys_file(text, self._file)
        self._verified = {}
        return len(self._salted)

    def tenant_of(self, key: str) -> str | None:
        raw = _key_bytes(key)
        quick = hashlib.sha256(raw).digest()
        tenant = self._plain.get(quick) or self._verified.get(quick)
        if tenant is not None:
            return tenant
        for entry in self._salted:
            if hmac.compare_digest(hashlib.sha256(entry.salt + raw).digest(), entry.digest):
                if len(self._verified) >= _VERIFIED_CACHE:
                    self._verified.clear()
                self._verified[quick] = entry.tenant
                return entry.tenant
        return None


class TenantHasher:
    """Keyed hashes of tenant names and cache namespaces (HMAC-SHA256 under a server secret)."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        # The pins' key, derived from the secret (BLAKE2b takes keys of up to 64 bytes).
        self._pin_key = hmac.new(secret, b"pin", hashlib.sha256).digest()
        # Namespaces already derived (every request needs one; few distinct ones recur).
        self._namespaces: dict[tuple[str, str], str] = {}

    def tenant_id(self, tenant: str) -> str:
        if not tenant:
            return ""
        mac = hmac.new(self._secret, b"tenant\x00" + _key_bytes(tenant), hashlib.sha256)
        return mac.hexdigest()[:24]

    def pin_name(self, tenant_id: str, response_id: str) -> str:
        """The store's name for a tenant's stored response (:mod:`gateway.response_pins`):
        another tenant's request for the same id names another pin. Keyed BLAKE2b, a MAC in
        one call (once per Responses answer and per request naming one)."""
        msg = tenant_id.encode() + b"\x00" + _key_bytes(response_id)
        return "resp-" + hashlib.blake2b(msg, digest_size=16, key=self._pin_key).hexdigest()

    def namespace(self, tenant_id: str, cache_salt: str) -> str:
        """The cache namespace of a tenant's request: always derived here, the client's salt
        only ever adds to it."""
        known = self._namespaces.get((tenant_id, cache_salt))
        if known is not None:
            return known
        msg = b"ns\x00" + tenant_id.encode() + b"\x00" + _key_bytes(cache_salt)
        namespace = "ns-" + hmac.new(self._secret, msg, hashlib.sha256).hexdigest()[:32]
        if len(self._namespaces) >= _VERIFIED_CACHE:
            self._namespaces.clear()
        self._namespaces[tenant_id, cache_salt] = namespace
        return namespace


def _bearer(request: web.Request) -> str:
    auth = request.headers.get("Authorization", "")
    scheme, _, value = auth.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def _local_port(request: web.Request) -> int | None:
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if isinstance(sockname, tuple) and len(sockname) >= 2 and isinstance(sockname[1], int):
        return sockname[1]
    return None


class Auth:
    """The access rules of one gateway, checked by :meth:`middleware`."""

    def __init__(
        self,
        keys: KeyStore,
        hasher: TenantHasher,
        *,
        admin_token: str = "",
        admin_port: int = 0,
        metrics_auth: bool = False,
        route_headers: str = "",
    ) -> None:
        self.keys = keys
        self.hasher = hasher
        self._admin_token = admin_token
        self._admin_port = admin_port
        self._metrics_auth = metrics_auth
        self.route_headers = route_headers or ("none" if keys.configured else "all")

    @property
    def open_admin(self) -> bool:
        """No key, no admin token, no admin port: the local-development default."""
        return not (self.keys.configured or self._admin_token or self._admin_port)

    def is_admin(self, request: web.Request, *, bearer_counts: bool) -> bool:
        if self._admin_port and _local_port(request) == self._admin_port:
            return True
        if not self._admin_token:
            return False
        presented = request.headers.get(ADMIN_TOKEN_HEADER, "")
        if not presented and bearer_counts:
            presented = _bearer(request)
        return bool(presented) and hmac.compare_digest(
            _key_bytes(presented), _key_bytes(self._admin_token)
        )

    def identify(self, request: web.Request) -> Identity:
        """The tenant of a client API request (``/v1/*``, the engine API); raises
        :class:`Unauthorized` without a valid key."""
        key = _bearer(request)
        admin = self.is_admin(request, bearer_counts=False)
        if not self.keys.configured:
            # Open mode: each distinct bearer value is its own tenant, as a courtesy.
            tenant = "bearer:" + key if key else ""
            return Identity(tenant, self.hasher.tenant_id(tenant), admin)
        if not key:
            raise Unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'."
            )
        known = self.keys.tenant_of(key)
        if known is None:
            raise Unauthorized("Incorrect API key provided.")
        return Identity(known, self.hasher.tenant_id(known), admin)

    def check_admin(self, request: web.Request) -> None:
        if self.open_admin or self.is_admin(request, bearer_counts=True):
            return
        if self._admin_token:
            raise Unauthorized("this endpoint needs the admin token")
        raise Forbidden("admin endpoints are served only on the admin port or with "
                        "--admin-token configured")

    def show_route_headers(self, identity: Identity) -> bool:
        if self.route_headers == "all":
            return True
        return self.route_headers == "admin" and identity.admin

    def admit(self, request: web.Request) -> None:
        """Let a request through to its handler or raise :class:`Unauthorized` /
        :class:`Forbidden`; a client API request's identity is kept on it (``IDENTITY_KEY``)."""
        path = request.path
        if is_client_api(path):
            request[IDENTITY_KEY] = self.identify(request)
        elif (path.startswith(("/admin/", "/ui/data"))
              or (path == "/metrics" and self._metrics_auth)):
            self.check_admin(request)

    def hide_route_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """Before a response goes out: drop the routing and cache headers that this caller
        may not see."""
        if not is_client_api(request.path):
            return
        identity = request.get(IDENTITY_KEY)
        if identity is not None and self.show_route_headers(identity):
            return
        for name in [h for h in response.headers if h.lower().startswith(ROUTE_HEADER_PREFIXES)]:
            del response.headers[name]


AUTH_KEY = web.AppKey("auth", Auth)


def tenant_secret(configured: str, *, keys_configured: bool, shared_store: bool) -> bytes:
    """The HMAC secret: the configured one; in open mode a fixed one (nothing is secret
    there); with keys but no secret a random one, which only a lone gateway can use."""
    if configured:
        return configured.encode("utf-8")
    if not keys_configured:
        return _OPEN_MODE_SECRET
    if shared_store:
        raise ValueError("API keys with a shared store need --tenant-secret (or "
                         "GATEWAY_TENANT_SECRET / --tenant-secret-file), the same on every "
                         "replica, so that replicas agree on tenant ids and cache namespaces")
    log.info("no --tenant-secret: tenant namespaces are keyed by a random secret and change "
             "when the gateway restarts")
    return secrets.token_bytes(32)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gateway.auth hash-key TENANT``: reads a key on stdin, prints a keys-file
    line; ``python -m gateway.auth new-key TENANT`` also makes the key (printed to stderr)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] not in ("hash-key", "new-key") or not args[1].strip():
        print("usage: python -m gateway.auth hash-key TENANT < key\n"
              "       python -m gateway.auth new-key TENANT", file=sys.stderr)
        return 2
    tenant = args[1].strip()
    if any(c.isspace() for c in tenant) or ":" in tenant:
        print("a tenant name contains no spaces and no ':'", file=sys.stderr)
        return 2
    if args[0] == "new-key":
        key = "sk-" + secrets.token_urlsafe(32)
        print(key, file=sys.stderr)
    else:
        key = sys.stdin.readline().strip()
        if not key:
            print("no key on stdin", file=sys.stderr)
            return 2
    print(f"{tenant} {hash_key(key)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
