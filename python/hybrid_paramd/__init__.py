"""hybrid_paramd: the PyTorch trainer's client of a hybrid-paramd cluster.

A thin layer over the C API of libhybrid_paramd.so (client/c_api.h) through
ctypes: nothing is compiled against Python or torch. See client.py for the
API and _capi.py for how the library is found ($HYBRID_PARAMD_LIB).
"""

from .client import (Client, DirectionInfo, Fetched, FetchResult, Manifest, TensorInfo,
                     VersionInfo, has_cuda, library_path)
from .errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded, Error,
                     FailedPrecondition, Internal, InvalidArgument, NotFound, OutOfRange,
                     PermissionDenied, ResourceExhausted, RewoundError, Unauthenticated,
                     Unavailable, Unimplemented, Unknown)
from .formats import (COLUMNWISE, ROWWISE, HAS_FP8_DTYPES, dequantize)
from .ipc import IpcSession, IpcVersion, IpcView

__all__ = [
    "Client", "DirectionInfo", "Fetched", "FetchResult", "Manifest", "TensorInfo", "VersionInfo",
    "has_cuda", "RewoundError",
    "library_path", "Error", "Aborted", "AlreadyExists", "Cancelled", "DataLoss",
    "DeadlineExceeded", "FailedPrecondition", "Internal", "InvalidArgument", "NotFound",
    "OutOfRange", "PermissionDenied", "ResourceExhausted", "Unauthenticated", "Unavailable",
    "Unimplemented", "Unknown", "ROWWISE", "COLUMNWISE", "HAS_FP8_DTYPES", "dequantize",
    "IpcSession", "IpcVersion", "IpcView",
]
