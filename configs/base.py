"""Every default of a ShardFace run. Job configs override these; `--key value` overrides both.

Key names follow insightface arcface_torch where the meaning is the same. The table is aligned by
hand (the formatter leaves it): `train.py --help` (configs/describe.py) reads each key's comment
and the comment lines below it.
"""

from easydict import EasyDict as edict

# fmt: off
config = edict()

# model
config.network = "r50"                # backbones.get_model name
config.embedding_size = 512
config.dropout = 0.0
config.grad_checkpoint = False        # recompute backbone activations in backward
config.fp16 = False                   # fp16 autocast + dynamic loss scaling
config.bf16 = False                   # bf16 autocast, no loss scaling
config.channels_last = True          # the batch in channels-last (NHWC) memory: the same math; fp16 on an
                                      # H100, r50 trains 1.51x faster, r100 1.38x; on a CPU, mbf 1.3x
                                      # (benchmarks/README); false: arcface_torch's NCHW
config.init_backbone = ""             # new run from these backbone weights, fresh head (fine-tuning):
                                      # a model.pt, arcface_torch checkpoint_gpu_<r>.pt, checkpoint or run
                                      # dir (its EMA weights if any); ignored (logged) when resuming

# margin head (heads.PartialFC); losses.build_margin reads these
config.margin = "combined"            # combined | arcface | cosface | adaface | magface |
                                      # curricularface | subcenter_arcface
config.margin_list = (1.0, 0.5, 0.0)  # combined: (m1, m2, m3): s*(cos(m1*theta+m2)-m3)
config.scale = 64.0                   # s, every margin
config.straight_through = True        # combined/arcface: margin's derivative taken as 1, arcface_torch's
                                      # gradient; False: the true derivative of the loss
config.arcface_m = 0.5                # arcface, subcenter_arcface: additive angular margin
config.cosface_m = 0.4                # cosface: additive cosine margin
config.adaface_m = 0.4                # adaface (Kim et al. 2022): margin
config.adaface_h = 0.333              #   h: how far the norm moves the margin
config.adaface_t_alpha = 0.01         #   EMA rate of the batch norm mean/std
config.magface_l_a = 10.0             # magface (Meng et al. 2021): norm range [l_a, u_a]
config.magface_u_a = 110.0
config.magface_l_m = 0.45             #   margin range [l_m, u_m], linear in the norm
config.magface_u_m = 0.8
config.magface_lambda_g = 20.0        #   weight of the norm regulariser
config.magface_easy_margin = True     #   the authors' default
config.curricularface_m = 0.5         # curricularface (Huang et al. 2020): angular margin
config.subcenter_k = 3                # subcenter_arcface (Deng et al. 2020): centres per class
config.interclass_filtering_threshold = 0.0
config.sample_rate = 1.0              # Partial FC: fraction of each shard's classes per step
config.chunk_size = 32768             # classes per GEMM tile of the head; 0 = whole shard at once
config.row_block = 512                # rows per block beyond the first embedding_size rows (kept
                                      # free in the weight gradient): row_block x shard floats. On a
                                      # GPU each block x tile costs ~25 launches: 8192/128 was
                                      # launch-bound, 3x slower on an H100 (benchmarks/runs/gpu.md)
config.head_precision = "fp32"        # logits GEMM: fp32 | tf32 (GPU) | bf16; statistics stay fp32
config.head_fused_optimizer = False   # step the head's rows inside backward: no weight gradient held
                                      # (needs gradient_acc 1, no fp16, clip_head False)
config.head_graph = False             # the head's forward and backward replayed from CUDA graphs (fewer
                                      # launches; static batch shape): eagerly, with one log line, on a CPU,
                                      # with head_fused_optimizer or a teacher. False until proven on a GPU
config.clip_head = False              # False: the backbone alone is clipped (arcface_torch); True: the
                                      # head joins the global norm

# distillation (docs/distillation.md)
config.teacher = ""                   # MODEL run beside the student (run dir, checkpoint, model.pt, .onnx,
                                      # dlib) or a teacher file of scripts.teach; "" = no distillation
config.teacher_network = None         # backbone name of an arcface_torch model.pt teacher
config.distill_loss = "cosine"        # cosine: each embedding to the teacher's (a learned projection when
                                      # the sizes differ) | relational: the batch's cosine-similarity matrices
config.distill_weight = 1.0           # the distillation loss's weight beside the margin loss
config.distill_center = True          # subtract the teacher's mean embedding over the training data from
                                      # its targets (re-normalised): targets sharing one direction (most
                                      # teachers; dlib's mean cosine to it is 0.91) reward a constant student
