"""An error as a user reads it: one line, never a traceback."""


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (its type's name if it has none), at most 300 characters."""
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]
