"""The runtime's user-facing error: one line naming the problem and the fix."""


class RuntimeUserError(Exception):
    pass
