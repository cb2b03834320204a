"""One exception hierarchy; the CLI maps each class to an exit code.

InputError is a user's mistake (a bad recipe, member, pin or argument): exit 2,
one line, no traceback.  CheckFailed is a check that ran and said no: exit 1.
"""

from __future__ import annotations


class OverlayError(Exception):
    """Base of every error the builder reports to a user."""

    exit_code = 1


class InputError(OverlayError):
    """Bad input: the message names the file (and member, hunk, field)."""

    exit_code = 2


class CheckFailed(OverlayError):
    """A check ran to completion and did not pass."""

    exit_code = 1
