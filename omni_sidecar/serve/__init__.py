"""The serving loop: the socket, the shim connections and their rings, control clients' queries."""
