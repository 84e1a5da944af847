"""A test server whose port another process took before it bound it moves to a fresh port
(dev/testing/cluster.py), whether it starts in a Cluster or alone (the shared reference)."""

from __future__ import annotations

import pytest

from pdd_sglang.dev.testing.cluster import PortTaken, SGLangServer


class _Racing(SGLangServer):
    """Loses the race for its port ``losses`` times, then answers."""

    def __init__(self, losses: int):
        super().__init__("plain", "/nonexistent-model", log_dir=None)
        self.losses, self.moves = losses, 0

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        if self.losses:
            self.losses -= 1
            raise PortTaken(f"{self.name}: port {self.port} was taken")

    def restart_on_new_port(self) -> None:
        self.moves += 1


def test_a_server_that_lost_its_port_moves_until_it_answers():
    server = _Racing(losses=2)
    server.wait_ready_moving_port(1.0)
    assert server.moves == 2


def test_a_server_that_keeps_losing_its_port_gives_up_after_its_tries():
    server = _Racing(losses=3)
    with pytest.raises(PortTaken):
        server.wait_ready_moving_port(1.0, tries=3)
    assert server.moves == 2
