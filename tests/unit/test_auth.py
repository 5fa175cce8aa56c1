"""Keys, tenant hashes, URL redaction and registry trust: the pure parts of access control."""

from __future__ import annotations

import pytest

from gateway.auth import KeyStore, TenantHasher, hash_key, parse_keys_file, tenant_secret
from gateway.contracts.redact import redact_url
from gateway.credentials import worker_key, worker_keys
from gateway.registry_trust import trusted_capacities
from gateway.store.base import WorkerRecord
from gateway.store.redis import RedisStore


def test_plain_keys_name_their_tenant_and_nothing_else_matches() -> None:
    keys = KeyStore(["sk-alpha:acme", "sk-beta:globex", "sk-gamma"])
    assert keys.tenant_of("sk-alpha") == "acme"
    assert keys.tenant_of("sk-beta") == "globex"
    assert (keys.tenant_of("sk-gamma") or "").startswith("key-")
    assert keys.tenant_of("sk-alpha ") is None
    assert keys.tenant_of("acme") is None
    assert keys.tenant_of("") is None
    assert keys.tenant_of("\udcff\udcfe") is None  # a non-UTF-8 header, surrogate-escaped


def test_keys_file_holds_salted_hashes_only(tmp_path: pytest.TempPathFactory) -> None:
    line = f"acme {hash_key('sk-file-key')}"
    assert "sk-file-key" not in line
    assert hash_key("k") != hash_key("k")  # a fresh salt each time
    path = tmp_path / "keys"  # type: ignore[operator]
    path.write_text(f"# tenants\n{line}\n\n")
    keys = KeyStore(keys_file=str(path))
    assert keys.tenant_of("sk-file-key") == "acme"
    assert keys.tenant_of("sk-file-key") == "acme"  # the verified-key cache answers the same
    assert keys.tenant_of("sk-other") is None
    path.write_text(f"globex {hash_key('sk-new')}\n")
    assert keys.reload() == 1
    assert keys.tenant_of("sk-file-key") is None
    assert keys.tenant_of("sk-new") == "globex"


@pytest.mark.parametrize("text", [
    "acme sk-plaintext-key",
    "acme md5$00$11",
    "acme sha256$zz$" + "0" * 64,
    "acme sha256$0011223344556677$abcd",
    "sha256$0011223344556677$" + "0" * 64,
])
def test_keys_file_rejects_plaintext_and_malformed_lines(text: str) -> None:
    with pytest.raises(ValueError, match="line 1"):
        parse_keys_file(text)


def test_tenant_ids_and_namespaces_are_keyed_and_combine_the_salt() -> None:
    a, b = TenantHasher(b"secret-a"), TenantHasher(b"secret-b")
    assert a.tenant_id("acme") != b.tenant_id("acme")  # keyed: the secret matters
    assert a.tenant_id("acme") == a.tenant_id("acme")
    assert "acme" not in a.tenant_id("acme")
    assert a.tenant_id("") == ""
    acme, globex = a.tenant_id("acme"), a.tenant_id("globex")
    # The same client salt never lands two tenants in one namespace...
    assert a.namespace(acme, "s") != a.namespace(globex, "s")
    # ...and no salt reaches another tenant's namespace: the salt only adds to the tenant's.
    assert a.namespace(acme, "") != a.namespace(globex, "")
    assert a.namespace(globex, a.namespace(acme, "")) != a.namespace(acme, "")
    assert a.namespace(acme, "x") != a.namespace(acme, "y")
    assert a.namespace(acme, "\ud800") != a.namespace(acme, "")  # lone surrogates still hash


def test_tenant_secret_rules() -> None:
    assert tenant_secret("s3", keys_configured=True, shared_store=True) == b"s3"
    assert tenant_secret("", keys_configured=False, shared_store=True) == \
        tenant_secret("", keys_configured=False, shared_store=False)
    with pytest.raises(ValueError, match="tenant-secret"):
        tenant_secret("", keys_configured=True, shared_store=True)
    assert tenant_secret("", keys_configured=True, shared_store=False) != \
        tenant_secret("", keys_configured=True, shared_store=False)


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:hunter2@10.0.0.5:6380/0", "redis://***@10.0.0.5:6380/0"),
    ("redis://app:hunter2@cache.internal/1", "redis://app:***@cache.internal/1"),
    ("rediss://cache.internal:6379/0?password=hunter2&ssl_cert_reqs=none",
     "rediss://cache.internal:6379/0?password=***&ssl_cert_reqs=none"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("memory://", "memory://"),
])
def test_urls_are_shown_without_passwords(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "hunter2" not in RedisStore(url).url


def test_worker_keys_come_from_env_or_file(tmp_path: pytest.TempPathFactory) -> None:
    secret_file = tmp_path / "vllm-key"  # type: ignore[operator]
    secret_file.write_text("file-key\n")
    env = {"VLLM_KEY": "env-key"}
    assert worker_key("vllm+http://h:1?api_key_env=VLLM_KEY", env) == "env-key"
    assert worker_key(f"vllm+http://h:2?api_key_file={secret_file}", env) == "file-key"
    assert worker_key("http://h:3", env) == ""
    assert worker_keys(["vllm+http://h:1?api_key_env=VLLM_KEY", "http://h:3"], env) == {
        "h:1": "env-key"}
    with pytest.raises(ValueError, match="not set"):
        worker_key("http://h:1?api_key_env=MISSING", env)
    with pytest.raises(ValueError, match="one of"):
        worker_key("http://h:1?api_key=inline", env)


def _record(wid: str, blocks: int, kind: str = "openai") -> WorkerRecord:
    return WorkerRecord(id=wid, url=f"http://{wid}", models=("m",), capacity_blocks=blocks,
                        block_size=16, kind=kind)


def test_registry_claims_count_only_as_far_as_probes_confirm() -> None:
    records = [_record("a:1", 1000), _record("b:1", 1000), _record("liar:1", 10**9)]
    probed = {"a:1": 16_000.0, "b:1": 16_000.0, "liar:1": 16_000.0}
    trusted = trusted_capacities(records, probed, max_weight=4.0)
    assert trusted.weights == {"a:1": 1.0, "b:1": 1.0, "liar:1": 1.0}
    # A worker whose own probe does not tell its cache size gets the default weight.
    trusted = trusted_capacities(records, {"a:1": 16_000.0, "b:1": 16_000.0}, max_weight=4.0)
    assert trusted.weights["liar:1"] == 1.0
    assert "liar:1" not in trusted.capacity_tokens
    # A worker that really is bigger is believed, up to the cap.
    trusted = trusted_capacities(records, {**probed, "liar:1": 10**12}, max_weight=4.0)
    assert trusted.weights["liar:1"] == 4.0
    assert trusted.weights["a:1"] == 1.0


def test_sagemaker_claims_are_capped_without_a_probe() -> None:
    records = [_record("sm:a", 1000, "sagemaker"), _record("sm:b", 3000, "sagemaker"),
               _record("sm:c", 10**9, "sagemaker")]
    weights = trusted_capacities(records, {}, max_weight=4.0).weights
    assert weights == {"sm:a": 1 / 3, "sm:b": 1.0, "sm:c": 4.0}
