"""ServingModel: a loaded artifact (plus its deltas) called on dense features and SparseFeatures.

The served state (tables, patch, program, version) is one immutable object swapped by a single
assignment: a call reads it once, so every call sees the old model or the new one whole.  A
delta that fails changes nothing and stops nothing: the model keeps the last good version and
says which delta it refused and why (``refused``), at start (the longest valid prefix of the
chain is served) and on every reload.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data import CAT_NAMES, N_DENSE, Batch, Schema, criteo_schema
from ..errors import ArtifactError, ConfigError, InputError
from ..features import SparseFeatures
from ..models._base import check_model_inputs
from . import _runtime, _trust
from ._export import dense_spec
from ._flat_program import flat_program
from ._patch import PatchGroup, merge_patch, version_program
from ._runtime import Tables

__all__ = ["ServingModel", "Served", "Refusal"]


@dataclass(frozen=True)
class Served:
    """One version of the model: what every call reads at once."""

    tables: Tables  # the base artifact's (memory-mapped, never changed)
    program: Any  # the base's program with this version's dense weights (and patched lookups)
    source: dict[str, Any]  # the snapshot these rows and this program come from (name, step, manifest_sha256)
    deltas: tuple[str, ...]  # artifact deltas applied on the base, in order
    patch: tuple[PatchGroup | None, ...] = ()  # per dim group: the rows the deltas changed (_patch.py)

    def __post_init__(self) -> None:
        # the program as a function of flat tensors, its tables' arguments flattened once (_flat_program.py)
        object.__setattr__(self, "run", flat_program(self.program))
        object.__setattr__(self, "table_args", tuple(t for part in self.tables.args() for t in part))

    @property
    def version(self) -> str:
        """The training snapshot served, e.g. ``step-000000400``."""
        return str(self.source["name"])


@dataclass(frozen=True)
class Refusal:
    """A delta the model did not apply: its directory name under ``deltas/`` and why."""

    delta: str
    reason: str

    def __str__(self) -> str:
        return f"delta {self.delta} refused: {self.reason}"


def _artifact_error(e: Exception) -> ArtifactError:
    return ArtifactError(str(e))


def _check_base(directory: Path) -> dict[str, Any]:
    """The base artifact's manifest, after checking that its directory and every file it names are trusted."""
    _trust.check_dir(directory, follow=True)
    _trust.check_file(directory, _runtime.MANIFEST)
    manifest = _runtime.read_manifest(directory)
    for rec in manifest["files"].values():
        _trust.check_file(directory, rec.get("file") if isinstance(rec, dict) else rec)
    return manifest


