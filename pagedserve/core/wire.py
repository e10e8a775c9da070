"""Conventions both processes and every client share, beyond the messages in pagedserve.protos."""

from __future__ import annotations

# gRPC health service names: "" is liveness (SERVING while the scheduler process answers), the
# API's full service name is readiness (SERVING while a warmed-up executor is connected and the
# server is not draining).
HEALTH_LIVENESS = ""
HEALTH_READINESS = "pagedserve.v1.Generation"

# A token id not known yet: sampled by a step still in flight (the scheduler's async planning)
# or sampled on the device and not read back (the executor's launch-ahead). Never sent.
PENDING_TOKEN = -1
