"""Training chat templates with `{% generation %}` markers.

Why: HF's `return_assistant_tokens_mask` only marks text between `{% generation %}` and
`{% endgeneration %}`; templates shipped for inference lack them and give all-zero masks
(DESIGN, "Lessons"). The end-of-turn token sits inside the marked span so the model
learns to stop.
"""

CHATML = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{{- message['content'] + '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

TRAINING_TEMPLATES: dict[str, str] = {"chatml": CHATML}
