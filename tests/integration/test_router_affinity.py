"""Cache affinity across mains: with two mains, the router keeps each conversation on the main that
holds its prefix, and the WAN bytes the prefill sends (measured at the sender) show what that saves
against spreading the same turns over both mains."""

from __future__ import annotations

import json
import urllib.request

import pytest

from pdd_sglang.dev.testing.conversation import FIRST_WORD_ID, WORDS
from pdd_sglang.dev.testing.pd_client import generate_fanout
from pdd_sglang.dev.testing.wan_cluster import RouterProcess

TURNS = 4
CONVERSATIONS = 3
MAX_NEW_TOKENS = 4


def words(seed: int, count: int) -> list[int]:
    return [FIRST_WORD_ID + (seed * 131 + i * 7) % WORDS for i in range(count)]


@pytest.fixture(scope="module")
def two_mains(shared_clusters):
    """The page-1 cluster's prefill and both its mains, behind a router of their own."""
    cluster = shared_clusters.get(1)
    router = RouterProcess(cluster.log_dir / "router-two-mains.log", [
        "--prefill", cluster["prefill"].url, str(cluster.bootstrap_port),
        "--main", cluster["main"].url, cluster["main2"].url])
    try:
        router.start()
        yield _TwoMains(cluster, router)
    finally:
        router.stop()


class _TwoMains:
    def __init__(self, cluster, router):
        self.servers = {"prefill": cluster["prefill"], "main1": cluster["main"],
                        "main2": cluster["main2"]}
        self.bootstrap_port = cluster.bootstrap_port
        self.router = router

    def __getitem__(self, name):
        return self.servers[name]


def bytes_to_mains(cluster) -> int:
    rows = cluster["prefill"].pdd_state()["transfers"]["by_destination"].values()
    return sum(row["bytes"] for row in rows if row["role"] == "main")


def via_router(cluster, prompt: list[int]) -> tuple[list[int], str]:
    body = {"input_ids": prompt,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0}}
    request = urllib.request.Request(cluster.router.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **cluster.router.headers})
    with urllib.request.urlopen(request, timeout=300) as resp:
        answer = json.loads(resp.read())
    return answer["output_ids"], answer["meta_info"]["pdd"]["main"]


def conversations(seed_base: int):
    return [(words(seed_base + c, 300), [words(seed_base + 100 * c + t, 40) for t in range(TURNS)])
            for c in range(CONVERSATIONS)]


def test_router_keeps_conversations_on_their_main_and_saves_wan_bytes(two_mains):
    mains = [two_mains["main1"], two_mains["main2"]]

    before = bytes_to_mains(two_mains)
    placements = []
    for system, users in conversations(seed_base=1):
        prompt, used = list(system), []
        for user in users:
            prompt = prompt + user
            output, main_url = via_router(two_mains, prompt)
            used.append(main_url)
            prompt = prompt + output
        placements.append(used)
    routed = bytes_to_mains(two_mains) - before
    for used in placements:
        assert len(set(used)) == 1, placements  # every turn of a conversation on one main

    # The same shape of traffic, fresh prompts, spread over both mains turn by turn.
    before = bytes_to_mains(two_mains)
    for system, users in conversations(seed_base=500):
        prompt = list(system)
        for turn, user in enumerate(users):
            prompt = prompt + user
            body = {"input_ids": prompt,
                    "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0}}
            main = mains[turn % 2]
            answer = generate_fanout(two_mains["prefill"], [main], body, two_mains.bootstrap_port,
                                     "prefill_main")[main.name]
            prompt = prompt + answer["output_ids"]
    spread = bytes_to_mains(two_mains) - before

    print(f"\nWAN bytes to mains: routed with affinity {routed}, spread over both {spread} "
          f"(ratio {routed / spread:.2f})")
    assert routed < 0.6 * spread, (routed, spread)
    for server in two_mains.servers.values():
        pool = server.wait_idle()
        assert pool["in_use_tokens"] == 0 and pool["locked_tokens"] == 0, (server.name, pool)
