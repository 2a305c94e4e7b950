"""Small drill runs and a model trained on them, shared by the AIOps tests (module-scoped: a run is
~0.5 s of simulated scrapes)."""

from __future__ import annotations

import pytest

from apiary.aiops import AiopsConfig, DrillRun, FailureModel, ScenarioConfig, generate_run, load_config, train

#: Enough failures per run to learn from in a few runs; the full-size scenario is the bench's.
SMALL = ScenarioConfig(nodes=10, intervals=60, failing_share=0.4, sudden_share=0.1, lead_intervals=(3, 10),
                       noise_share=0.9)
TRAIN_SEEDS = tuple(range(6))
TEST_SEEDS = (500, 501, 502)


@pytest.fixture(scope="session")
def config() -> AiopsConfig:
    return load_config()


@pytest.fixture(scope="session")
def model(config: AiopsConfig) -> FailureModel:
    return train([generate_run(s, SMALL) for s in TRAIN_SEEDS], config)


@pytest.fixture(scope="session")
def held_out() -> list[DrillRun]:
    return [generate_run(s, SMALL) for s in TEST_SEEDS]
