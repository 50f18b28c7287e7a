"""Base class for errors quantkit reports to the user without a traceback."""


class QuantkitError(Exception):
    """Base class for errors quantkit reports to the user without a traceback."""
