"""What PDD servers report about themselves: ``/server_info`` (``server_info``, which each role
fills through providers it registers), Prometheus series (``metrics``), the prefill's WAN-line
report file (``line_report``) and the KV digest (``kv_digest``). Imports no role."""
