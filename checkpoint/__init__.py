"""Training checkpoints in one format that any world size can load, and the run policy around them.

A checkpoint is a directory `checkpoint-<step>` under the run's output:

    meta.pt        step, epoch, data position, world size, loss-scaler state, config
    backbone.pt    the backbone's full state dict
    optimizer.pt   the backbone optimizer's state per parameter name (ZeRO-2 or DDP alike)
    ema.pt         the EMA's full state dict and its update count (when EMA is on)
    head-<a>-<b>.pt  weight rows and optimizer state of classes [a, b), one file per rank
                   (none for a label-free run: num_classes 0, no head)
    rng-rank<r>.pt RNG states of rank r (restored when resuming at the same world size)

Every rank writes its files into one staging folder (each file staged, flushed and renamed),
which is then published as every tool's folder output is (utils.atomic) and named in `latest`,
so an interrupted save never replaces the last good checkpoint. Loading uses
`torch.load(weights_only=True)` and reshards the head (by class index), the optimizer state
and the EMA to the current ranks.
The output directory must be shared by all ranks (one machine, or a shared file system).

The package, module by module:
    files.py          atomic writes, weights-only reads, CheckpointError
    state.py          TrainState (the run's position), RNG states, what model.pt leaves out
    save.py, load.py  a checkpoint written by every rank; read back at any world size; backbone
                      weights read from a checkpoint or a weights file (model.pt, arcface_torch's)
    folders.py        the checkpoints of an output: listed, complete or not, found, pruned
    checkpointer.py   the run's policy: where it starts (resume, overwrite), when it saves
    changes.py        what a resume changes against its checkpoint, key by key
    data_position.py  a saved data position on changed data
    run_lock.py       one live run per output directory
    foreign.py        arcface_torch run folders, refused by name
    dlib_format.py    dlib's face descriptor file (.dat), read into backbones.dlib_resnet's state dict
"""
