"""arcface_torch's job config of this name, with its keys and values (output None: work_dirs/<file name>)."""

from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.network = "mbf"
config.resume = False
config.output = None
config.embedding_size = 512
config.sample_rate = 0.1
config.fp16 = True
config.momentum = 0.9
config.weight_decay = 0.0005
config.batch_size = 512
config.lr = 0.1
config.rec = "synthetic"
config.num_classes = 300000
config.num_image = 100000
config.num_epoch = 30
config.warmup_epoch = -1
config.val_targets = []
