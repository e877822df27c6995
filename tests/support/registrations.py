"""A model registration for tests/test_serve_units.py: notes each call."""

CALLS: list[str] = []


def note() -> None:
    CALLS.append("called")