config.distill_center_samples = 4096  # records an on-the-fly teacher's mean is measured on (a teacher file:
                                      # all its rows); checkpointed, so a resume keeps it

# optimisation
config.optimizer = "sgd"              # sgd | adamw
config.lr = 0.1                       # for the global batch below; not rescaled automatically
config.momentum = 0.9
config.weight_decay = 5e-4
config.max_grad_norm = 5.0            # global gradient-norm clip (see clip_head); 0 disables
config.lr_scheduler = "poly_warmup"   # poly_warmup (arcface_torch's PolynomialLRWarmup: steps counted
                                      # as images // global batch, first step at full lr) | poly | cosine
config.lr_power = 1.0                 # exponent of the polynomial decay
config.warmup_epoch = 0
config.gradient_acc = 1               # micro-batches per optimizer step
config.zero = True                    # ZeRO-2 for the backbone; False = DDP
config.ema = False                    # sharded EMA of the backbone
config.ema_decay = 0.9999
config.ema_tau = 2000.0

# data
config.rec = "synthetic"              # dir with train.rec/train.idx, an image folder, or "synthetic"
                                      # (arcface_torch's throughput test: one fixed random image)
config.num_classes = 93431              # 0 with a teacher: label-free, the distillation loss alone (no head)
config.num_image = 5179510             # arcface_torch's warmup and total steps come from it; ShardFace
                                      # counts the data set's images instead (a differing value is named)
config.num_epoch = 20
config.batch_size = 128               # per rank
config.num_workers = 2
config.skip_bad_images = False        # count and skip undecodable images instead of failing
config.resize = False                 # resize images that are not 112x112 (bilinear) instead of refusing
                                      # them; models expect aligned crops, and resizing is not alignment
config.align = False                  # rec is a folder of raw photos: find each photo's largest face at
                                      # start and train on it aligned to 112x112 (docs/photos.md)
config.align_detector = "hog"         # with align: dlib's "hog" or "mmod" face detector
config.align_strict = False           # with align: refuse photos without a face instead of leaving them out
config.seed = 2048

# evaluation and logging
config.val_targets = []               # names of <name>.bin files inside config.val_dir
config.val_dir = ""                   # default: the directory of config.rec
config.verbose = 2000                 # evaluate every N steps
config.frequent = 10                  # log every N steps
config.output = "work_dirs/default"
config.checkpoint_interval = 2000     # steps between checkpoints (and one at the end)
config.keep_checkpoints = 2           # newest checkpoints of this run kept; 0 keeps every one
config.resume = False                 # True: continue from output/latest; "auto": continue if the
                                      # output holds a checkpoint, else start (elastic restarts, requeues)
config.overwrite = False              # start over in an output holding checkpoints (deletes them);
                                      # without it, or resume, such an output is refused
config.reset_ema = False              # resume without the checkpoint's ema.pt: restart the EMA from
                                      # the loaded weights (otherwise a missing ema.pt is an error)
config.reset_margin = False           # resume with another margin type whose running statistics
                                      # cannot carry over: they start afresh (otherwise refused)
config.dist_timeout_min = 10          # a dead rank makes the others fail after this long
config.max_steps = 0                  # shorten the schedule to N steps (0 = num_epoch epochs)
config.stop_after_steps = 0           # save and exit after N steps of this job, schedule unchanged
                                      # (time-limited cluster jobs; resume continues exactly)

# arcface_torch keys, accepted with their meaning there (its job configs load unchanged)
config.dali = False                   # NVIDIA DALI loader there; here ShardFace's own loader runs (warned)
config.dali_aug = False               # DALI's augmentation there; ShardFace's loader mirrors images (warned)
config.save_all_states = True         # ShardFace always saves every state (optimizers, head, RNG)
config.using_wandb = False            # log to Weights & Biases (pip install wandb)
config.wandb_key = ""                 # API key for wandb.login; empty: the key wandb already knows
config.wandb_entity = None            # wandb team or user; None: wandb's default
config.wandb_project = "shardface"
config.wandb_log_all = False          # every rank logs its own run; False: rank 0 only
config.wandb_resume = False           # resume the wandb run (as wandb.init's resume)
config.suffix_run_name = None         # appended to the run name <yymmdd_HHMM>_GPU<rank>
config.save_artifacts = False         # log model.pt as a wandb artifact at the end
# fmt: on
