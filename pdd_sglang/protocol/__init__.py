"""What PDD's servers and router say to each other: the wire messages (``messages``), a request's
route in SGLang's ``kv_hints`` (``route``) and the relay <-> main control channel
(``control_channel``). Imports no role: every role and the router import it."""
