"""Protocol version. Peers with a different major version refuse each other."""

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 1  # 1.1: BatchLayout.prefill_lens, NewRequest.client_req_id
PROTOCOL_VERSION = f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"
