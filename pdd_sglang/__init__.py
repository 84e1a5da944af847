"""pdd-sglang: cross-datacenter Prefill / Relay-decode / Main-decode disaggregation for SGLang.

This package must stay importable without sglang or torch: the router, the policy module and
the simulator run in environments that have neither.
"""

__version__ = "0.1.0"
