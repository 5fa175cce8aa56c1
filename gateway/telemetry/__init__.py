"""What the gateway tells its operator: Prometheus metrics, OpenTelemetry spans, access logs.

* :mod:`.metrics`: one Prometheus registry per application (no globals);
* :mod:`gateway.contracts.tracing`: OpenTelemetry spans, off unless an OTLP endpoint is
  configured (shared with the worker);
* :mod:`.record`: the per-request record the proxy fills in as the request goes;
* :mod:`.access_log`: one line per request (JSON or text), never prompt text;
* :mod:`.middleware`: request ids, and where the record is turned into all of the above.
"""

from gateway.telemetry.metrics import GatewayMetrics

__all__ = ["GatewayMetrics"]
