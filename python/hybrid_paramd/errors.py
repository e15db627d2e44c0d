"""Exceptions carrying the gRPC status code of a failed call."""

CODE_NAMES = [
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
]


class Error(Exception):
    """A failed call. `code` is the gRPC code number (14 = UNAVAILABLE, ...),
    `code_name` its name (as grpc.StatusCode names it), `message` the
    library's message. Subclasses exist per code (hybrid_paramd.Unavailable,
    ...); what a retry should do is in client/client.h."""

    code = 2

    def __init__(self, code, message):
        super().__init__("%s: %s" % (CODE_NAMES[code] if 0 <= code < len(CODE_NAMES)
                                     else "UNKNOWN", message))
        self.code = code
        self.message = message

    @property
    def code_name(self):
        return CODE_NAMES[self.code] if 0 <= self.code < len(CODE_NAMES) else "UNKNOWN"


def _subclass(name, code):
    return type(name, (Error,), {"code": code, "__doc__": "Error with code %s." % CODE_NAMES[code]})


Cancelled = _subclass("Cancelled", 1)
Unknown = _subclass("Unknown", 2)
InvalidArgument = _subclass("InvalidArgument", 3)
DeadlineExceeded = _subclass("DeadlineExceeded", 4)
NotFound = _subclass("NotFound", 5)
AlreadyExists = _subclass("AlreadyExists", 6)
PermissionDenied = _subclass("PermissionDenied", 7)
ResourceExhausted = _subclass("ResourceExhausted", 8)
FailedPrecondition = _subclass("FailedPrecondition", 9)
Aborted = _subclass("Aborted", 10)
OutOfRange = _subclass("OutOfRange", 11)
Unimplemented = _subclass("Unimplemented", 12)
Internal = _subclass("Internal", 13)
Unavailable = _subclass("Unavailable", 14)
DataLoss = _subclass("DataLoss", 15)
Unauthenticated = _subclass("Unauthenticated", 16)

_BY_CODE = {c.code: c for c in (Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound,
                               AlreadyExists, PermissionDenied, ResourceExhausted,
                               FailedPrecondition, Aborted, OutOfRange, Unimplemented, Internal,
                               Unavailable, DataLoss, Unauthenticated)}


class RewoundError(Aborted):
    """The cluster rewound (a daemon was lost and replaced; every daemon went
    back to the newest complete checkpoint): `version` is the version it is
    at now, `recovery_epoch` the recoveries completed. A trainer goes back
    to `version` (its data loader too) and pushes for it next. Raised by
    Client.wait_for_version and fetch of the latest version, once per
    rewind; Client.wait_for_version_info returns the rewind instead. A
    subclass of Aborted (code 10)."""

    def __init__(self, version, recovery_epoch, message):
        super().__init__(10, message)
        self.version = version
        self.recovery_epoch = recovery_epoch


def from_code(code, message):
    return _BY_CODE.get(code, Error)(code, message)
