"""Team-wise storage on a node (OpenPAI's storage servers and configs, the node's side).

- :mod:`.servers`: :class:`~.servers.ServerSpec`, the storage server as an admin defines it
  (``local``, ``nfs``, ``glusterfs``, ``sshfs``), its checks, the mount command, its redacted view.
- :mod:`.table`: :class:`~.table.MountTable`, one per node agent (and one for the control plane's
  file API): mounts a server once per node, shares it among every holder (a task), records the
  holders durably and unmounts what nobody holds.
- :mod:`.files`: file operations under a server's root that nothing inside it (a symlink a task
  planted) can lead outside of (``openat2(2)`` with ``RESOLVE_BENEATH``).

Imports only :mod:`apiary.errors`, :mod:`apiary.procutil`, the standard library and psutil.
"""

from apiary.mounts.servers import SERVER_TYPES, ServerSpec, check_server, mount_argv, redacted
from apiary.mounts.table import MountError, MountTable

__all__ = ["SERVER_TYPES", "MountError", "MountTable", "ServerSpec", "check_server", "mount_argv", "redacted"]
