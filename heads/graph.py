"""The head's training step replayed from CUDA graphs (config `head_graph`).

On a GPU the head's step is a few hundred small kernels, whose issue time on a slow host can
exceed their run time (`benchmarks/head_profile.py --graph` measures the captured step against
the eager one; figures in benchmarks/README.md). Captured once and replayed, the whole forward
is one launch and the whole backward another.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from shardface.heads.partial_fc import PartialFC, SampledRows

logger = logging.getLogger("shardface")


class CapturedHead:
    """`step(local_embeddings, local_labels) -> loss`: the head's training call, with its
    forward replayed from one CUDA graph and its backward from another.

    When it captures: the first `eager_calls` calls run the head eagerly (its one-time shape
    check, cuBLAS and the allocator warm up). The next call copies its inputs into static
    buffers, runs `warmup` passes on a side stream (their random draws and margin-statistics
    updates undone afterwards), then captures the forward (the loss) into graph F and the
    backward (`autograd.grad` of the loss, seeded with a static incoming gradient, into the
    embeddings and the head's parameters) into graph B, both in one memory pool. Capture is
    entered on every rank at the same call, so collectives inside (the all-gathers of the
    embeddings, the statistics' exchange, the reduce-scatter of their gradient) are captured in
    the same order everywhere.

    Each later call copies the embeddings and labels into the static buffers and replays F; its
    backward copies the incoming gradient (1, or the fp16 loss scale / gradient_acc) and
    replays B. The embedding gradient goes on to the backbone; the weight gradient becomes
    `weight.grad` as the graph's own buffer, without a copy (F reuses that buffer, so the next
    micro-step of gradient accumulation first moves the sum out of it). What a replay cannot do,
    the host redoes after it: Partial FC's sampled rows are handed to the head optimizer (a copy
    of the rows F drew, fresh at each replay), and the head's count of batches with a bad label
    is added to. Nothing here reads the device: no host synchronisation is added to the step.

    Static shapes: a call whose embeddings or labels differ in shape or dtype from the captured
    ones runs eagerly, with one log line per new shape (train.py's batches all have one shape:
    the sampler drops an epoch's last partial batch). Calls outside training (eval mode, no
    grad, embeddings that need no gradient) run eagerly, silently. A capture that raises is
    logged in one line and the head runs eagerly from then on.

    `emulate`: no CUDA graph; a "replay" runs the recorded forward or backward eagerly, on any
    device. The bookkeeping around the graphs (static buffers, gradients handed on, sampled rows,
    label errors, the warm-up undone) is then the same code, so the tests prove it on the CPU.
    """

    def __init__(self, head: PartialFC, eager_calls: int = 2, warmup: int = 2, emulate: bool = False):
        if head.plan.fused:  # builders.head_graph_blocker names this to the user
            raise ValueError(
                "CapturedHead: a fused head steps its optimizer inside backward, at a learning "
                "rate a graph would freeze"
            )
        self.head = head
        self.eager_calls = max(1, eager_calls)
        self.warmup = warmup
        self.emulate = emulate
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.calls = 0
        self.failed = False
        self.captured_key: tuple | None = None
        self._logged_keys: set = set()
        self._graphs: tuple | None = None  # (F, B) once captured; None in emulation
        self._loss = self._grad_emb = self._rows = self._bad = None
        self._grad_params: tuple = ()

    # ----- the calls --------------------------------------------------------------------------

    def __call__(self, local_embeddings: torch.Tensor, local_labels: torch.Tensor) -> torch.Tensor:
        head = self.head
        if self.failed or not (head.training and torch.is_grad_enabled() and local_embeddings.requires_grad):
            return head(local_embeddings, local_labels)
        key = _key(local_embeddings, local_labels)
        if self.captured_key is None:
            if self.calls < self.eager_calls:
                self.calls += 1
                return head(local_embeddings, local_labels)
            if not self._capture(local_embeddings, local_labels):
                return head(local_embeddings, local_labels)
        elif key != self.captured_key:
            if key not in self._logged_keys:
                self._logged_keys.add(key)
                logger.info(
                    "head_graph: a batch of %s differs from the captured %s: the head runs eagerly for "
                    "batches of that shape",
                    _describe(key),
                    _describe(self.captured_key),
                )
            return head(local_embeddings, local_labels)
        return _Replayed.apply(local_embeddings, local_labels, self)

    def replay_forward(self, local_embeddings: torch.Tensor, local_labels: torch.Tensor) -> torch.Tensor:
        """The forward of one call: inputs into the static buffers, F replayed, then what F cannot
        do itself. Returns the loss (a copy: the next replay overwrites the static one)."""
        for p, g in zip(self.params, self._grad_params):  # F rewrites B's weight-gradient buffer (it keeps
            if p.grad is not None and p.grad.data_ptr() == g.data_ptr():  # cosines there): a sum that a
                p.grad = g.clone()  # micro-step of gradient accumulation left in it moves out first
        with torch.no_grad():
            self.s_emb.copy_(local_embeddings)
            self.s_labels.copy_(local_labels)
        if self._graphs is None:
            self._forward()
        else:
            self._graphs[0].replay()
        if self._rows is not None:  # the optimizer steps these rows after backward: a copy
            self.head.sampled.add(self._rows.clone())
        if self._bad is not None:
            self.head.add_label_errors(self._bad.clone())
        return self._loss.detach().clone()

    def replay_backward(self, grad_loss: torch.Tensor) -> torch.Tensor:
        """The backward of one call: the incoming gradient into its static buffer, B replayed;
        returns the embeddings' gradient, leaves the parameters' in their `.grad`."""
        self.s_gout.copy_(grad_loss)
        if self._graphs is None:
            self._backward()
        else:
            self._graphs[1].replay()
        for p, g in zip(self.params, self._grad_params):
            if p.grad is None:
                p.grad = g  # B's buffer, valid until the next replay (optimizer.zero_grad drops it)
            else:
                p.grad.add_(g)
        return self._grad_emb.clone()

    # ----- capture ----------------------------------------------------------------------------

    def _forward(self) -> None:
        """What F records: the head's forward on the static inputs, its side effects kept aside."""
        head = self.head
        sampled, errors = head.sampled, head._label_errors
        head.sampled, head._label_errors = SampledRows(), None
        try:
            with torch.enable_grad():
                self._loss = head(self.s_emb, self.s_labels)
            self._rows, self._bad = head.sampled.index(), head._label_errors
        finally:
            head.sampled, head._label_errors = sampled, errors

    def _backward(self) -> None:
        """What B records: the loss's gradient, seeded with the static incoming gradient."""
        grads = torch.autograd.grad(self._loss, [self.s_emb, *self.params], self.s_gout)
        self._grad_emb, self._grad_params = grads[0], tuple(grads[1:])

    def _capture(self, local_embeddings: torch.Tensor, local_labels: torch.Tensor) -> bool:
        """Static buffers, warm-up, and the two graphs (in emulation, the buffers and the
        warm-up only). False (logged) when capture failed: the head then runs eagerly."""
        device = local_embeddings.device
        self.s_emb = local_embeddings.detach().clone().requires_grad_(True)
        self.s_labels = local_labels.detach().clone()
        self.s_gout = torch.ones((), dtype=torch.float32, device=device)
        self.captured_key = _key(local_embeddings, local_labels)
        try:
            if not self.emulate and device.type != "cuda":
                raise RuntimeError(f"CUDA graphs need CUDA tensors; these are on the {device.type.upper()}")
            self._warm_up(device)
            if not self.emulate:
                forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                # thread_local: the DataLoader's pin-memory thread may use CUDA meanwhile
                with torch.cuda.graph(forward, capture_error_mode="thread_local"):
                    self._forward()
                with torch.cuda.graph(backward, pool=forward.pool(), capture_error_mode="thread_local"):
                    self._backward()
                self._graphs = (forward, backward)
        except Exception as exc:  # noqa: BLE001  (any failure: the step still trains, eagerly)
            self.failed = True
            logger.warning(
                "head_graph: capturing the head failed (%s: %s): it runs eagerly from here",
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            return False
        logger.info(
            "head_graph: the head's forward and backward captured in CUDA graphs for batches of %s%s",
            _describe(self.captured_key),
            " (emulated: replays run eagerly)" if self.emulate else "",
        )
        return True

    def _warm_up(self, device: torch.device) -> None:
        """`warmup` forward and backward passes on a side stream (as capture requires), leaving
        the random state and the margin's running statistics as they were."""
        if self.warmup == 0:
            return
        buffers = [b.detach().clone() for b in self.head.buffers()]
        cuda = device.type == "cuda"
        side = torch.cuda.Stream(device) if cuda else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.random.fork_rng(devices=[device] if cuda else []):
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                for _ in range(self.warmup):
                    self._forward()
                    self._backward()
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)
        with torch.no_grad():
            for b, saved in zip(self.head.buffers(), buffers):
                b.copy_(saved)
        self._loss = self._grad_emb = None
        self._grad_params = ()


class _Replayed(torch.autograd.Function):
    """The autograd node of one replayed call: the backbone's graph continues through it."""

    @staticmethod
    def forward(ctx, local_embeddings, local_labels, captured: CapturedHead):
        ctx.captured = captured
        return captured.replay_forward(local_embeddings, local_labels)

    @staticmethod
    def backward(ctx, grad_loss):
        return ctx.captured.replay_backward(grad_loss), None, None


def _key(emb: torch.Tensor, labels: torch.Tensor) -> tuple:
    return tuple(emb.shape), emb.dtype, tuple(labels.shape), labels.dtype, emb.device


def _describe(key: tuple) -> str:
    emb_shape, emb_dtype, label_shape = key[:3]
    return (
        f"{'x'.join(map(str, emb_shape))} {str(emb_dtype).removeprefix('torch.')} embeddings, "
        f"{'x'.join(map(str, label_shape))} labels"
    )
