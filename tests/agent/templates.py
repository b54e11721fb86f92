"""Chat-template fixtures written for these tests: a Qwen2.5-style ChatML template with tools (hermes
calls, tool messages grouped into one user turn of <tool_response> blocks) and a Llama-3.1-style one
(tools in the system turn, tool messages as 'ipython' turns), on the real Qwen2 vocabulary from
the shared data's qwen2_tokenizer (tests/conftest.py's SHARED_DATA: $JAXRL_SHARED_DATA, else ../shared/data; Llama 3's
header tokens added for the second)."""

from __future__ import annotations

import functools
import os

import pytest

# tests/conftest.py's SHARED_DATA, read the same way (this module is imported outside pytest's fixtures)
_SHARED = os.environ.get("JAXRL_SHARED_DATA",
                         os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data"))
TOKENIZER_DIR = os.path.join(_SHARED, "qwen2_tokenizer")

QWEN25_STYLE = (
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{%- else %}{{ 'You are a helpful assistant.' }}"
    "{%- endif -%}"
    "{{ '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "Function signatures are inside <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor -%}"
    "{{ '\\n</tools>\\n\\nReturn each call as a JSON object inside <tool_call></tool_call> tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}"
    "{%- if not (loop.first and tools) %}{{ '<|im_start|>system\\n' + m['content'] + '<|im_end|>\\n' }}{% endif -%}"
    "{%- elif m['role'] in ('user', 'assistant') -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}")

LLAMA31_STYLE = (
    "{{ '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools -%}"
    "{{ 'Environment: ipython\\nCall a function as JSON {\"name\": function name, \"parameters\": arguments}:' }}"
    "{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] | trim }}{% endif -%}"
    "{{ '<|eot_id|>' }}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}"
    "{%- elif m['role'] in ('tool', 'ipython') -%}"
    "{{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- else -%}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif -%}")

LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]


@functools.cache
def qwen2_tokenizer(style: str):
    """The real Qwen2 vocabulary with one of the templates above ('qwen2.5' or 'llama3.1'), built once a
    process (tokens are added on the Rust tokenizer: transformers' add_tokens re-indexes 151k entries)."""
    if not os.path.isdir(TOKENIZER_DIR):
        pytest.skip(f"no Qwen2 tokenizer at {TOKENIZER_DIR}")
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(os.path.join(TOKENIZER_DIR, "tokenizer.json"))
    if style == "qwen2.5":
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")])
    else:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIAL])
    eos = "<|im_end|>" if style == "qwen2.5" else "<|eot_id|>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>",
                                   chat_template=QWEN25_STYLE if style == "qwen2.5" else LLAMA31_STYLE)
