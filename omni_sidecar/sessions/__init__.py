"""One shim connection's session: its requests, arenas, appends, plans ahead and finished outputs."""
