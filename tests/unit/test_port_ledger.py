"""The port ledger: ports under the kernel's ephemeral range, never the same one twice."""

from __future__ import annotations

import socket
from pathlib import Path

from infra.procs import EPHEMERAL_RANGE, PortLedger, listen_ports


def test_ports_come_from_under_the_ephemeral_range() -> None:
    floor = int(Path(EPHEMERAL_RANGE).read_text().split()[0])
    ports = listen_ports()
    if floor - ports.start >= 4_096:
        assert ports.stop == floor
    ledger = PortLedger()
    assert all(p in ports for p in (ledger.take() for _ in range(50)))


def test_a_port_not_yet_bound_is_not_given_again() -> None:
    """Servers are started one after the other: the second must not get the first's port
    although nothing listens on it yet."""
    ledger = PortLedger(range(20_000, 20_064))
    given = [ledger.take() for _ in range(40)]
    assert len(set(given)) == 40


def test_a_busy_port_is_skipped() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ledger = PortLedger(range(port, port + 3))
        assert ledger.take() != port
        assert ledger.take() != port


def test_blocks_are_consecutive_free_ports_and_wrap_at_the_end() -> None:
    ledger = PortLedger(range(21_000, 21_010))
    first = ledger.take(4)
    second = ledger.take(4)
    assert first != second
    assert {first, second} <= set(range(21_000, 21_007))
    for base in (first, second):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", base + 3))
