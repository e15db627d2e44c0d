"""hybrid_paramd: the PyTorch trainer's client of a hybrid-paramd cluster.

A thin layer over the C API of libhybrid_paramd.so (client/c_api.h) through
ctypes: nothing is compiled against Python or torch. See client.py for the
API and _capi.py for how the library is found ($HYBRID_PARAMD_LIB).

__version__ is the version `hybrid-paramd --version` prints: the wheel's
(written into _version.py by python/build_wheel.py from the same stamp), or
in the source tree its VERSION file, which tools/workspace_status.sh stamps.
"""

import os as _os


def _source_tree_version():
    # As tools/workspace_status.sh reads VERSION: spaces and newlines removed,
    # "0.0.0" when there is none.
    path = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "..", "..", "VERSION")
    try:
        with open(path) as f:
            return f.read().replace(" ", "").replace("\n", "") or "0.0.0"
    except OSError:
        return "0.0.0"


try:
    from ._version import __version__
except ImportError:
    __version__ = _source_tree_version()

from .client import (Client, DirectionInfo, Fetched, FetchResult, Manifest, TensorInfo,
                     VersionInfo, has_cuda, library_path)
from .errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded, Error,
                     FailedPrecondition, Internal, InvalidArgument, NotFound, OutOfRange,
                     PermissionDenied, ResourceExhausted, RewoundError, Unauthenticated,
                     Unavailable, Unimplemented, Unknown)
from .cluster_module import ClusterOptimizer, distribute, recipe_text
from .formats import (COLUMNWISE, ROWWISE, HAS_FP8_DTYPES, dequantize)
from .ipc import IpcSession, IpcVersion, IpcView

__all__ = [
    "Client", "DirectionInfo", "Fetched", "FetchResult", "Manifest", "TensorInfo", "VersionInfo",
    "has_cuda", "RewoundError",
    "library_path", "Error", "Aborted", "AlreadyExists", "Cancelled", "DataLoss",
    "DeadlineExceeded", "FailedPrecondition", "Internal", "InvalidArgument", "NotFound",
    "OutOfRange", "PermissionDenied", "ResourceExhausted", "Unauthenticated", "Unavailable",
    "Unimplemented", "Unknown", "ROWWISE", "COLUMNWISE", "HAS_FP8_DTYPES", "dequantize",
    "IpcSession", "IpcVersion", "IpcView", "distribute", "ClusterOptimizer", "recipe_text",
]
