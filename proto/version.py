"""Protocol version. Peers with a different major version refuse each other."""

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 2  # 1.1: BatchLayout.prefill_lens, NewRequest.client_req_id; 1.2: StepStart
PROTOCOL_VERSION = f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"
