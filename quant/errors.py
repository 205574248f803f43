"""Errors of conversion that the user can fix; each message is one sentence naming the fix."""

from __future__ import annotations

import errno
import os

from llmlocal.models.errors import LLMLocalError, ModelFormatError


class QuantizeError(LLMLocalError):
    """The conversion cannot proceed as asked (output path, disk space, options)."""


class CheckpointError(ModelFormatError):
    """The source checkpoint is incomplete, corrupt or of an architecture we do not convert."""


# Writes that fail for lack of room: a full disk, a user quota, a file-size limit.
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def write_error(error: OSError, path: str | os.PathLike[str]) -> LLMLocalError | None:
    """The user-facing error for a failed write to ``path``, or None if it is not one the user
    can act on (then the original error is re-raised with its traceback)."""
    directory = os.path.dirname(os.path.abspath(path))
    if error.errno in _NO_SPACE:
        return QuantizeError(
            f"The disk holding {directory} ran out of space while writing: free some space or "
            "write the output elsewhere with -o."
        )
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return QuantizeError(f"llmlocal may not write to {directory}: choose another output path with -o.")
    return None
