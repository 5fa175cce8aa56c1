"""The backend registry: each kind declares its schemes, ids, target URLs and factory, and the
pool, credentials and registry trust follow what it declares."""

from __future__ import annotations

import pytest

from gateway.backends.kinds import BackendOptions
from gateway.backends.registry import DEFAULT, KINDS, build_backends, kind_named, kind_of_url
from gateway.credentials import worker_key
from gateway.pool import WorkerPool, worker_id_for
from gateway.registry_trust import trusted_capacities
from gateway.routing.prefix_index import PrefixIndex
from gateway.store.base import WorkerRecord

OPTIONS = BackendOptions(connect_timeout_s=1.0, read_timeout_s=1.0, max_connections=4,
                         max_connections_per_worker=2)


def test_names_and_schemes_are_unique() -> None:
    names = [k.name for k in KINDS]
    schemes = [s for k in KINDS for s in k.schemes]
    assert len(set(names)) == len(names)
    assert len(set(schemes)) == len(schemes)
    assert all(kind_named(name) is kind for name, kind in zip(names, KINDS, strict=True))
    assert kind_named("no-such-kind") is None


@pytest.mark.parametrize(("url", "kind", "wid", "target"), [
    ("http://10.0.0.1:8001", "openai", "10.0.0.1:8001", "http://10.0.0.1:8001"),
    ("https://w.example", "openai", "w.example:443", "https://w.example"),
    ("vllm+http://h:8000?api_key_env=K", "vllm", "h:8000", "http://h:8000"),
    ("sagemaker://ep?variant=A&region=us-east-1", "sagemaker", "sm:us-east-1/ep/A",
     "sagemaker://ep?variant=A&region=us-east-1"),
])
def test_a_url_is_read_by_the_kind_of_its_scheme(url: str, kind: str, wid: str,
                                                  target: str) -> None:
    assert kind_of_url(url).name == kind
    assert worker_id_for(url) == wid
    pool = WorkerPool([url], PrefixIndex())
    (state,) = pool.states()
    assert (state.worker.id, state.worker.kind, state.worker.url) == (wid, kind, target)


def test_an_unknown_scheme_is_rejected_by_the_default_kind() -> None:
    assert kind_of_url("ftp://h:21") is DEFAULT
    with pytest.raises(ValueError, match="http://host:port"):
        worker_id_for("ftp://h:21")


def test_one_backend_per_kind() -> None:
    backends = build_backends(OPTIONS)
    assert set(backends) == {k.name for k in KINDS}
    assert len({id(b) for b in backends.values()}) == len(KINDS)


def test_the_query_names_credentials_only_where_the_kind_says_so() -> None:
    env = {"K": "secret"}
    assert worker_key("vllm+http://h:8000?api_key_env=K", env) == "secret"
    assert worker_key("sagemaker://ep?variant=A", env) == ""


def test_unconfirmed_capacity_is_believed_only_for_kinds_that_say_so() -> None:
    records = [WorkerRecord("a", "sagemaker://a", capacity_blocks=100, kind="sagemaker"),
               WorkerRecord("b", "http://b:1", capacity_blocks=100, kind="openai"),
               WorkerRecord("c", "http://c:1", capacity_blocks=100, kind="unknown")]
    trusted = trusted_capacities(records, {}, max_weight=4.0)
    assert set(trusted.capacity_tokens) == {"a"}
