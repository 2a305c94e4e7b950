"""The detectors' settings (``detectors.yaml`` beside this module is the packaged default).

Each rule has ``enabled``; a rule switched off builds no detector (:class:`apiary.aiops.predictor.
Predictor` skips it). Loading raises :class:`~apiary.errors.ValidationError` naming the field.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticValidationError

from apiary.errors import ValidationError

ANOMALY_RULES = ("gpu-temperature", "ecc-sbe-rate", "job-utilisation", "vc-queue-delay")
FAILURE_RULE = "node-failure"
RULES = (*ANOMALY_RULES, FAILURE_RULE)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AnomalyRule(_Model):
    """One univariate detector (river's ``GaussianScorer`` over a rolling window)."""

    enabled: bool = True
    window: int = Field(24, ge=2, description="Observations the Gaussian is fitted over.")
    grace: int = Field(6, ge=1, description="Observations before the detector may fire.")
    score_min: float = Field(0.999, gt=0, le=1, description="GaussianScorer score (0..1) to fire at.")
    min_delta: float = Field(0.0, ge=0, description="Distance from the window's mean to fire at, in the series' unit.")


class FailureRule(_Model):
    """The node-failure predictor."""

    enabled: bool = True
    probability_min: float = Field(0.5, gt=0, lt=1, description="Model probability to warn at.")
    horizon_intervals: int = Field(24, ge=1, description="A warning promises a failure within this many observations.")
    window_intervals: int = Field(6, ge=2, description="Observations the features look back over.")


class Rules(_Model):
    gpu_temperature: AnomalyRule = Field(default_factory=AnomalyRule, alias="gpu-temperature")
    ecc_sbe_rate: AnomalyRule = Field(default_factory=AnomalyRule, alias="ecc-sbe-rate")
    job_utilisation: AnomalyRule = Field(default_factory=AnomalyRule, alias="job-utilisation")
    vc_queue_delay: AnomalyRule = Field(default_factory=AnomalyRule, alias="vc-queue-delay")
    node_failure: FailureRule = Field(default_factory=FailureRule, alias="node-failure")

    def anomaly(self, name: str) -> AnomalyRule:
        """The anomaly rule called ``name`` (one of :data:`ANOMALY_RULES`); KeyError otherwise."""
        if name not in ANOMALY_RULES:
            raise KeyError(name)
        rule: AnomalyRule = getattr(self, name.replace("-", "_"))
        return rule


class AiopsConfig(_Model):
    """``{"rules": {<rule name>: {...}}}``; rules left out keep their defaults."""

    rules: Rules = Field(default_factory=Rules)

    def enabled(self, name: str) -> bool:
        """Whether rule ``name`` (one of :data:`RULES`) is switched on."""
        if name == FAILURE_RULE:
            return self.rules.node_failure.enabled
        return self.rules.anomaly(name).enabled

    def with_disabled(self, *names: str) -> AiopsConfig:
        """A copy with the rules ``names`` switched off."""
        data = self.model_dump(by_alias=True)
        for name in names:
            if name not in RULES:
                raise ValidationError("rules", f"unknown rule {name!r}; rules: {', '.join(RULES)}")
            data["rules"][name]["enabled"] = False
        return AiopsConfig.model_validate(data)


def parse_config(data: Any) -> AiopsConfig:
    """Validate a mapping (e.g. parsed YAML). Raises ValidationError naming the first bad field."""
    try:
        return AiopsConfig.model_validate(data or {})
    except PydanticValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "rules"
        raise ValidationError(where, err["msg"]) from e


def load_config(path: Path | None = None) -> AiopsConfig:
    """The config in ``path``, or the packaged ``detectors.yaml`` when None."""
    text = path.read_text() if path is not None else resources.files("apiary.aiops").joinpath(
        "detectors.yaml").read_text()
    return parse_config(yaml.safe_load(text))
