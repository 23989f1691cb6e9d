"""Training chat templates with `{% generation %}` markers, one per template family.

Why: HF's `return_assistant_tokens_mask` only marks text between `{% generation %}` and
`{% endgeneration %}`; templates shipped for inference lack them and give all-zero masks
(DESIGN, "Lessons"). The end-of-turn token sits inside the marked span so the model
learns to stop; `END_OF_TURN` names it per family, since it is not always the eos token
(Llama-3 ends a turn with `<|eot_id|>`).

Both templates render what chat rows hold (seed 003, "Conversations and tool calls", "Images"):
- content as a string, or as a list of parts: text parts concatenated, each image part the vision
  placeholder `<|vision_start|><|image_pad|><|vision_end|>` (one pad per image; the loader expands
  it to the processor's count, DESIGN "assemble at load time");
- row-level `tools`, assistant `tool_calls` and `tool` messages. Arguments given as a string are
  inserted verbatim; a mapping goes through transformers' `tojson`, which calls
  `json.dumps(sort_keys=False)` and so keeps the key order as written (DESIGN, "Lessons": tool-call
  JSON must not be reordered; tests/test_render_chat.py pins this).

ChatML follows Qwen2.5: tools listed as JSON lines inside `<tools>`…`</tools>` in a system block,
each call as `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`, consecutive tool messages
inside one user turn as `<tool_response>`…`</tool_response>`. A conversation without tools, tool
calls or content parts renders exactly as the first ChatML template did (the VFlash shards and the
smoke tokenizer's fingerprint rely on that).

Llama-3 follows Llama 3.1: `<|begin_of_text|>`, `<|start_header_id|>role<|end_header_id|>\n\n`,
content, `<|eot_id|>`; tools listed in a system block; one call per assistant message as
`{"name": …, "parameters": …}` (the 3.1 template refuses more, and so does this one); tool results
in `ipython` turns. Unlike the shipped Llama templates, content is not trimmed and no date is
written: a training sequence must be a pure function of the row.
"""

VISION_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"

# Text parts concatenated, images as the vision slot; anything else is an error, never dropped.
_CONTENT_MACRO = (
    "{%- macro render_content(content) -%}"
    "{%- if content is not defined or content is none -%}"
    "{%- elif content is string -%}{{- content -}}"
    "{%- else -%}"
    "{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- '" + VISION_SLOT + "' -}}"
    "{%- else -%}{{- raise_exception('unknown content part type: ' ~ part['type']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
)

# A call's arguments: a string verbatim, otherwise tojson (key order kept, see the docstring).
_ARGUMENTS_MACRO = (
    "{%- macro render_arguments(arguments) -%}"
    "{%- if arguments is string -%}{{- arguments -}}{%- else -%}{{- arguments | tojson -}}{%- endif -%}"
    "{%- endmacro -%}"
)

CHATML = (
    _CONTENT_MACRO + _ARGUMENTS_MACRO
    + "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- render_content(messages[0]['content']) + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and tools and loop.first -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{%- set text = render_content(message['content']) -%}"
    "{{- text -}}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set function = call['function'] if call['function'] is defined else call -%}"
    "{%- if text or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (function['name'] | tojson) + ', \"arguments\": ' -}}"
    "{{- render_arguments(function['arguments']) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + render_content(message['content']) + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + render_content(message['content']) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

LLAMA3 = (
    _CONTENT_MACRO + _ARGUMENTS_MACRO
    + "{{- '<|begin_of_text|>' -}}"
    "{%- if tools -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' -}}"
    "{{- 'You have access to the following functions. To call a function, please respond with JSON for a "
    "function call. Respond in the format {\"name\": function name, \"parameters\": dictionary of argument "
    "name and its value}. Do not use variables.\\n\\n' -}}"
    "{%- for tool in tools -%}{{- (tool | tojson(indent=4)) + '\\n\\n' -}}{%- endfor -%}"
    "{%- if messages[0]['role'] == 'system' -%}{{- render_content(messages[0]['content']) -}}{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and tools and loop.first -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- generation -%}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- if message['tool_calls'] | length != 1 -%}"
    "{{- raise_exception('the llama3 template renders one tool call per assistant message, got ' "
    "~ (message['tool_calls'] | length)) -}}"
    "{%- endif -%}"
    "{%- if render_content(message['content']) -%}"
    "{{- raise_exception('the llama3 template renders an assistant message with tool_calls without text') -}}"
    "{%- endif -%}"
    "{%- set call = message['tool_calls'][0] -%}"
    "{%- set function = call['function'] if call['function'] is defined else call -%}"
    "{{- '{\"name\": ' + (function['name'] | tojson) + ', \"parameters\": ' -}}"
    "{{- render_arguments(function['arguments']) + '}' -}}"
    "{%- else -%}"
    "{{- render_content(message['content']) -}}"
    "{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endgeneration -%}"
    "{%- else -%}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] -%}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + render_content(message['content']) -}}"
    "{{- '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

TRAINING_TEMPLATES: dict[str, str] = {"chatml": CHATML, "llama3": LLAMA3}

# The token that closes an assistant turn, per family: the one that must end every trained span.
END_OF_TURN: dict[str, str] = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}

# The token that opens every turn, per family: rendering can encode the text turn by turn, cut just
# before it (render.common.ChatTemplater), and a system turn listing the same tools is encoded once.
TURN_START: dict[str, str] = {"chatml": "<|im_start|>", "llama3": "<|start_header_id|>"}

# Tokens each family's template writes, which must each be one token of the tokenizer.
FAMILY_TOKENS: dict[str, tuple[str, ...]] = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "llama3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
}


def template_family(template: str | None) -> str | None:
    """The family of `template`: one of ours exactly, else the one whose end-of-turn it writes.

    None when no family's end-of-turn token appears, or more than one does (a user's own template;
    callers then fall back to the tokenizer's eos token, the HF convention).
    """
    if not template:
        return None
    for family, text in TRAINING_TEMPLATES.items():
        if template == text:
            return family
    found = [family for family, token in END_OF_TURN.items() if token in template]
    return found[0] if len(found) == 1 else None
