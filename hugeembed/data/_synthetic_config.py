"""SyntheticConfig: the parameters of SyntheticCriteo's planted model (data/_synthetic.py says
what each term of the model is), and the Criteo-Kaggle cardinalities its features follow."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ._schema import CAT_NAMES

__all__ = ["SyntheticConfig", "CRITEO_KAGGLE_CARDINALITIES"]

CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)


@dataclass(frozen=True)
class SyntheticConfig:
    """Parameters of the planted model (all have Criteo-like defaults).

    Args:
        seed: everything (ids, effects, labels) is a function of the seed and the row index.
        max_cardinality: cap on each feature's number of distinct ids (None = Kaggle counts).
        zipf_exponent: skew of the id distribution (Criteo is ~1.05).
        target_ctr: mean label the bias is calibrated to.
        effect_features: features with a per-id effect on the logit.
        effect_scale: standard deviation of a hot id's effect.
        hot_ids: rank where effects have faded to 1/sqrt(2) of their hot strength.
        interactions: feature pairs with a rank-`interaction_rank` latent dot-product effect.
        interaction_scale: standard deviation of a hot pair's interaction effect.
        dense_scale: size of the dense weights.
    """

    seed: int = 0
    max_cardinality: int | None = None
    zipf_exponent: float = 1.05
    target_ctr: float = 0.25
    effect_features: tuple[str, ...] = ("C1", "C2", "C3", "C4", "C6", "C9", "C11", "C14", "C16", "C17")
    effect_scale: float = 0.5
    hot_ids: int = 1000
    interactions: tuple[tuple[str, str], ...] = (("C1", "C2"), ("C3", "C6"), ("C11", "C14"))
    interaction_rank: int = 4
    interaction_scale: float = 0.5
    dense_scale: float = 0.2

    def cardinalities(self) -> tuple[int, ...]:
        """Distinct ids (Zipf ranks) of C1..C26: the Kaggle counts capped by `max_cardinality` (a feature's
        missing id comes on top)."""
        cap = self.max_cardinality or max(CRITEO_KAGGLE_CARDINALITIES)
        return tuple(min(c, cap) for c in CRITEO_KAGGLE_CARDINALITIES)

    def __post_init__(self) -> None:
        if self.max_cardinality is not None and self.max_cardinality < 1:
            raise ConfigError(f"max_cardinality must be >= 1, got {self.max_cardinality}")
        if not self.zipf_exponent > 1.0:
            raise ConfigError(f"zipf_exponent must be > 1, got {self.zipf_exponent}")
        if not 0.0 < self.target_ctr < 1.0:
            raise ConfigError(f"target_ctr must be in (0, 1), got {self.target_ctr}")
        for name in self.effect_features + tuple(f for pair in self.interactions for f in pair):
            if name not in CAT_NAMES:
                raise ConfigError(f"unknown categorical feature {name!r} in SyntheticConfig (C1..C26)")
        if not 1 <= self.interaction_rank <= 4:
            raise ConfigError(f"interaction_rank must be 1..4, got {self.interaction_rank}")
        if self.hot_ids < 1 or self.effect_scale < 0 or self.interaction_scale < 0 or self.dense_scale < 0:
            raise ConfigError("hot_ids must be >= 1 and the scales >= 0")
