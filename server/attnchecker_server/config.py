"""Collector settings, read from ATTNCHECKER_* environment variables; built by the caller, never at import."""

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "normalise_database_url"]


def normalise_database_url(url: str) -> str:
    """Point PostgreSQL URLs at psycopg 3, whatever spelling the operator used."""
    for prefix in ("postgres://", "postgresql://", "postgresql+psycopg2://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ATTNCHECKER_", env_ignore_empty=True, extra="ignore")

    data_dir: Path = Path("data")
    """Where the default SQLite database lives (created on first use)."""
    database_url: str | None = None
    """SQLAlchemy URL; empty means SQLite at <data_dir>/attnchecker.db. postgres:// URLs are rewritten to psycopg 3."""
    max_body_bytes: int = Field(default=1024 * 1024, ge=1)
    """Request bodies above this get 413 before anything is parsed."""
    max_events_per_batch: int = Field(default=1000, ge=1)
    open_reads: bool = False
    """When true, GET endpoints and /metrics need no token (viewer access for everyone)."""
    metrics_recent_seconds: float = Field(default=3600.0, gt=0)
    """Finished runs stay in /metrics this long after they were last seen."""
    metrics_cache_seconds: float = Field(default=2.0, ge=0)
    """A scrape within this many seconds of the previous refresh reuses its result."""
    metrics_max_runs: int = Field(default=500, ge=1)
    """Bound on the runs /metrics exposes: every live run, then finished ones (most recently seen first) up to this."""
    metrics_device_recent_seconds: float = Field(default=86400.0, gt=0)
    """Devices stay in /metrics this long after a rank on them last reported."""
    metrics_max_devices: int = Field(default=2000, ge=1)
    """Bound on the devices /metrics exposes (most recently seen first); attnchecker_metrics_devices_omitted counts
    the recent ones left out."""
    max_live_runs_per_token: int = Field(default=100, ge=1)
    """Live runs one agent token may hold (registering another is a 429); operators and run-bound tokens have none."""
    run_abandoned_seconds: float = Field(default=86400.0, gt=0)
    """A running run not heard from for this long is abandoned: it leaves its token's quota and the live runs of
    /metrics (its agent died without finishing it)."""
    suspicion_alpha: float = Field(default=0.01, gt=0, lt=1)
    """Family-wise false-alarm rate of the suspicion test over the fleet (Holm): docs/collector.md, Suspicion."""
    suspicion_min_fault_runs: int = Field(default=2, ge=1)
    """A device is significant only if it faulted in at least this many runs."""

    @field_validator("database_url")
    @classmethod
    def _normalise(cls, value: str | None) -> str | None:
        return normalise_database_url(value) if value else None

    @property
    def effective_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'attnchecker.db').resolve()}"
