"""Development tools, never imported by serving code: test clusters (``testing``), the WAN
emulator, the fault suite, the demo, the router benchmark and CPU profiling.

``cpu_standin/`` is no package of this one: it is a ``sys.path`` entry (a ``.pth`` file of the CPU
venv, ``scripts/setup_env.sh``) that holds an import-only ``sgl_kernel``."""
