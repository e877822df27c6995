"""Which sidecar serves the shim and what it has been told: loss, reconnect, hot-upgrade hand-over, request notices."""
