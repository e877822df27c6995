"""Hook bugs stay per request: a hook's exception becomes errors of the requests it names.

A step's hooks run in the sidecar for every request of a session; one request's bad payload or one
hook bug must fail only the requests concerned (their clients get RequestFailed), never the
session or the sidecar. `HookErrors` names its requests; any other exception fails the requests the
call was for, logged once with its traceback.
"""

from __future__ import annotations

import logging

from omni_sidecar.hook_api.hook_set import HookErrors, StepBatch

log = logging.getLogger("omni_sidecar.hooks")


class collect_hook_errors:
    """Turns hook exceptions into per-request errors; a hook bug never escapes."""

    def __init__(self, errors: dict[str, str], batch: StepBatch | None, where: str,
                 req_ids: list[str] | None = None) -> None:
        self.errors = errors
        self.where = where
        self.req_ids = req_ids if req_ids is not None else (batch.req_ids if batch else [])

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        absorb_hook_error(self.errors, exc, self.where, self.req_ids)
        return True


def absorb_hook_error(errors: dict[str, str], exc: Exception, where: str, req_ids: list[str]) -> None:
    """A hook's exception as per-request errors (HookErrors name theirs; anything else hits `req_ids`)."""
    if isinstance(exc, HookErrors):
        for req_id, message in exc.errors.items():
            errors.setdefault(req_id, message)
        return
    log.error("%s raised %r", where, exc, exc_info=(type(exc), exc, exc.__traceback__))
    for req_id in req_ids:
        errors.setdefault(req_id, f"{where}: {exc!r}")
