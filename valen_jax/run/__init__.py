"""The run handle: one checkpoint step of a workdir, restored once, for every command and task.

    run = restore("runs/vflash-smoke")            # a ModelRun, or a DrafterRun holding its target's ModelRun
    model = restore_model("runs/vflash-smoke")    # a model to decode with (a drafter workdir is refused)

`ModelRun` (`handle.py`) is what evaluation, prediction, generation, export, regenerate and the drafter's
training task all read: config, model, tokenizer, row layout, mesh and params (verified against their
save-time digests), and the weights' identity from those digests (nothing gathered). `DrafterRun`
holds a vflash drafter and the `ModelRun` of the target it was trained against, refused unless that
target still holds the same weights (`check_target`). The mesh a restored model runs on is the
training run's, fitted to the devices here (`mesh.py`). `decoding_layout(run)` lays a scanned run's decoder
out per layer for the commands that decode (its stacked weights would be copied out at every step).

Layer: above the training and decoding layers (it reads checkpoints and builds models), below tasks,
vflash and evaluation, which take its handles as their input.
"""

from valen_jax.run.handle import (
    DrafterRun,
    ModelRun,
    check_target,
    decoding_layout,
    holds_drafter,
    restore,
    restore_drafter,
    restore_model,
    restore_start,
    target_record,
)
from valen_jax.run.mesh import evaluation_mesh, fitted_mesh_shape

__all__ = ["DrafterRun", "ModelRun", "check_target", "decoding_layout", "evaluation_mesh", "fitted_mesh_shape",
           "holds_drafter", "restore", "restore_drafter", "restore_model", "restore_start", "target_record"]
