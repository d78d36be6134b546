"""The site agent's Prometheus metrics (docs/metrics.md), served at ``/metrics`` on its HTTP port."""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Histogram

from better_compute.service.metrics import LATENCY_BUCKETS

__all__ = ["BMC_CALL_ERRORS", "BMC_CALL_SECONDS", "BMC_CREDENTIALS"]

BMC_CALL_SECONDS: Final = Histogram(
    "bc_bmc_call_duration_seconds",
    "One BMC operation through a driver (credential fetch included), by driver, operation and"
    " outcome (ok or error)",
    ["driver", "operation", "outcome"],
    buckets=LATENCY_BUCKETS,
)
BMC_CALL_ERRORS: Final = Counter(
    "bc_bmc_call_errors_total",
    "BMC operations that failed, by driver, operation and error code",
    ["driver", "operation", "code"],
)
BMC_CREDENTIALS: Final = Counter(
    "bc_bmc_credentials_total",
    "BMC credentials a command used, by where they came from: the secrets gate (fetched) or kept"
    " in memory from a fetch of the last bmc.credentials_keep_seconds (kept)",
    ["source"],
)
