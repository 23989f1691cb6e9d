"""VFlash's block drafter as one feature (seed 004), everything a newcomer looks for in one place:

    task        DrafterTask: the `vflash` training mode (the frozen target restored, checked by identity)
    objective   which blocks a step trains on, their position-decayed loss, the drafter's train step
    evaluation  a drafter workdir evaluated: target-only vs speculative decoding, lossless check, tau
    metrics     the block statistics as all-reducible sums (tau, per-position acceptance, histogram)
    regenerate  a VFlash dataset rewritten with the target's own answers (`python -m valen_jax.regenerate`)

Two pieces live in the layers below, because those layers use them: the drafter network
(`valen_jax.models.drafter`: the decoder's compiled block loop drafts with it, and models sit below
vflash in the import order) and the speculative decoder (`valen_jax.decoding`: the one compiled decode
loop, drafter on or off).
"""
