"""What a finished run reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class JobResult:
    """What ``Pipeline.run`` returns."""

    job: str
    checkpoint_dir: str
    completed_epochs: list[int]
    latest_checkpoint: str | None
    restarts: int
    records_in: int
    seconds: float
    metrics: dict[str, Any] = field(default_factory=dict)
    #: savepoint folders written during the run (triggered, or the stop-with-savepoint one last)
    savepoints: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "checkpoint_dir": self.checkpoint_dir,
            "completed_epochs": self.completed_epochs,
            "latest_checkpoint": self.latest_checkpoint,
            "restarts": self.restarts,
            "records_in": self.records_in,
            "seconds": round(self.seconds, 6),
            "savepoints": self.savepoints,
            "metrics": self.metrics,
        }
