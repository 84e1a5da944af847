"""The model classes the tiny test models need, for SGLang's ``SGLANG_EXTERNAL_MODEL_PACKAGE``.

SGLang's model registry imports every module under ``sglang.srt.models`` (about 250) when a
scheduler starts, unless this variable names a package whose classes it registers first; a model
found there skips the rest (``ModelRegistry.resolve_model_cls``' fast path), any other model still
loads the defaults. Every server the dev tools start runs a tiny Llama, so each start skips those
imports (measured: 1.7 CPU-s of each scheduler's start on this machine). The class is SGLang's own
``LlamaForCausalLM``; nothing here changes what runs.
"""
