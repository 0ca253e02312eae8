"""Compiled modules built at first use from ``csrc/`` (``torch.utils.cpp_extension``):
the engine's host path (``dispatch.host``) and the CPU plan (``dispatch.kernels.plan_cpu``).

Each is built once per machine and source (a C++ compiler and ninja; under a
minute), then kept in torch's extensions folder, one module per source: its
name holds the digest of the source and of where it lies, so that two trees
load theirs side by side (a folder shared by two trees' equal sources would be
built again at each turn: its build file names the source's path).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys

import torch

from dispatch.cuda import csrc_dir


def load(source: str, prefix: str, include: tuple[str, ...] = (), cflags: tuple[str, ...] = ("-O2",)) -> tuple:
    """(the module built from ``csrc/<source>``, None) or (None, why it did not build)."""
    from torch.utils import cpp_extension

    path = csrc_dir() / source
    name, folder = _where(source, prefix)
    try:
        with building(folder):
            return cpp_extension.load(name, [str(path)], extra_include_paths=list(include),
                                      extra_cflags=list(cflags), build_directory=folder, verbose=False), None
    except Exception as error:  # no compiler or ninja
        return None, f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"


@contextlib.contextmanager
def building(folder: str):
    """This process alone builds or loads in ``folder`` (processes of one machine
    take turns): an exclusive ``flock`` on a file of the folder, which the
    system releases when its holder exits, however it ends. Holding it, a lock
    torch's build left in the folder (``lock``, on which torch would wait for
    ever) is from a build that died (killed mid-build), since every build holds
    this one around torch's: it is removed."""
    with open(os.path.join(folder, "dispatch.lock"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # (released with the file, or by the system if this process dies)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, "lock"))
        yield


def cached(source: str, prefix: str) -> bool:
    """Whether the module of ``csrc/<source>`` was built here before (loading it is then quick)."""
    name, folder = _where(source, prefix)
    return os.path.isfile(os.path.join(folder, f"{name}.so"))


def _where(source: str, prefix: str) -> tuple[str, str]:
    """(the module's name, its build folder): one name per source's digest and path."""
    from torch.utils import cpp_extension

    path = csrc_dir() / source
    name = f"{prefix}_{hashlib.sha256(path.read_bytes() + str(path.resolve()).encode()).hexdigest()[:12]}"
    return name, build_folder(cpp_extension.get_default_build_root(), name)


def build_folder(default_root: str, name: str) -> str:
    """Where the module ``name`` is built and kept: one folder per name, Python
    and torch (under $TORCH_EXTENSIONS_DIR, else torch's default), made if need be."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    folder = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or default_root, f"{name}-{version}")
    os.makedirs(folder, exist_ok=True)
    return folder
