"""The recipe both halves of benchmarks/parity.py train: arcface_torch's own code and
train.py read this one file, so no arm is tuned alone. arcface_torch's base recipe (ArcFace
m=0.5, SGD lr 0.1, momentum 0.9, weight decay 5e-4, polynomial decay without warmup, 512-d),
its `mbf`, batch 64 per rank at W=2 (global 128), 10 epochs; every other key at its default.
The benchmark sets rec, num_classes, num_image, seed and output."""

from easydict import EasyDict as edict

config = edict()
config.network = "mbf"
config.embedding_size = 512
config.margin_list = (1.0, 0.5, 0.0)
config.lr = 0.1
config.momentum = 0.9
config.weight_decay = 5e-4
config.warmup_epoch = 0
config.batch_size = 64
config.num_epoch = 10
config.rec = "work_dirs/parity/rec"  # research data: packed outside the repository, never committed
config.num_classes = 298
config.num_image = 6025
config.val_targets = []  # LFW and CFP are verified after training, from their photos
config.verbose = 100000
config.checkpoint_interval = 100000  # one checkpoint, at the end: nothing on disk inside the timing
config.output = "work_dirs/parity/runs/manual"
