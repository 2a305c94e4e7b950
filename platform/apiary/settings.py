"""Typed settings with the ``APIARY_`` environment prefix.

Paths are computed on access from ``home`` so tests can redirect everything with one
variable (``APIARY_HOME``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="APIARY_", extra="ignore")

    home: Path = Field(default=Path("~/.apiary"), description="State directory of the embedded platform.")
    api_url: str | None = Field(default=None, description="Control-plane URL; overrides the one recorded in home.")
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL; default an SQLite file in home (postgresql+psycopg://... for PostgreSQL).",
    )
    user: str | None = Field(default=None, description="Default user for CLI submissions (else the login name).")
    node_lost_after_s: float = Field(
        default=30.0, description="A node whose agent has not reported for this long is lost; its tasks are retried."
    )
    alert_actions: Path | None = Field(
        default=None, description="Alert actions config (YAML); default the packaged default-actions.yaml."
    )
    lazy_preemption: bool = Field(
        default=False,
        description="HiveD lazy preemption: downgrade victims to opportunistic, stop them only if needed.",
    )
    tick_s: float = Field(default=1.0, description="Scheduling-loop period when nothing wakes it earlier, seconds.")

    @property
    def home_dir(self) -> Path:
        return self.home.expanduser()

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home_dir / 'apiary.db'}"

    @property
    def logs_dir(self) -> Path:
        return self.home_dir / "task-logs"

    @property
    def run_dir(self) -> Path:
        return self.home_dir / "run"

    @property
    def cluster_path(self) -> Path:
        return self.home_dir / "cluster.yaml"

    def resolved_api_url(self) -> str | None:
        """``APIARY_API_URL`` if set, else the URL a running ``apiary up`` recorded in ``home/run/api_url``."""
        if self.api_url:
            return self.api_url.rstrip("/")
        path = self.run_dir / "api_url"
        return path.read_text().strip() if path.exists() else None
