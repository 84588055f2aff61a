"""The one base class of every error that describes bad input rather than a bug.

The command line prints such an error as one line and exits with a status; anything
else is a bug and keeps its traceback. Importing this module costs nothing (no torch),
so the command line can catch these errors without loading the library.
"""


class TransduceError(Exception):
    """Bad input, a missing file or tool: the message names the file, line, field or
    option and says what is wrong."""
