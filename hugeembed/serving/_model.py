"""ServingModel: a loaded artifact (plus its deltas) called on dense features and SparseFeatures.

The served state (tables, program, version) is one immutable object swapped by a single
assignment: a call reads it once, so every call sees the old model or the new one whole.
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
from . import _runtime
from ._runtime import Tables

__all__ = ["ServingModel", "Served"]


@dataclass(frozen=True)
class Served:
    """One version of the model: what every call reads at once."""

    tables: Tables
    program: Any
    source: dict[str, Any]  # the snapshot these rows and this program come from (name, step, manifest_sha256)
    deltas: tuple[str, ...]  # artifact deltas applied on the base, in order

    @property
    def version(self) -> str:
        """The training snapshot served, e.g. ``step-000000400``."""
        return str(self.source["name"])


def _artifact_error(e: _runtime.ArtifactError) -> ArtifactError:
    return ArtifactError(str(e))


class ServingModel:
    """A frozen model for inference: tables memory-mapped, the dense part an exported program.

    Example::

        model = ServingModel.load("dlrm.int8")          # base artifact + the deltas in its deltas/
        probs = model.predict(batch.dense, batch.sparse)  # [B] click probabilities
        model.reload()                                    # apply deltas written since (export --delta)

    Unknown ids read zeros, ids < 0 are dropped; nothing is ever inserted or counted.
    """

    def __init__(self, directory: Path, manifest: dict[str, Any], served: Served) -> None:
        self.directory, self.manifest = directory, manifest
        self.dtype: str = manifest["dtype"]
        self.features: tuple[str, ...] = tuple(manifest["features"]["sparse"])
        self.num_dense: int = int(manifest["features"]["dense"])
        self.schema: Schema | None = self._schema(manifest, directory)
        self._served = served
        self._reload_lock = threading.Lock()  # one reload at a time; calls never wait for it

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
    def load(cls, directory: str | os.PathLike, *, apply_deltas: bool = True) -> "ServingModel":
        """Loads the artifact at `directory` (every file verified; tables memory-mapped) and, unless
        ``apply_deltas=False``, the chain of deltas under ``directory/deltas``.

        ArtifactError (naming the file) for a missing, damaged or foreign artifact."""
        directory = Path(directory)
        try:
            art = _runtime.load(directory)
        except _runtime.ArtifactError as e:
            raise _artifact_error(e) from None
        model = cls(directory, art.manifest, Served(art.tables, art.program, art.manifest["source"], ()))
        if apply_deltas:
            model.reload()
        return model

    # -- versions -------------------------------------------------------------------------------

    @property
    def version(self) -> str:
        return self._served.version

    @property
    def served(self) -> Served:
        return self._served

    def reload(self) -> list[str]:
        """Applies, in order, the deltas under ``deltas/`` that follow the served version; returns their
        names.  Each is checked (chain link, checksums) and built beside the served model, then
        swapped in whole; a refused delta changes nothing (ArtifactError naming it)."""
        from ._delta import apply_delta, pending_deltas

        with self._reload_lock:
            applied = []
            try:
                for path in pending_deltas(self.directory, self._served):
                    self._served = apply_delta(self.manifest, self._served, path)
                    applied.append(path.name)
            except _runtime.ArtifactError as e:
                raise _artifact_error(e) from None
            return applied

    def apply_delta(self, path: str | os.PathLike) -> str:
        """Applies the artifact delta at `path` (it must follow the served version); returns the new version.
        ArtifactError (and nothing changes) when it does not follow, or is damaged."""
        from ._delta import apply_delta

        with self._reload_lock:
            try:
                self._served = apply_delta(self.manifest, self._served, Path(path))
            except _runtime.ArtifactError as e:
                raise _artifact_error(e) from None
            return self.version

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
            return s.program(dense, values, offsets, *s.tables.args())

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
