"""A deterministic discrete-event simulator of P / RLD / MD across datacenters.

Placement, handoff-mode and singular-filter decisions come from pdd_sglang.policy, the module
the router and the relay server use.
"""
