"""The exceptions of `sbp`: every one names the argument that was wrong."""


class SbpError(Exception):
    """Base class of every error `sbp` raises on purpose."""


class PlacementError(SbpError, ValueError):
    """A bad placement, or tensors on different placements mixed in one op."""


class SbpSignatureError(SbpError, ValueError):
    """A bad SBP or nd_sbp: split dim out of range, wrong length, wrong type."""


class MetaMismatchError(SbpError, RuntimeError):
    """Ranks of one placement disagree on a tensor's dtype, shape, device or sbp."""


class RankFailedError(MetaMismatchError):
    """Another rank raised an error (bad input) at a point where this rank went on into a
    collective with it; names that rank and its error. Every rank raises: none waits out
    the timeout for a call its peer will never make. `ranks`: the ranks the failing rank
    told (its call's), which this rank tells in turn: it skips the rest of its call too."""

    def __init__(self, message: str, rank: int = -1, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.rank = rank
        self.ranks = ranks


class DeviceMismatchError(SbpError, ValueError):
    """A local tensor's device does not match its placement's device type."""


class CommTimeoutError(SbpError, RuntimeError):
    """A collective outlived the timeout given to `sbp.env.init`."""


class InputTypeError(SbpError, TypeError):
    """An argument of a type sbp cannot place: `to_global` on a numpy array, a number, a string."""


class InputValueError(SbpError, ValueError):
    """An argument of the right type with a value sbp cannot use: a timeout that is not a
    positive, finite number of seconds, an option outside its choices, a rank outside the world."""


class LabelRangeError(SbpError, IndexError):
    """A loss's class label outside [0, classes) that is not its `ignore_index`."""


class IndexRangeError(SbpError, IndexError):
    """An index tensor (`F.embedding`'s ids, `gather`'s index) holding an index outside the
    range its op accepts, or a mask of another shape than the dims it indexes."""


class ImplicitCommunicationError(SbpError, RuntimeError):
    """Under `sbp.strict()`: an op needed its input converted with a collective that the
    program did not ask for (no `to_global` of its own); names the op and the conversion."""
