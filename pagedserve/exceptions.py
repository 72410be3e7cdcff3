"""Typed errors for input that comes from a user (pure Python: imported by the engine and the API)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine cannot take, named by its field: the API answers it with 400 and `param`.

    A ValueError, so callers of the offline API that catch ValueError keep working; but only this
    subclass is blamed on the client: any other exception while serving a request is a server fault (500).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def renamed(self, names: dict[str, str]) -> InvalidRequestError:
        """This error in the terms of a request whose field for `param` has another name (`names`: ours ->
        theirs): the param and its mentions as a word (not inside --max-logprobs or max_logprobs) renamed."""
        name = names.get(self.param or "")
        if name is None:
            return self
        import re

        return InvalidRequestError(re.sub(rf"(?<![\w-]){re.escape(self.param)}(?![\w-])", name, self.message),
                                   param=name)


class EngineDeadError(RuntimeError):
    """The engine stopped after an error it could not recover from; the server must be restarted."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (a fault while adding, scheduling, running or post-processing
    it) and keeps serving the others; the traceback was logged under `request_id`."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id} failed: {reason}")
        self.request_id = request_id
        self.reason = reason


class InjectedFault(RuntimeError):
    """Raised by the test-only fault-injection hook (engine/faults.py)."""


def request_error(request_id: str, reason: "str | BaseException") -> Exception:
    """What a failed request's caller gets (LLMEngine.take_failed's reasons): an InvalidRequestError as it is
    (the client's to fix: a 400), anything else as RequestFailedError."""
    if isinstance(reason, InvalidRequestError):
        return reason
    if isinstance(reason, BaseException):
        reason = f"{type(reason).__name__}: {reason}"
    return RequestFailedError(request_id, reason)


def check_text(text: str, what: str = "the text", param: str | None = None) -> None:
    """Raises InvalidRequestError for text that is not Unicode: a lone surrogate, which JSON lets a client write
    ("\\ud800") and which tokenizers and grammar compilers refuse with errors of their own."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(f"{what} holds a lone surrogate ({text[error.start]!r} at character "
                                  f"{error.start}), which is not Unicode: send surrogates in pairs",
                                  param=param) from None
