"""The one exception type for bad input: the entry scripts turn it into a single line and exit 2."""


class ConfigError(Exception):
    """A problem with what the user asked for; the message names the problem and the fix."""
