"""Every error the builder reports to a user, each with its exit code.

An error carries what it is about as fields (file, member, line, field, the tree
path and hunk a member patches) and its message; ``str()`` joins them in one
place, in that order, so every message reads the same way::

    overlay/fix.patch: member fix: line 12: malformed hunk header '@@ -1 +1'
    recipes/r.yaml: vllm.sha256: expected 64 lowercase hex digits, got 'ef52'
    overlay/fix.patch: member fix: vllm/a.py: hunk 1 (@@ -4,7 +4,7 @@): does not apply at line 5: ...

Exit codes (README, "Exit codes"): 1 a check or build that ran and said no,
2 bad input (nothing changed on disk), 3 a service that did not answer or a
disk that refused a write.
"""

from __future__ import annotations

import os
from typing import Any

# The fields, in the order a message names them.
FIELDS = ("file", "member", "line", "field", "path", "hunk")


class OverlayError(Exception):
    """Base of every error the builder reports: one line, no traceback."""

    exit_code = 1

    def __init__(
        self,
        message: str,
        *,
        file: str | os.PathLike[str] | None = None,
        member: str | None = None,
        line: int | None = None,
        field: str | None = None,
        path: str | None = None,
        hunk: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.file = None if file is None else str(file)
        self.member, self.line, self.field, self.path, self.hunk = member, line, field, path, hunk

    def located(self, **fields: Any) -> OverlayError:
        """Fill in the fields a caller knows and the raiser did not (e.g. the recipe's file
        for a field error); returns the error, to be raised again."""
        for name, value in fields.items():
            if name not in FIELDS:
                raise TypeError(f"unknown error field {name!r}")
            if getattr(self, name) is None and value is not None:
                setattr(self, name, str(value) if name == "file" else value)
        return self

    def fields(self) -> dict[str, Any]:
        """The structured fields that are set (for --json and for tests)."""
        return {name: getattr(self, name) for name in FIELDS if getattr(self, name) is not None}

    def __str__(self) -> str:
        parts = [
            self.file,
            None if self.member is None else f"member {self.member}",
            None if self.line is None else f"line {self.line}",
            self.field,
            self.path,
            self.hunk,
        ]
        return ": ".join([part for part in parts if part] + [self.message])


class InputError(OverlayError):
    """Bad input: a recipe, member, pin, argument or base tree the builder refuses."""

    exit_code = 2


class HunkFailure(InputError):
    """A member's file patch does not apply to the tree it meets.  ``path`` is the tree
    path, ``hunk`` names the hunk (None: the file as a whole), ``at`` the 0-based line
    where it was expected; the check command reports it as a conflict."""

    def __init__(self, path: str, hunk: Any, reason: str, at: int = 0) -> None:
        label = f"hunk {hunk.number} ({hunk.header})" if hunk is not None else "file"
        super().__init__(reason, path=path, hunk=label)
        self.patch_hunk, self.reason, self.at = hunk, reason, at


class CheckFailed(OverlayError):
    """A check ran to completion and said no (an image's build-time checks, a build step)."""

    exit_code = 1


class ProbeEnvError(OverlayError):
    """The probe's interpreter or its shadow tree could not be made."""

    exit_code = 1


class ServiceUnreachable(OverlayError):
    """A service did not answer (Docker engine, registry, package index, download)."""

    exit_code = 3


class RegistryUnreachable(ServiceUnreachable):
    """The registry did not answer: whether a tag is there is unknown."""


class StorageFailed(OverlayError):
    """This machine's storage refused a write (full, read-only, no permission): nothing was
    left half-written."""

    exit_code = 3


def first_line(exc: BaseException) -> str:
    """What an exception says, in one line: a Docker engine's own explanation when it gives one
    (docker-py's APIError), else the exception's text; its type's name when both are empty."""
    text = str(getattr(exc, "explanation", None) or exc).strip()
    return (text.splitlines() or [type(exc).__name__])[0]
