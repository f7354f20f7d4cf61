"""The embedded demo (`make demo`): the drawn-faces set, the tiny CNN, 2 CPU ranks, minutes."""

from easydict import EasyDict as edict

config = edict()
config.network = "tiny"
config.embedding_size = 128
config.margin_list = (1.0, 0.0, 0.35)
config.scale = 32.0
config.chunk_size = 256
config.optimizer = "sgd"
config.lr = 0.1
config.momentum = 0.9
config.weight_decay = 5e-4
config.max_grad_norm = 5.0
config.batch_size = 64
config.rec = "data/drawn_faces"  # written by `python -m scripts.make_drawn_faces`
config.num_classes = 400
config.num_image = 8000
config.num_epoch = 8
config.warmup_epoch = 1
# ShardFace's own schedule, clip and margin gradient (arcface_torch's are the defaults)
config.lr_scheduler = "poly"
config.lr_power = 2.0
config.clip_head = True
config.straight_through = False
config.num_workers = 1
config.ema = True
config.ema_decay = 0.999
config.ema_tau = 100.0
config.val_targets = ["drawn_faces_val"]
config.verbose = 200
config.frequent = 10
config.checkpoint_interval = 200
config.output = "work_dirs/demo"
