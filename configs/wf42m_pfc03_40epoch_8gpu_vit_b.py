"""arcface_torch's job config of this name, with its keys and values (output None: work_dirs/<file name>)."""

from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.network = "vit_b_dp005_mask_005"
config.resume = False
config.output = None
config.embedding_size = 512
config.sample_rate = 0.3
config.fp16 = True
config.weight_decay = 0.1
config.batch_size = 256
config.gradient_acc = 12
config.optimizer = "adamw"
config.lr = 0.001
config.verbose = 2000
config.dali = False
config.rec = "/train_tmp/WebFace42M"
config.num_classes = 2059906
config.num_image = 42474557
config.num_epoch = 40
config.warmup_epoch = 4
config.val_targets = []
