"""The error of a record that cannot be used (shared by the record parsers)."""


class BadRecord(ValueError):
    """A record that cannot be used; the message is the reason (file and line are added by the reader)."""
