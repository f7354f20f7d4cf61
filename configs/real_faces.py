"""Models trained here on real people (benchmarks/real_faces.py): CelebA's in-the-wild
photos of 299 people, aligned and packed by this project's tools, 2 CPU ranks. Fixed before the
first run and not tuned on any result: the demo's recipe (configs/demo.py: CosFace s=32 m=0.35,
SGD, poly decay, EMA) for 10 epochs, whatever the network; the benchmark sets rec, num_classes,
network, seed and the distillation of each arm."""

from easydict import EasyDict as edict

from shardface.configs.demo import config as demo

config = edict()
config.update(demo)  # the demo's recipe; what differs:
config.network = "mbf"
config.embedding_size = 512
config.rec = "work_dirs/real_faces/rec_celeb"  # benchmarks/real_faces.py packs it there (research data: never committed)
config.num_classes = (
    298  # CelebA's 299 people less one with no face found (the benchmark passes the packed count)
)
config.num_image = 6000
config.num_epoch = 10
config.val_targets = []  # LFW is verified after training, from the photos, on its own pairs
config.verbose = 100000
config.channels_last = True  # the batch in NHWC: the same math, mbf ~1.3x faster on a CPU (set after the demo
# network's arms and mbf margin seed 1's first 117 steps had run without it)
config.checkpoint_interval = 50  # a stopped run loses at most 50 steps (minutes of mbf on a CPU)
config.output = "work_dirs/real_faces/runs/manual"  # the benchmark names each run's own
