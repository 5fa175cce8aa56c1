"""HTTPS on the client port: ``python -m gateway --tls-cert-file --tls-key-file`` as a process,
the official ``openai`` client over TLS, the admin port in plain HTTP, a certificate renewed
by SIGHUP, and bad files refused at start."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import ipaddress
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import aiohttp
import httpx2
import openai
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gateway.contracts.httpserver import JsonErrorRunner
from tests.conftest import FAST_WORKER, MODEL, Processes, StartCluster, free_port
from worker.server import create_app as create_worker

KEY = "sk-acme-1"


def issued(directory: Path, name: str, ca: tuple[Path, Path] | None,
           client: bool = False) -> tuple[Path, Path]:
    """A certificate named ``name``, for 127.0.0.1 unless ``client``: self-signed (``ca``
    None: it is its own CA) or issued by ``ca`` (its certificate and key files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    if ca is None:
        issuer, signer = subject, key
    else:
        ca_cert = x509.load_pem_x509_certificate(ca[0].read_bytes())
        issuer = ca_cert.subject
        signer = serialization.load_pem_private_key(ca[1].read_bytes(), None)  # type: ignore[assignment]
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None),
                              critical=True))
    if not client:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(signer, hashes.SHA256())
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return cert_path, key_path


def served_name(port: int) -> str:
    """The common name of the certificate the server at ``port`` presents now."""
    pem = ssl.get_server_certificate(("127.0.0.1", port))
    cert = x509.load_pem_x509_certificate(pem.encode())
    return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


async def wait_https(url: str, context: ssl.SSLContext, timeout_s: float = 60) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(url + "/health", ssl=context) as r:
                    if r.status == 200:
                        return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{url} did not come up")
            await asyncio.sleep(0.2)


async def test_the_client_port_speaks_tls(processes: Processes, tmp_path: Path) -> None:
    cert, key = issued(tmp_path, "first", None)
    worker_url, _ = await processes.worker()
    port, admin = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--port", str(port), "--worker", worker_url,
        "--api-key", f"{KEY}:acme", "--admin-port", str(admin),
        "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    processes.procs.append(proc)
    trusted = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{port}"
    await wait_https(url, trusted)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0,
                                  http_client=httpx2.AsyncClient(verify=trusted)) as client:
        chat = await client.chat.completions.create(
            model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "over tls"}])
    assert chat.choices[0].message.content
    async with aiohttp.ClientSession() as http:
        # Plain HTTP on the TLS port gets no answer.
        with pytest.raises((aiohttp.ClientError, OSError)):
            async with http.get(f"http://127.0.0.1:{port}/health") as r:
                await r.read()
        # The loopback admin port stays plain HTTP.
        async with http.get(f"http://127.0.0.1:{admin}/admin/workers") as r:
            assert r.status == 200
    # A renewed certificate is taken on SIGHUP, for new connections, without a restart.
    assert await asyncio.to_thread(served_name, port) == "first"
    renewed_cert, renewed_key = issued(tmp_path, "second", None)
    cert.write_bytes(renewed_cert.read_bytes())
    key.write_bytes(renewed_key.read_bytes())
    proc.send_signal(signal.SIGHUP)
    for _ in range(50):
        if await asyncio.to_thread(served_name, port) == "second":
            break
        await asyncio.sleep(0.1)
    assert await asyncio.to_thread(served_name, port) == "second"
    # A pair that does not load on SIGHUP keeps the previous one.
    key.write_text("not a key")
    proc.send_signal(signal.SIGHUP)
    await asyncio.sleep(0.5)
    assert proc.returncode is None
    assert await asyncio.to_thread(served_name, port) == "second"


@pytest.mark.parametrize("case", ["unreadable", "half", "mismatched", "worker half",
                                  "worker ca missing"])
def test_bad_tls_settings_stop_the_start(tmp_path: Path, case: str) -> None:
    cert, key = issued(tmp_path, "one", None)
    _, other_key = issued(tmp_path, "two", None)
    args, says = {
        "unreadable": (["--tls-cert-file", str(tmp_path / "missing.crt"),
                        "--tls-key-file", str(key)], "tls certificate"),
        "half": (["--tls-cert-file", str(cert)], "go together"),
        "mismatched": (["--tls-cert-file", str(cert), "--tls-key-file", str(other_key)],
                       "tls certificate"),
        "worker half": (["--worker-cert-file", str(cert)], "go together"),
        "worker ca missing": (["--worker-ca-file", str(tmp_path / "missing.pem")],
                              "workers' tls files"),
    }[case]
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--port", str(free_port()),
         "--worker", "https://127.0.0.1:9", *args],
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr.lower()


async def test_https_workers_with_a_private_ca_and_client_certificates(
        start_cluster: StartCluster, tmp_path: Path) -> None:
    ca = issued(tmp_path, "private-ca", None)
    server_cert, server_key = issued(tmp_path, "worker", ca)
    client_cert, client_key = issued(tmp_path, "gateway", ca, client=True)
    # The worker accepts only callers with a certificate its CA issued (mutual TLS).
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca[0]))
    context.load_cert_chain(server_cert, server_key)
    context.verify_mode = ssl.CERT_REQUIRED
    port = free_port()
    runner = JsonErrorRunner(create_worker(dataclasses.replace(FAST_WORKER, port=port)),
                             access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    worker = f"https://127.0.0.1:{port}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        trusted = await start_cluster(
            workers=0, worker=(worker,), worker_ca_file=str(ca[0]),
            worker_cert_file=str(client_cert), worker_key_file=str(client_key))
        no_client_cert = await start_cluster(workers=0, worker=(worker,),
                                              worker_ca_file=str(ca[0]))
        system_cas = await start_cluster(workers=0, worker=(worker,))
        statuses = {}
        async with aiohttp.ClientSession() as http:
            for name, cluster in (("trusted", trusted), ("no client cert", no_client_cert),
                                  ("system CAs", system_cas)):
                async with http.post(cluster.gateway_url + "/v1/chat/completions",
                                     json=body) as r:
                    statuses[name] = r.status
    finally:
        await runner.cleanup()
    # Only the gateway that verifies the worker and presents a certificate gets through.
    assert statuses == {"trusted": 200, "no client cert": 503, "system CAs": 503}
