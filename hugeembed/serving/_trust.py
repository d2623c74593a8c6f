"""What a server accepts from disk: files only its own user could have written, inside the artifact, and
(with a key) deltas signed by whoever holds that key.

Like OpenSSH's StrictModes: every directory and file of an artifact (and of each delta) must be
owned by the server's user (or root) and writable by nobody else, and no path component may be a
symbolic link; a manifest's file names must be relative paths inside the directory (no absolute
path, no ``..``).  Otherwise whoever can write ``deltas/`` (another account, a synced bucket with
loose modes) could change what the server serves.  A signed delta (``--delta-key``) carries
``manifest.sig``: HMAC-SHA256 of its manifest's bytes under a key file the server holds; the
manifest lists every file's sha256, so the signature covers them all.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path

from ..errors import ConfigError
from ._runtime import ArtifactError, MANIFEST, relative_file

__all__ = ["trusted_owners", "check_dir", "check_file", "read_secret", "sign", "check_signature", "SIGNATURE"]

SIGNATURE = "manifest.sig"  # beside a signed delta's manifest.json: "hmac-sha256:<hex>"
_SIG_PREFIX = "hmac-sha256:"
_MAX_SECRET = 4096


def trusted_owners() -> set[int]:
    """The users whose files the server accepts: itself and root."""
    return {os.geteuid(), 0}


def _check_mode(path: Path, st: os.stat_result, what: str) -> None:
    if st.st_uid not in trusted_owners():
        raise ArtifactError(f"{what} {path} is owned by uid {st.st_uid}, not by the server's user ({os.geteuid()}) "
                            f"or root: refused (chown it, or export as the server's user)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ArtifactError(f"{what} {path} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
                            f"(mode {stat.S_IMODE(st.st_mode):o}): refused (chmod go-w)")


def _lstat(path: Path) -> os.stat_result:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing") from None
    except OSError as e:
        raise ArtifactError(f"{path} is unreadable: {e.strerror}") from None


def check_dir(path: Path, *, follow: bool = False) -> Path:
    """ArtifactError unless `path` is a directory of a trusted owner that nobody else may write to (a
    symbolic link is refused unless `follow`: the artifact's own path, which the operator gave)."""
    st = _lstat(path)
    if stat.S_ISLNK(st.st_mode):
        if not follow:
            raise ArtifactError(f"{path} is a symbolic link: refused inside an artifact")
        st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ArtifactError(f"{path} is not a directory")
    _check_mode(path, st, "directory")
    return path


def check_file(root: Path, rel: object) -> Path:
    """``root / rel`` after checking that `rel` is a relative path inside `root` and that every directory
    below `root` on the way and the file itself are trusted (owner, modes) and not symbolic links."""
    rel_path = relative_file(rel, root)
    here = root
    for i, part in enumerate(rel_path.parts):
        here = here / part
        st = _lstat(here)
        if stat.S_ISLNK(st.st_mode):
            raise ArtifactError(f"{here} is a symbolic link: refused inside an artifact")
        last = i == len(rel_path.parts) - 1
        if last and not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"{here} is not a regular file")
        if not last and not stat.S_ISDIR(st.st_mode):
            raise ArtifactError(f"{here} is not a directory")
        _check_mode(here, st, "file" if last else "directory")
    return here


def read_secret(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of a key or token file: a regular file (no link) of the server's user or root, readable by
    nobody else (like an ssh private key), 1 to 4096 bytes.  ConfigError naming `what` otherwise."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except OSError as e:
        raise ConfigError(f"{what} {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} {path} is not a regular file{' (a symbolic link)' if stat.S_ISLNK(st.st_mode) else ''}")
    if st.st_uid not in trusted_owners():
        raise ConfigError(f"{what} {path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()}) or root")
    if st.st_mode & 0o077:
        raise ConfigError(f"{what} {path} is readable or writable by others (mode {stat.S_IMODE(st.st_mode):o}): "
                            f"chmod 600 it")
    data = path.read_bytes()
    if not 0 < len(data) <= _MAX_SECRET:
        raise ConfigError(f"{what} {path} holds {len(data)} bytes: give 1 to {_MAX_SECRET} (e.g. 32 random bytes: "
                            f"head -c 32 /dev/urandom > {path.name})")
    return data


def sign(manifest: bytes, key: bytes) -> str:
    """The content of ``manifest.sig`` for these manifest bytes."""
    return _SIG_PREFIX + hmac.new(key, manifest, hashlib.sha256).hexdigest() + "\n"


def check_signature(directory: Path, manifest: bytes, key: bytes) -> None:
    """ArtifactError unless ``directory/manifest.sig`` (trusted, see check_file) signs these manifest bytes."""
    sig_path = directory / SIGNATURE
    if not os.path.lexists(sig_path):
        raise ArtifactError(f"{directory} is not signed (no {SIGNATURE}), and the server has a --delta-key: refused "
                            f"(export it with hugeembed export --delta --delta-key)")
    text = check_file(directory, SIGNATURE).read_text(errors="replace").strip()
    if not hmac.compare_digest(text.encode(), sign(manifest, key).strip().encode()):
        raise ArtifactError(f"{directory / SIGNATURE} does not sign its {MANIFEST} under the server's --delta-key: "
                            f"refused (altered, or signed with another key)")
