"""A scratch folder in front of the script's files, for a rank traced beside others.

Note [A rank's files]
Ranks of a job are traced as processes of their own, side by side or one after another. A file
one traced rank writes (rank 0's checkpoint) must not be found by another (which would resume
from it where, in a real job, every rank looks before rank 0 saves anything), nor left behind in
the script's folders (where the next run, simulated or on a GPU, would resume from
placeholders). So, while a :class:`Scratch` is entered, what the script creates goes to a mirror
of its path under the scratch folder, and what it reads comes from the mirror where the mirror
has it:

- ``torch.save`` writes to the mirror (:meth:`Scratch.path` with ``writing``), ``torch.load``
  reads the mirror's file when there is one;
- ``os.makedirs`` and ``os.mkdir`` (``pathlib``'s too) of a folder that does not exist make it
  in the mirror (``os.mkdir`` of a folder the mirror has already does nothing);
- ``open`` for writing into a folder made in the mirror writes there; ``open`` for reading, of a
  file the mirror has, reads it;
- ``os.path.exists``, ``isdir`` and ``isfile`` answer for either; ``os.listdir`` lists both.

Files written with other calls (``pathlib``'s own, a library's C code) go where they go; the
report counts the files the mirror holds. Folders of :attr:`Scratch.passthrough` (the fake
GPU's compile cache) are not mirrored: what is written there is the same on every rank
(compiled programs), and Inductor writes a file and renames it into place, which a mirror
would split.
"""

from __future__ import annotations

import builtins
import io
import os
from typing import Any, Callable, List, Tuple

__all__ = ["Scratch"]

_WRITING = set("wax+")


class Scratch:
    """The scratch folder ``root`` in front of the script's files (Note [A rank's files]);
    enter once, while the script runs."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        #: Files written into the mirror, in order.
        self.files: List[str] = []
        self._patched: List[Tuple[Any, str, Any]] = []
        #: os.path.exists as it was before entering (it answers for the mirror too while entered).
        self._real_exists: Callable[[Any], bool] = os.path.exists
        #: Folders whose files are not mirrored (Note [A rank's files]).
        self.passthrough: List[str] = []

    def mirror(self, path: Any) -> str:
        """Where ``path`` stands in the scratch folder."""
        return os.path.join(self.root, os.path.abspath(os.fspath(path)).lstrip(os.sep))

    def path(self, f: Any, writing: bool) -> Any:
        """The file to use for ``f`` (a path; anything else is itself): a file written goes to the
        mirror; a file read comes from the mirror when the mirror has it."""
        if not isinstance(f, (str, os.PathLike)):
            return f
        mirror = self.mirror(f)
        if writing:
            os.makedirs(os.path.dirname(mirror), exist_ok=True)
            if mirror not in self.files:
                self.files.append(mirror)
            return mirror
        return mirror if self._real_exists(mirror) else f

    # -- entering ------------------------------------------------------------------------------

    def _set(self, owner: Any, name: str, value: Callable[..., Any]) -> None:
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> "Scratch":
        os.makedirs(self.root, exist_ok=True)
        exists, isdir, isfile, listdir = os.path.exists, os.path.isdir, os.path.isfile, os.listdir
        makedirs, mkdir, open0 = os.makedirs, os.mkdir, builtins.open
        self._real_exists = exists
        scratch = self

        def paths(p: Any) -> bool:
            """Whether ``p`` is a path the mirror stands in front of (not one inside the mirror:
            os.makedirs makes the mirror's folders through os.mkdir)."""
            if not isinstance(p, (str, os.PathLike)):
                return False
            text = os.fspath(p)
            if not isinstance(text, str):
                return False
            full = os.path.abspath(text)
            inside = (scratch.root, *scratch.passthrough)
            if any(full == d or full.startswith(d + os.sep) for d in inside):
                return False
            # os.makedirs of a passthrough folder makes its parents through os.mkdir: real ones too
            return not any(d.startswith(full + os.sep) for d in scratch.passthrough)

        def either(test: Callable[[Any], bool]) -> Callable[[Any], bool]:
            return lambda p: test(p) or (paths(p) and test(scratch.mirror(p)))

        def listdir_both(p: Any = ".") -> List[str]:
            if not paths(p):
                return listdir(p)
            mirrored = scratch.mirror(p)
            if not isdir(mirrored):
                return listdir(p)
            own = listdir(p) if isdir(p) else []
            return own + [n for n in listdir(mirrored) if n not in own]

        def makedirs_mirrored(name: Any, mode: int = 0o777, exist_ok: bool = False) -> None:
            if not paths(name) or isdir(name):
                return makedirs(name, mode, exist_ok)
            return makedirs(scratch.mirror(name), mode, exist_ok)

        def mkdir_mirrored(path: Any, mode: int = 0o777, *, dir_fd: Any = None) -> None:
            if dir_fd is not None or not paths(path) or exists(path):
                return mkdir(path, mode, dir_fd=dir_fd)
            mirrored = scratch.mirror(path)
            if isdir(mirrored):
                # Made in the mirror already: pathlib's mkdir(exist_ok=True) takes FileExistsError
                # only where its own check (os.stat of the script's path) finds the folder.
                return None
            makedirs(os.path.dirname(mirrored), exist_ok=True)
            return mkdir(mirrored, mode)

        def open_mirrored(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if paths(file):
                mirrored = scratch.mirror(file)
                if _WRITING & set(mode):
                    if not isdir(os.path.dirname(os.path.abspath(os.fspath(file)))) and isdir(
                        os.path.dirname(mirrored)
                    ):
                        if mirrored not in scratch.files:
                            scratch.files.append(mirrored)
                        file = mirrored
                elif exists(mirrored):
                    file = mirrored
            return open0(file, mode, *args, **kwargs)

        self._set(os.path, "exists", either(exists))
        self._set(os.path, "isdir", either(isdir))
        self._set(os.path, "isfile", either(isfile))
        self._set(os, "listdir", listdir_both)
        self._set(os, "makedirs", makedirs_mirrored)
        self._set(os, "mkdir", mkdir_mirrored)
        self._set(builtins, "open", open_mirrored)
        self._set(io, "open", open_mirrored)
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._patched:
            owner, name, value = self._patched.pop()
            setattr(owner, name, value)
