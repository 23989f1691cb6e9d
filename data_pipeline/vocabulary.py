"""Token strings every valen-jax tokenizer must hold as single tokens.

Seed 004 ("Physical primitives") writes coordinates as 1,001 number tokens `<0>`…`<1000>`
and counts `block_size` in tokens including the start and end tags, so each tag
below must be exactly one token for `block_size` and `atom_loss_masks` to line up.
"""

NUMBER_MAX = 1000
NUMBER_TOKENS: tuple[str, ...] = tuple(f"<{k}>" for k in range(NUMBER_MAX + 1))

# Start tags of trajectory atoms that all close with `</robot>` (seed 004, dual-arm paragraph).
ROBOT_START_TAGS: tuple[str, ...] = (
    "<robot_single_2d>",
    "<robot_single>",
    "<robot_left_2d>",
    "<robot_right_2d>",
    "<robot_left>",
    "<robot_right>",
)

PRIMITIVE_TAGS: tuple[str, ...] = (
    "<point>", "</point>",
    "<ref>", "</ref>",
    "<objects>", "</objects>",
    "<box>", "</box>",
    *ROBOT_START_TAGS, "</robot>",
    "<drive>", "</drive>",
    "<dense>", "</dense>",
    "<action>", "</action>",
    "<tool_call>", "</tool_call>",
)

# The media placeholder users write in VFlash `human` turns (seed 004) and the tokens
# the renderer puts in its place. One `<|image_pad|>` is one media slot in a shard; the
# loader expands it to the processor's number of vision tokens (DESIGN: assemble at load time).
IMAGE_PLACEHOLDER = "<image>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS: tuple[str, ...] = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# ChatML control tokens of the smoke tokenizer (Qwen family spelling).
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
CHATML_SPECIAL_TOKENS: tuple[str, ...] = (END_OF_TEXT, IM_START, IM_END)
