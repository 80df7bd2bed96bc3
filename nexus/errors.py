"""The API's one exception family: every refusal a tenant or operator can see is a :class:`NexusError`.

Each class carries the HTTP status the gateway answers with (``http_status``) and a stable machine
code (``code``). The message always says what was refused and why (the limit and the value, the
unknown name, the state that forbids the call). Plain Python: raised on both sides of the Dask
connection (exceptions travel pickled, so the class survives the trip; to the scheduler, which unpickles
nothing a worker sends, as plain-valued replies: :func:`to_reply`).
"""

from __future__ import annotations

from typing import Any


class NexusError(Exception):
    """Base of every error the service reports to its users."""

    http_status = 400
    code = "bad_request"

    def __str__(self) -> str:  # KeyError-style subclasses would otherwise quote the message
        return str(self.args[0]) if self.args else self.__class__.__name__


class SpecError(NexusError, ValueError):
    """A tenant spec, job spec, observation or batch that the service refuses; the message says why."""

    http_status = 422
    code = "invalid"


class LimitExceeded(SpecError):
    """A request over a quota or limit; the message names the limit and the value."""

    code = "limit_exceeded"


class NotFound(NexusError, KeyError):
    """An unknown tenant, job or version."""

    http_status = 404
    code = "not_found"


class Conflict(NexusError):
    """A call the object's current state forbids (a second training job, a spec change, a busy scale)."""

    http_status = 409
    code = "conflict"


class Unauthorized(NexusError):
    """No credentials, or credentials the service does not know."""

    http_status = 401
    code = "unauthorized"


class Forbidden(NexusError):
    """Valid credentials that do not cover this tenant or this admin call."""

    http_status = 403
    code = "forbidden"


class Unavailable(NexusError):
    """The service (or the role a call needs) cannot be reached or is restarting; retry later."""

    http_status = 503
    code = "unavailable"


class JobFailed(NexusError, RuntimeError):
    """A job ended in the ``failed`` (or ``cancelled``) state; the message carries the service's reason."""

    http_status = 409
    code = "job_failed"


class RoleLost(Unavailable):
    """A role (actor rank, inference engine, tracker) died or is restarting; the work it held is retried."""

    code = "role_lost"


class Draining(Unavailable):
    """An inference engine being removed refuses new requests; the caller asks for the tenant's route again."""

    code = "draining"


class Overloaded(NexusError):
    """A budget of concurrent requests is spent (the tenant's own or the whole service's): nothing was done;
    retry after ``retry_after_s`` (the gateway answers 429 with a ``Retry-After`` header)."""

    http_status = 429
    code = "overloaded"

    def __init__(self, message: str = "", retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = float(retry_after_s)

    def __reduce__(self):  # the hint survives pickling (exceptions travel between processes)
        return (type(self), (str(self), self.retry_after_s))


class NotSupported(NexusError):
    """A call this service does not offer (a handler another version of the service has)."""

    http_status = 501
    code = "not_supported"


QUOTE_CHARS = 80  # an error message quotes at most this much of a bad value (a 50 MB name is not sent back)


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)``, cut to its first ``limit`` characters (saying how long it was) when it is longer."""
    if isinstance(value, str | bytes) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit + 2 else f"{text[:limit]}... ({len(text)} characters)"


def error_class(name: str) -> type[NexusError]:
    """The NexusError subclass called ``name`` (what the gateway reports), NexusError if unknown."""
    cls = globals().get(name)
    return cls if isinstance(cls, type) and issubclass(cls, NexusError) else NexusError


REPLY_KEY = "nexus_error"


def to_reply(e: NexusError) -> dict[str, Any]:
    """``e`` as a worker handler's answer to the control plane. The scheduler never unpickles worker data, so an
    exception raised in the handler would reach it as a plain ``Exception`` holding the repr (Dask's fallback); this
    plain-valued reply keeps its class, and :func:`from_reply` raises it again there."""
    return {REPLY_KEY: {"class": type(e).__name__, "message": str(e),
                        "retry_after_s": getattr(e, "retry_after_s", None)}}


def from_reply(reply: Any) -> NexusError | None:
    """The error a :func:`to_reply` answer carries (None for any other answer)."""
    if not (isinstance(reply, dict) and len(reply) == 1 and REPLY_KEY in reply):
        return None
    err = reply[REPLY_KEY]
    cls = error_class(str(err.get("class")))
    if issubclass(cls, Overloaded):
        return cls(str(err.get("message", "")), err.get("retry_after_s") or 1.0)
    return cls(str(err.get("message", "")))


def describe_errors(errors: list[dict], root: str = "spec", prefix: str = "", skip: tuple[str, ...] = (),
                    field_words: bool = False, show_input: bool = False) -> str:
    """Pydantic's error list (``ValidationError.errors()``) as one line: ``field.path: message; ...``.

    ``root`` names an error without a location, ``prefix`` goes before every location, ``skip`` drops
    location parts (FastAPI's ``body``); ``field_words`` writes ``field 'x'``, ``show_input`` adds the value given
    (by a short prefix: :func:`quote`)."""
    parts = []
    for err in errors:
        loc = prefix + (".".join(str(x) for x in err.get("loc", ()) if x not in skip) or root)
        where = f"field {loc!r}" if field_words else loc
        got = f" (got {quote(err.get('input'))})" if show_input else ""
        parts.append(f"{where}: {err.get('msg', 'invalid')}{got}")
    return "; ".join(parts)
