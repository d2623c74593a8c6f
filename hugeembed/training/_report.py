"""The Trainer's reports: samples/s, the tiers' figures and the run's summary."""

from __future__ import annotations

from typing import Any

from ._distributed import aligned, empty_batch, merged_tier_stats, run_info

__all__ = ["TrainerReport"]


class TrainerReport:
    """Mixed into Trainer (which holds cfg, state, collection, model, source, ...)."""

    def _tier_stats(self) -> dict | None:
        """The tiers' figures of every rank (collective with several processes)."""
        if self.world_size == 1:
            return self.collection.tier_stats()
        if self.collection.has_tiered_tables:
            self.collection.drain()  # its collective and the counters it reads: with the exchange thread idle
        return merged_tier_stats(self.collection)

    def samples_per_s(self) -> float:
        return self.state.samples / self.state.train_seconds if self.state.train_seconds else 0.0

    def _aligned(self, batches):
        """Sharded: this rank's `batches`, then empty ones until every rank has run out (each forward is a
        collective)."""
        return aligned(batches, self.collection, empty_batch(self.collection.feature_names(), self.model.num_dense,
                                                             self.device))

    def summary(self) -> dict[str, Any]:
        st = self.state
        if self.world_size > 1:
            info = run_info(self.collection)
            rows, table_bytes = info["rows"], info["bytes"]
        else:
            rows = self.collection.num_rows()
            table_bytes = sum(self.collection.memory_bytes().values())
        dense_bytes = sum(p.numel() * p.element_size() for p in self.model.dense_parameters())
        out: dict[str, Any] = {
            "model": self.cfg.model, "steps": st.step, "epochs": st.epoch, "samples": st.samples,
            "samples_per_s": self.samples_per_s(), "train_seconds": st.train_seconds,
            "final_train_loss": st.history["loss"][-1] if st.history["loss"] else float("nan"),
            "table_rows": sum(rows.values()), "table_rows_per_table": rows, "table_bytes": table_bytes,
            "dense_bytes": dense_bytes, "device": str(self.device), "world_size": self.world_size,
            "servers": self.cfg.servers if self.world_size > 1 else 0,
            "data": self.source.description,
        }
        out.update(st.last_eval or {})
        out.update(self.stale.waits() if self.world_size > 1 else {})
        if self.count_calibration is not None:
            out["count_calibration"] = self.count_calibration
        if self.epoch_choice is not None:
            out["chosen_epochs"], out["tail_auc"] = self.epoch_choice.epochs, list(self.epoch_choice.tail_auc)
        tiers = self._tier_stats()
        if tiers is not None:
            out.update({k: tiers[k] for k in ("cache_hit_rate", "table_bytes_resident", "table_bytes_stored")})
            out["tiers"] = tiers["tables"]
        bayes = self.source.bayes()
        if bayes is not None:
            out["bayes_auc"], out["bayes_logloss"] = bayes.auc, bayes.logloss
        out["history"] = st.history
        return out
