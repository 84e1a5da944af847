"""The fault suite (issue #8): steady load through the router while servers die and the WAN stalls;
and the chaos soak (issue #22): multi-turn load under seeded random faults, every answer checked.

``scripts/fault_suite.py`` runs both; ``load`` sends and classifies requests, ``faults`` holds one
class per fault, ``suite`` starts the cluster and measures each fault, ``soak`` runs the soak and
``checks`` holds what it verifies once its load has drained.
"""
