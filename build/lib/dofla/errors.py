"""The one exception type users see: a plain sentence saying what was wrong and what to do."""


class DoflaError(Exception):
    """A user-facing error. The CLI prints its message alone (no traceback unless --debug)."""
