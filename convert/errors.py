"""The converter's one user-facing error type: a one-line message naming problem and fix."""


class ConvertError(Exception):
    pass
