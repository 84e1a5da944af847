from types import SimpleNamespace

import msgspec
import pytest

from pdd_sglang.protocol.route import ROUTE_ACTION_TYPE, RouteError, route_kv_hints, route_of


def as_envelope(hints: dict):
    """What SGLang makes of the JSON: objects with attributes (its KvHintsEnvelope)."""
    actions = [SimpleNamespace(**a) for a in hints["actions"]]
    return SimpleNamespace(protocol_version=hints["protocol_version"], actions=actions)


@pytest.mark.parametrize("pipeline, destinations", [("prefill_main", 1), ("prefill_relay_main", 2),
                                                    ("relay_singular", 1)])
def test_route_round_trips_through_kv_hints(pipeline, destinations):
    fields = {"relay_control": RELAY} if pipeline == "prefill_relay_main" else {}
    route = route_of(as_envelope(route_kv_hints(pipeline, **fields)))
    assert route.pipeline == pipeline and route.destinations == destinations
    assert route.relay_control == fields.get("relay_control")


RELAY = "tcp://10.0.0.1:5557"


def test_sglangs_own_envelope_type_accepts_our_hints():
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    envelope = decode_kv_hints_envelope(route_kv_hints("prefill_relay_main", relay_control=RELAY))
    route = route_of(envelope)
    assert route.destinations == 2 and route.relay_control == RELAY


def test_default_fields_stay_off_the_wire():
    payload = route_kv_hints("prefill_main")["actions"][0]["payload"]
    assert payload == {"pipeline": "prefill_main"}


@pytest.mark.parametrize("fields", [
    {},  # P->RLD->MD without the relay's address: main could never reach it
    {"relay_control": "10.0.0.1:5557"},
    # Test controls are no route field (they travel in an action of their own, test_debug_aids.py).
    {"relay_control": RELAY, "debug_handoff_after_tokens": 7},
    {"relay_control": RELAY, "debug_corrupt_wan_kv": True},
])
def test_bad_relay_main_routes_are_refused_at_the_source(fields):
    with pytest.raises((msgspec.ValidationError, ValueError)):
        route_kv_hints("prefill_relay_main", **fields)


def test_a_route_may_force_its_relays_handoff_mode_and_only_a_relay_route():
    hints = route_kv_hints("prefill_relay_main", relay_control=RELAY, handoff_mode="one-shot")
    assert route_of(as_envelope(hints)).handoff_mode == "one-shot"
    assert route_of(as_envelope(route_kv_hints("prefill_relay_main",
                                               relay_control=RELAY))).handoff_mode is None
    with pytest.raises(ValueError, match="only on a prefill_relay_main route"):
        route_kv_hints("prefill_main", handoff_mode="catch-up")
    with pytest.raises(msgspec.ValidationError):
        route_kv_hints("prefill_relay_main", relay_control=RELAY, handoff_mode="auto")


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
    {"action_type": ROUTE_ACTION_TYPE, "action_version": "1", "payload": {"pipeline": "prefill_relay_main"}},
])
def test_bad_route_actions_are_refused(action):
    with pytest.raises(RouteError):
        route_of(SimpleNamespace(actions=[SimpleNamespace(**action)]))
