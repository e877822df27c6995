"""A stage: its sidecar process (or the one it attaches to), its engine, the link to its sidecar."""
