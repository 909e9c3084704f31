"""The base of every error StableAsync raises on purpose, so that a caller (the CLI, a user's script) can
tell the project's own failures, each with a message that names what to change, from a bug.

Standard library only: the job schema and every layer import it. Each error also keeps the built-in base
it had (ValueError for bad input, RuntimeError for a failure while running), so existing `except` clauses
still hold.
"""


class StableAsyncError(Exception):
    """A failure the project detected and explained: bad input, a fault it could not ride out."""
