from easydict import EasyDict as edict

config = edict()
config.network = "r50"
config.margin = "adaface"  # the paper's hyper-parameters: configs/schema.py
config.embedding_size = 512
config.sample_rate = 1.0
config.fp16 = True
config.momentum = 0.9
config.weight_decay = 5e-4
config.batch_size = 128
config.lr = 0.1
config.rec = "/train_tmp/ms1m-retinaface-t1"
config.num_classes = 93431
config.num_image = 5179510
config.num_epoch = 20
config.warmup_epoch = 0
config.val_targets = ["lfw", "cfp_fp", "agedb_30"]
config.output = "work_dirs/ms1mv3_r50_adaface"
