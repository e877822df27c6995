"""One connection to one sidecar: handshake, arenas, and messages over the socket and the shared-memory rings."""