class ServingModel:
    """A frozen model for inference: tables memory-mapped, the dense part an exported program.

    Example::

        model = ServingModel.load("dlrm.int8")          # base artifact + the valid chain of deltas/
        probs = model.predict(batch.dense, batch.sparse)  # [B] click probabilities
        model.reload()                                    # apply deltas written since (export --delta)
        model.refused                                     # None, or the delta it could not apply and why

    Unknown ids read zeros, ids < 0 are dropped; nothing is ever inserted or counted.  The base
    artifact is code (its program is unpickled): load only artifacts from a trusted place.  Its
    deltas are data: every file is checked (owner and modes, paths, sha256, shapes, the model's
    structure; with `delta_key` its signature) and nothing in them is unpickled or executed.
    """

    def __init__(self, directory: Path, manifest: dict[str, Any], served: Served, exported,
                 delta_key: bytes | None = None) -> None:
        self.directory, self.manifest = directory, manifest
        self.dtype: str = manifest["dtype"]
        self.features: tuple[str, ...] = tuple(manifest["features"]["sparse"])
        self.num_dense: int = int(manifest["features"]["dense"])
        self.schema: Schema | None = self._schema(manifest, directory)
        self._served = served
        self._exported = exported
        self._delta_key = delta_key
        self.dense_spec = dense_spec(served.program.state_dict())  # what a delta's weights must be
        self._reload_lock = threading.Lock()  # one reload at a time; calls never wait for it
        self.refused: Refusal | None = None
        self.refusals = 0  # refusals so far (a delta refused again unchanged is not counted twice)
        self._failed: dict[str, tuple[tuple, Refusal]] = {}  # delta -> (its files' stat, the refusal): not retried

    def _schema(self, manifest: dict[str, Any], directory: Path) -> Schema | None:
        """The data schema requests are read with: the artifact's, Criteo's for a Criteo model exported
        before schemas existed, None for a model of other features without one (raw ids only)."""
        if "schema" in manifest:
            try:
                return Schema.from_dict(manifest["schema"], source=f"{directory}: schema")
            except ConfigError as e:
                raise ArtifactError(str(e)) from None
        if self.features == CAT_NAMES and self.num_dense == N_DENSE:
            return criteo_schema()
        return None

    @classmethod
    def load(cls, directory: str | os.PathLike, *, apply_deltas: bool = True,
             delta_key: bytes | None = None) -> "ServingModel":
        """Loads the artifact at `directory` (every file trusted and verified; tables memory-mapped) and, unless
        ``apply_deltas=False``, the longest valid prefix of the chain of deltas under ``directory/deltas``
        (``refused`` names the delta it stopped at).  With `delta_key`, only deltas signed with it apply.

        ArtifactError (naming the file) for a missing, damaged, foreign or untrusted base artifact."""
        directory = Path(directory)
        try:
            _check_base(directory)
            art = _runtime.load(directory)
        except _runtime.ArtifactError as e:
            raise _artifact_error(e) from None
        model = cls(directory, art.manifest, Served(art.tables, art.program, art.manifest["source"], ()),
                    art.exported, delta_key)
        if apply_deltas:
            try:
                model.reload()
            except ArtifactError:
                pass  # serving the longest valid prefix: model.refused says which delta and why
        return model

    # -- versions -------------------------------------------------------------------------------

    @property
    def version(self) -> str:
        return self._served.version

    @property
    def served(self) -> Served:
        return self._served

    def reload(self) -> list[str]:
        """Applies, in order, the deltas under ``deltas/`` that follow the served version; returns their names.

        Each is checked (trust, chain link, signature, checksums, structure), built beside the served
        model and swapped in whole.  When one is refused, the ones before it stay applied, nothing of it
        is, ``refused`` names it, and ArtifactError says why (an unchanged refused delta is not read
        again).  Any error is caught the same way: the served version is always the last good one."""
        from ._delta import scan_deltas

        with self._reload_lock:
            applied: list[str] = []
            refused = None
            try:
                headers = scan_deltas(self.directory, self._delta_key, skip=self._served.deltas)
                while True:
                    served = self._served
                    nxt = next((h for h in headers if h.manifest is not None and h.path.name not in served.deltas
                                and h.parent_sha == served.source.get("manifest_sha256")), None)
                    if nxt is None:  # the chain ends; a delta we could not read may be why
                        bad = next((h for h in headers if h.manifest is None), None)
                        refused = None if bad is None else Refusal(bad.path.name, bad.error or "unreadable")
                        break
                    refused = self._failed_before(nxt.path)
                    if refused is not None:
                        break
                    try:
                        self._served = self._next_version(served, nxt)
                    except Exception as e:  # noqa: BLE001 -- every failure leaves the served version as it was
                        refused = Refusal(nxt.path.name, _reason(e))
                        self._failed[nxt.path.name] = (_stat(nxt.path), refused)
                        break
                    applied.append(nxt.path.name)
            except Exception as e:  # noqa: BLE001 -- the deltas directory itself (untrusted, unreadable)
                refused = Refusal("deltas/", _reason(e))
            if refused is not None and refused != self.refused:
                self.refusals += 1
            self.refused = refused
            if refused is not None:
                raise ArtifactError(str(refused))
            return applied

    def apply_delta(self, path: str | os.PathLike) -> str:
        """Applies the artifact delta at `path` (it must follow the served version); returns the new version.
        ArtifactError (and nothing changes) when it does not follow, or is damaged, untrusted or unsigned."""
        from ._delta import read_header

        with self._reload_lock:
            header = read_header(Path(path), self._delta_key)
            if header.manifest is None:
                raise ArtifactError(header.error or f"{path} is unreadable")
            if header.parent_sha != self._served.source.get("manifest_sha256"):
                parent = header.manifest.get("parent") or {}
                raise ArtifactError(f"{path} follows {parent.get('name')}, the model serves {self.version}: "
                                    f"apply the deltas in order")
            try:
                self._served = self._next_version(self._served, header)
            except Exception as e:  # noqa: BLE001
                raise ArtifactError(f"delta {Path(path).name} refused: {_reason(e)}") from None
            return self.version

    def _next_version(self, served: Served, header) -> Served:
        """The version after the delta of `header`, built beside `served` (untouched)."""
        from ._delta import read_delta

        data = read_delta(header, self.manifest, self.dense_spec)
        source = data.manifest["source"]
        if not (isinstance(source, dict) and isinstance(source.get("name"), str)
                and isinstance(source.get("manifest_sha256"), str)):
            raise _runtime.ArtifactError(f"delta {header.path}: its source record is damaged")
        groups = self.manifest["groups"]
        prev = served.patch or (None,) * len(groups)
        patch = tuple(merge_patch(group, served.tables.rows[g], served.tables.meta[g], prev[g],
                                  {n: data.upserts[n] for n in group["tables"]},
                                  {n: data.removed[n] for n in group["tables"]})
                      for g, group in enumerate(groups))
        program = version_program(self._exported, groups, data.dense, patch)
        return Served(served.tables, program, source, served.deltas + (header.path.name,), patch)

    def _failed_before(self, path: Path) -> Refusal | None:
        """The refusal of this delta when it was refused before and its files have not changed since."""
        seen = self._failed.get(path.name)
        if seen is None or seen[0] != _stat(path):
            self._failed.pop(path.name, None)
            return None
        return seen[1]

    # -- inference ------------------------------------------------------------------------------

    def logits(self, dense: torch.Tensor, sparse: SparseFeatures) -> torch.Tensor:
        """Logits ``[B]`` of ``dense [B, num_dense]`` and the sparse batch (any feature order; extra
        features are ignored; per-id weights are refused)."""
        values, offsets = self.check(dense, sparse)
        return self.logits_raw(dense, values, offsets)

    def predict(self, dense: torch.Tensor, sparse: SparseFeatures) -> torch.Tensor:
        """Click probabilities ``[B]`` (float32)."""
        return torch.sigmoid(self.logits(dense, sparse))

    def predict_batch(self, batch: Batch) -> torch.Tensor:
        return self.predict(batch.dense, batch.sparse)

    def logits_raw(self, dense: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                   served: Served | None = None) -> torch.Tensor:
        """The program on checked inputs: ids feature-major in the order of :attr:`features`."""
        s = self._served if served is None else served  # read once: one version per call
        with torch.no_grad():
            return s.run(dense, values, offsets, *s.table_args)

    def check(self, dense: torch.Tensor, sparse: SparseFeatures) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, offsets) of `sparse` in the artifact's feature order; InputError naming what is wrong."""
        check_model_inputs("served model", dense, self.num_dense, sparse)
        missing = [f for f in self.features if f not in sparse]
        if missing:
            raise InputError(f"sparse features {missing} are missing (the model reads {list(self.features)})")
        if sparse.weights_or_none() is not None:
            raise NotImplementedError("per-id weights are not served yet: give ids without weights")
        if sparse.device.type != "cpu" or dense.device.type != "cpu":
            raise InputError("the served model runs on the CPU: give CPU tensors")
        if tuple(sparse.keys()) != self.features:
            sparse = sparse.select(list(self.features))
        sparse.validate()
        values = sparse.values()
        if values.dtype != torch.int64:
            raise InputError(f"sparse ids must be int64, got {values.dtype}")
        return values, sparse.offsets().to(torch.int64)


def _reason(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return text if isinstance(e, (_runtime.ArtifactError, ArtifactError)) else f"{type(e).__name__}: {text}"


def _stat(path: Path) -> tuple:
    """What changes when a delta's files are replaced or edited: each entry's name, inode, size and mtime."""
    out = []
    for here, dirs, files in os.walk(path):  # never follows a link
        for name in sorted(dirs + files):
            try:
                st = os.lstat(os.path.join(here, name))
            except OSError:
                continue
            out.append((os.path.join(here, name), st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))
