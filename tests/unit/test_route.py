from types import SimpleNamespace

import msgspec
import pytest

from pdd_sglang.route import ROUTE_ACTION_TYPE, RouteError, route_kv_hints, route_of


def as_envelope(hints: dict):
    """What SGLang makes of the JSON: objects with attributes (its KvHintsEnvelope)."""
    actions = [SimpleNamespace(**a) for a in hints["actions"]]
    return SimpleNamespace(protocol_version=hints["protocol_version"], actions=actions)


@pytest.mark.parametrize("pipeline, destinations", [("prefill_main", 1), ("prefill_relay_main", 2),
                                                    ("relay_singular", 1)])
def test_route_round_trips_through_kv_hints(pipeline, destinations):
    route = route_of(as_envelope(route_kv_hints(pipeline)))
    assert route.pipeline == pipeline and route.destinations == destinations


def test_sglangs_own_envelope_type_accepts_our_hints():
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    envelope = decode_kv_hints_envelope(route_kv_hints("prefill_relay_main"))
    assert route_of(envelope).destinations == 2


def test_no_hints_or_other_actions_mean_plain_pd():
    assert route_of(None) is None
    other = SimpleNamespace(actions=[SimpleNamespace(action_type="hicache.prefetch",
                                                     action_version="1", payload={})])
    assert route_of(other) is None


def test_unknown_pipeline_is_refused_at_the_source():
    with pytest.raises(msgspec.ValidationError):
        route_kv_hints("relay_only")


@pytest.mark.parametrize("action", [
    {"action_type": ROUTE_ACTION_TYPE, "action_version": "2", "payload": {"pipeline": "prefill_main"}},
    {"action_type": ROUTE_ACTION_TYPE, "action_version": "1", "payload": {"pipeline": "p2p"}},
    {"action_type": ROUTE_ACTION_TYPE, "action_version": "1", "payload": {"pipeline": "prefill_main", "x": 1}},
])
def test_bad_route_actions_are_refused(action):
    with pytest.raises(RouteError):
        route_of(SimpleNamespace(actions=[SimpleNamespace(**action)]))
