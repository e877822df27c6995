"""One step with the sidecar: what it sends and waits for, the plan read before the forward, the record after."""
