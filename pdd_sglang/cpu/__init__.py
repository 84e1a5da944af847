"""The CPU profile: what SGLang needs to serve on a machine without a GPU.

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``, ``--attention-backend
torch_native``) still imports ``sgl_kernel`` at module level in many places, and no CPU build of
``sgl_kernel`` is published. ``standin/sgl_kernel`` is an import-only stand-in: every attribute is
a function that raises, naming the kernel, if it is ever called. ``scripts/setup_env.sh`` puts
``standin/`` on the CPU venv's path with a ``.pth`` file; the GPU profile installs the real kernel.
"""
