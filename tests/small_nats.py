"""A nats-server with a small `max_payload`, for the paths a leg or a chunk takes near the limit."""

from __future__ import annotations

from kvswitch.servers import NatsServer


class SmallNats(NatsServer):
    def __init__(self, max_payload: int) -> None:
        super().__init__()
        self.max_payload = max_payload

    def config_text(self) -> str:
        return super().config_text() + f"max_payload: {self.max_payload}\n"
