"""Protocol version. Peers with a different major version refuse each other.

The minor counts fields added later (each with a default, so an older peer's message still
decodes): it is reported, never branched on.
"""

PROTOCOL_MAJOR = 2
PROTOCOL_MINOR = 1
PROTOCOL_VERSION = f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"
