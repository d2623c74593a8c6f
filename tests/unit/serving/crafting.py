"""Crafting deltas as an attacker would: files replaced, checksums recomputed in the manifest (they sit in it),
pickles whose unpickling runs a harmless payload (it creates a marker file)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import pickle
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np


class Payload:
    """Unpickling it calls Path(marker).touch(): the file appears if, and only if, the pickle was loaded (no
    file object is left open)."""

    def __init__(self, marker: Path) -> None:
        self.marker = Path(marker)

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def payload_pickle(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def program_with_payload(src: Path, dst: Path, marker: Path) -> None:
    """A copy of the exported program `src` whose first weight is a pickle running the payload (torch.export.load
    reads pickled weights with torch.load(weights_only=False))."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        names = zin.namelist()
        config_name = next(n for n in names if n.endswith("data/weights/model_weights_config.json"))
        config = json.loads(zin.read(config_name))
        first = next(iter(config["config"].values()))
        first["use_pickle"] = True
        target = f"{config_name.rsplit('/', 1)[0]}/{first['path_name']}"
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == config_name:
                data = json.dumps(config).encode()
            elif item.filename == target:
                data = payload_pickle(marker)
            zout.writestr(item, data)


def record(directory: Path, rel: str, array: bool = True) -> dict[str, Any]:
    """The manifest record of the file directory/rel as it is now (size, sha256; an array's shape and dtype)."""
    data = (directory / rel).read_bytes()
    rec: dict[str, Any] = {"file": rel, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if array:
        try:
            arr = np.load(io.BytesIO(data), allow_pickle=False)
            rec.update(shape=list(arr.shape), dtype=str(arr.dtype))
        except ValueError:  # an object array: its header still says what it claims to be
            version = np.lib.format.read_magic(io.BytesIO(data))
            f = io.BytesIO(data)
            np.lib.format.read_magic(f)
            shape, _, dtype = np.lib.format._read_array_header(f, version)
            rec.update(shape=list(shape), dtype=str(dtype))
    return rec


def rewrite(delta: Path, mutate: Callable[[dict[str, Any]], None], key: bytes | None = None) -> dict[str, Any]:
    """Applies `mutate` to the delta's manifest and writes it back (signed with `key`, as a key holder would)."""
    path = delta / "manifest.json"
    m = json.loads(path.read_text())
    mutate(m)
    raw = json.dumps(m, indent=1, sort_keys=True).encode()
    path.write_bytes(raw)
    if key is not None:
        from hugeembed.serving._trust import SIGNATURE, sign

        (delta / SIGNATURE).write_text(sign(raw, key))
    return m


@contextlib.contextmanager
def running(app):
    """The ASGI app served by uvicorn on 127.0.0.1 in a thread of this process (lifespan included); yields its
    base URL and stops it on exit."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
