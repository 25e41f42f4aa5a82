"""The codec's one exception type.

Owns `CodecError`: every rejection of bad input (at encode, decode, split and
in constructors) raises it, with a message that says what was wrong and, for
misuse, what to do instead.
"""


class CodecError(ValueError):
    """Bad input to the codec: malformed frames, non-finite tensors, misuse."""
