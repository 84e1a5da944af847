"""The fault suite (issue #8): steady load through the router while servers die and the WAN stalls.

``scripts/fault_suite.py`` runs it; ``load`` sends and classifies requests, ``faults`` holds one
class per fault, ``suite`` starts the cluster and measures each fault.
"""
