"""SGLang's own Llama classes, re-exported for the registry (see the package docstring)."""

from sglang.srt.models.llama import EntryClass  # noqa: F401
