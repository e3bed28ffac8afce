"""The sample channel: generated batches and the update's results between process groups.

With generation and training on different processes (asynchronous RL), the generating side sends
each batch it generates to the training side, and the training side sends back what the
generating side needs of each update (its metrics, for the logs process 0 writes, and the KL
coefficient). Every message is read once by its one reader and deleted then, so the coordination
service holds only messages in flight however long the run. ``control_bytes`` counts what went
through it, for the metrics.
"""

from __future__ import annotations

import json
from typing import Any

from jrlhf.meshes.processes import post, take
from jrlhf.ppo.staleness import GeneratedBatch


class SampleChannel:
    """Messages of one asynchronous run between its generating and its training side."""

    def __init__(self, prefix: str = "async"):
        self.prefix = prefix
        self.control_bytes = 0  # bytes through the coordination service so far, both ways

    def _post(self, key: str, value: Any) -> None:
        data = json.dumps(value).encode()
        self.control_bytes += len(data)
        post(f"{self.prefix}/{key}", data)

    def _take(self, key: str) -> Any:
        data = take(f"{self.prefix}/{key}")
        self.control_bytes += len(data)
        return json.loads(data)

    def send_batch(self, batch: GeneratedBatch) -> None:
        """Generating side: publish batch ``batch.index`` for the training side."""
        self._post(f"batch/{batch.index}", batch.to_json())

    def receive_batch(self, index: int) -> GeneratedBatch:
        """Training side: batch ``index``, waiting for the generating side to send it."""
        return GeneratedBatch.from_json(self._take(f"batch/{index}"))

    def send_result(self, iteration: int, result: dict[str, float]) -> None:
        """Training side: iteration ``iteration``'s metrics (and the KL coefficient after it)."""
        self._post(f"result/{iteration}", result)

    def receive_result(self, iteration: int) -> dict[str, float]:
        """Generating side: what :meth:`send_result` sent for ``iteration``."""
        return self._take(f"result/{iteration}")
