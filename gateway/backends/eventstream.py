"""AWS event-stream framing (encoder) and the line re-splitting of streamed payload bytes.

botocore ships the event-stream *decoder* (used through aiobotocore by the SageMaker backend);
the encoder here is what our SageMaker-runtime test server speaks, and what the unit tests check
against botocore's decoder. One message on the wire::

    prelude   total length (u32 BE) | headers length (u32 BE) | CRC32 of those 8 bytes (u32 BE)
    headers   repeated: name length (u8) | name (UTF-8) | type (u8, 7 = string)
              | value length (u16 BE) | value (UTF-8)
    payload   bytes
    trailer   CRC32 of everything above (u32 BE)

SageMaker's ``InvokeEndpointWithResponseStream`` sends ``PayloadPart`` events whose bytes are cut
at arbitrary offsets (mid-line, mid-UTF-8 character): :class:`LineBuffer` puts lines back
together before anything is parsed or relayed.
"""

from __future__ import annotations

import json
import struct
from binascii import crc32
from collections.abc import Iterator, Mapping

_STRING = 7
_PRELUDE = struct.Struct(">II")


def _header(name: str, value: str) -> bytes:
    raw_name, raw_value = name.encode("utf-8"), value.encode("utf-8")
    if len(raw_name) > 255 or len(raw_value) > 65535:
        raise ValueError(f"event-stream header {name!r} is too long")
    return bytes([len(raw_name)]) + raw_name + bytes([_STRING]) + struct.pack(
        ">H", len(raw_value)
    ) + raw_value


def encode_message(headers: Mapping[str, str], payload: bytes) -> bytes:
    """One event-stream message with string headers, both CRCs filled in."""
    raw_headers = b"".join(_header(k, v) for k, v in headers.items())
    total = _PRELUDE.size + 4 + len(raw_headers) + len(payload) + 4
    prelude = _PRELUDE.pack(total, len(raw_headers))
    prelude += struct.pack(">I", crc32(prelude))
    body = prelude + raw_headers + payload
    return body + struct.pack(">I", crc32(body))


def payload_part(data: bytes) -> bytes:
    """A ``PayloadPart`` event carrying ``data`` (its ``Bytes`` member is the event payload)."""
    return encode_message(
        {":message-type": "event", ":event-type": "PayloadPart",
         ":content-type": "application/octet-stream"},
        data,
    )


def stream_exception(kind: str, message: str, error_code: str = "") -> bytes:
    """A modeled stream exception: ``ModelStreamError`` or ``InternalStreamFailure``."""
    body: dict[str, str] = {"Message": message}
    if error_code:
        body["ErrorCode"] = error_code
    return encode_message(
        {":message-type": "exception", ":exception-type": kind,
         ":content-type": "application/json"},
        json.dumps(body).encode("utf-8"),
    )


class LineBuffer:
    """Bytes cut anywhere in, complete lines out (without their ``\\n`` / ``\\r\\n``).

    Decoding happens per complete line, so a UTF-8 character split across two parts is never
    decoded half. ``max_line`` bounds memory against a peer that never sends a newline.
    """

    def __init__(self, max_line: int = 4 * 1024 * 1024) -> None:
        self._pending = bytearray()
        self._max_line = max_line

    def feed(self, data: bytes) -> Iterator[str]:
        self._pending += data
        start = 0
        while (end := self._pending.find(b"\n", start)) >= 0:
            yield self._pending[start:end].rstrip(b"\r").decode("utf-8", "replace")
            start = end + 1
        del self._pending[:start]
        if len(self._pending) > self._max_line:
            raise ValueError(f"a streamed line exceeded {self._max_line} bytes")

    def flush(self) -> Iterator[str]:
        """The last line, if the stream did not end with a newline."""
        if self._pending:
            line = bytes(self._pending).rstrip(b"\r").decode("utf-8", "replace")
            self._pending.clear()
            yield line
