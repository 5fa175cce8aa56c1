"""TLS: HTTPS on the gateway's client port (``--tls-cert-file``, ``--tls-key-file``), and to
``https://`` workers (``--worker-ca-file``, ``--worker-cert-file``, ``--worker-key-file``).

API keys travel in a header: on a network, plain HTTP shows them to anyone on the path. With a
certificate and its key (PEM; the certificate file may hold the chain) the client port speaks
TLS 1.2 or newer only; the loopback admin port stays plain HTTP. SIGHUP reads both files again
(a renewed certificate takes effect for new connections, without a restart; a pair that does
not load keeps the previous one and is logged).

To workers: an ``https://`` worker's certificate is verified against the system's CAs, or
against ``--worker-ca-file`` (a private CA's bundle) instead; with ``--worker-cert-file`` and
``--worker-key-file`` the gateway presents that client certificate, for workers that accept only
callers they know (mutual TLS). The health probes and the relay use the same context.
"""

from __future__ import annotations

import logging
import ssl

log = logging.getLogger(__name__)


class ServerTLS:
    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load(self.context)

    def _load(self, context: ssl.SSLContext) -> None:
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the TLS certificate {self.cert_file!r} and key "
                             f"{self.key_file!r}: {exc}") from exc

    def reload(self) -> bool:
        """Read the certificate and key again; on failure the previous pair stays in use."""
        try:
            self._load(self.context)
        except ValueError as exc:
            log.error("SIGHUP: %s; the previous certificate stays in use", exc)
            return False
        log.info("SIGHUP: TLS certificate reloaded from %s", self.cert_file)
        return True


def server_tls(cert_file: str, key_file: str) -> ServerTLS | None:
    """The client port's TLS, or None without a certificate (plain HTTP)."""
    return ServerTLS(cert_file, key_file) if cert_file else None


def worker_context(ca_file: str, cert_file: str, key_file: str) -> ssl.SSLContext | None:
    """The TLS context of connections to ``https://`` workers (None: the system's defaults).
    Raises ValueError for files that do not load."""
    if not (ca_file or cert_file):
        return None
    try:
        context = ssl.create_default_context(cafile=ca_file or None)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if cert_file:
            context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the workers' TLS files ({ca_file or cert_file!r}): "
                         f"{exc}") from exc
    return context
