"""SGLang's own chat translation, in-process, as the reference of the router's parity tests.

    python -m pdd_sglang.dev.testing.chat_reference --model-path M [--tool-call-parser P]
        [--reasoning-parser R] < requests.json > translations.json

Builds SGLang's ``OpenAIServingChat`` outside any server (SGLang's runtime configuration
published from a ``ServerArgs`` of the same flags, the model's config, SGLang's template
manager, the model's tokenizer, a tokenizer-manager stand-in with what the chat serving reads)
and answers, for each chat request of a JSON list, the prompt's token ids and the sampling
parameters its ``_convert_to_internal_request`` builds (or SGLang's refusal). Run as its own
process: publishing SGLang's configuration changes process-wide state that a test process
must not keep.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


class _TokenizerManager:
    """What OpenAIServingChat reads of SGLang's TokenizerManager outside a server."""

    def __init__(self, server_args, tokenizer, model_config):
        from sglang.srt.runtime_context import get_context

        self.server_args, self.tokenizer, self.model_config = server_args, tokenizer, model_config
        self.served_model_name = self.model_path = server_args.model_path
        self.processor = None
        self._context = get_context()

    def config_value(self, name: str):
        return self._context.config_leaf(name)


def serving_chat(model_path: str, tool_call_parser=None, reasoning_parser=None) -> Any:
    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.parser.template_manager import TemplateManager
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoTokenizer

    args = ServerArgs(model_path=model_path, device="cpu", tool_call_parser=tool_call_parser,
                      reasoning_parser=reasoning_parser)
    runtime_context.publish(args, role="tokenizer")
    manager = _TokenizerManager(args, AutoTokenizer.from_pretrained(model_path),
                                ModelConfig.from_server_args(args))
    templates = TemplateManager()
    templates.initialize_templates(manager, model_path=model_path)
    return OpenAIServingChat(manager, templates)


def translate(chat: Any, body: dict) -> dict:
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate(body)
    error = chat._validate_request(request)
    if error:
        return {"error": error}
    try:
        adapted, _ = chat._convert_to_internal_request(request)
    except ValueError as err:
        return {"error": str(err)}
    return {"input_ids": list(adapted.input_ids) if adapted.input_ids is not None else None,
            "text": adapted.text, "sampling_params": dict(adapted.sampling_params)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--tool-call-parser")
    parser.add_argument("--reasoning-parser")
    args = parser.parse_args(argv)
    chat = serving_chat(args.model_path, args.tool_call_parser, args.reasoning_parser)
    requests = json.load(sys.stdin)
    json.dump([translate(chat, body) for body in requests], sys.stdout)


if __name__ == "__main__":
    main()
