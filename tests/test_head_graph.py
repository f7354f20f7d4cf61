"""config `head_graph`: the head's forward and backward replayed from CUDA graphs
(heads.graph.CapturedHead, issue 56).

On a GPU (marked gpu): 20 training steps with the head replayed from its graphs equal the eager
steps (losses, the backbone's and the head's gradients, the weights), and train.py with
`head_graph true` stopped mid-run and resumed ends where the eager run ends. On the CPU the
same bodies run with the graphs emulated (a replay re-runs what was recorded), which proves the
bookkeeping around them: static buffers, the incoming gradient (fp16's loss scale, gradient
accumulation), Partial FC's sampled rows, the label-error count, the warm-up undone. And:
what a replay runs never waits on the device, and where no graph can be (a CPU, a fused head, a
teacher, a batch of another shape, a failed capture) the head runs eagerly, said in one line.
"""

import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from shardface.builders import build_head_step, head_graph_blocker
from shardface.configs import get_config
from shardface.errors import ConfigError
from shardface.heads import PartialFC, SampledRowsOptimizer
from shardface.heads.graph import CapturedHead
from shardface.losses import AdaFace, ArcFace
from tests.devices import CUDA, device_of, env_for
from tests.host_sync import HostSyncCounter
from tests.log_capture import shardface_messages
from tests.train_runs import checkpoint_tensors, train_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, CLASSES, BATCH, STEPS = 32, 50, 12, 20


def _parts(device, margin: str, sample_rate: float, seed: int = 0):
    """A small backbone (one linear layer) and a chunked head with their optimizers."""
    torch.manual_seed(seed)
    backbone = nn.Linear(24, D).to(device)
    margin_loss = AdaFace(s=16.0) if margin == "adaface" else ArcFace(s=16.0, margin=0.5)
    head = PartialFC(margin_loss, D, CLASSES, sample_rate, chunk_size=16, row_block=4).to(device)
    opts = [
        torch.optim.SGD(backbone.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4),
        SampledRowsOptimizer(head, torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=5e-4),
    ]
    return backbone, head, opts


def _train(device, captured: bool | str, margin="arcface", sample_rate=1.0, loss_scale=1.0, acc=1):
    """STEPS steps (each of `acc` micro-batches, the loss times `loss_scale`): per step the loss
    of each micro-batch, the backbone's and the head's gradients, and the weights at the end.
    `captured`: False (the head), True (CapturedHead) or "emulate"."""
    backbone, head, opts = _parts(device, margin, sample_rate)
    step = head if not captured else CapturedHead(head, emulate=captured == "emulate")
    gen = torch.Generator().manual_seed(1)
    record = {"loss": [], "grad_backbone": [], "grad_head": []}
    for _ in range(STEPS):
        for _ in range(acc):
            x = torch.randn(BATCH, 24, generator=gen).to(device)
            labels = torch.randint(0, CLASSES, (BATCH,), generator=gen).to(device)
            loss = step(backbone(x), labels)
            (loss * (loss_scale / acc)).backward()
            record["loss"].append(loss.detach().clone())
        record["grad_backbone"].append(backbone.weight.grad.clone())
        record["grad_head"].append(head.weight.grad.clone())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    record["weights"] = [backbone.weight.detach().clone(), head.weight.detach().clone()]
    record["buffers"] = [b.clone() for b in head.buffers()]
    return record, step


# each case: (margin, sample_rate, loss scale, micro-batches per step); sampling on the CPU only, where
# the emulated replays draw what the eager head draws (a graph's draws are its own)
CASES = [("arcface", 1.0, 1.0, 1), ("adaface", 1.0, 1024.0, 1), ("arcface", 1.0, 1.0, 2)]
CPU_ONLY = [("arcface", 0.5, 1.0, 1), ("adaface", 0.4, 512.0, 2)]


def _case_id(kind: str, case: tuple) -> str:
    return f"{kind}-{case[0]}-pfc{case[1]}-scale{case[2]:g}-acc{case[3]}"


@pytest.mark.parametrize(
    "kind,case",
    [pytest.param("cuda", c, marks=pytest.mark.gpu, id=_case_id("cuda", c)) for c in CASES]
    + [pytest.param("cpu", c, id=_case_id("cpu", c)) for c in CASES + CPU_ONLY],
)
def test_twenty_steps_replayed_from_the_graphs_equal_the_eager_steps(kind, case):
    """Losses, gradients (backbone and head, each step) and the final weights and margin
    statistics; on the CPU the graphs are emulated, exactly the same arithmetic."""
    margin, sample_rate, scale, acc = case
    device = device_of(kind)
    eager, _ = _train(device, False, margin, sample_rate, scale, acc)
    replayed, step = _train(device, True if kind == "cuda" else "emulate", margin, sample_rate, scale, acc)
    assert step.captured_key is not None and not step.failed
    tol = dict(rtol=1e-5, atol=1e-6) if kind == "cuda" else dict(rtol=0, atol=0)
    for name in eager:
        assert len(eager[name]) == len(replayed[name])
        for i, (a, b) in enumerate(zip(eager[name], replayed[name])):
            torch.testing.assert_close(b, a, **tol, msg=lambda m: f"{name}[{i}]: {m}")


def test_the_replayed_calls_never_wait_on_the_device():
    """What a replay runs (the recorded forward and backward, and the host's bookkeeping after
    each) makes no host synchronisation, with Partial FC sampling or without; the labels take the
    device path (counted, not raised)."""
    for sample_rate in (1.0, 0.5):
        backbone, head, opts = _parts(torch.device("cpu"), "adaface", sample_rate)
        head.raise_on_bad_labels = False
        step = CapturedHead(head, emulate=True)
        for i in range(6):
            x, labels = torch.randn(BATCH, 24), torch.randint(0, CLASSES, (BATCH,))
            with HostSyncCounter() as c:
                (step(backbone(x), labels) * 8.0).backward()
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
            if i >= step.eager_calls + 1:  # calls after the capture's
                assert c.calls == [], (sample_rate, i, c.calls)
        assert step.captured_key is not None


@pytest.mark.gpu
@pytest.mark.parametrize("sample_rate", [1.0, 0.5])
def test_replayed_steps_never_synchronise_the_host_on_a_gpu(sample_rate):
    """Real graphs, Partial FC's sampling captured too: whole steps (backbone, replayed head, both
    optimizers) under torch.cuda.set_sync_debug_mode("error"), losses finite."""
    device = device_of("cuda")
    backbone, head, opts = _parts(device, "adaface", sample_rate)
    step = CapturedHead(head)
    losses = []

    def one():
        x, labels = torch.randn(BATCH, 24, device=device), torch.randint(0, CLASSES, (BATCH,), device=device)
        loss = step(backbone(x), labels)
        (loss * 8.0).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach())

    for _ in range(4):  # two eager calls, the capture, a replay
        one()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            one()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert step._graphs is not None and not step.failed
    assert torch.isfinite(torch.stack(losses)).all()


def test_bad_labels_are_counted_and_sampled_rows_stepped_after_each_replay():
    """The two things a replay cannot do itself: the label-error count (read where the loop reads
    its loss) and the rows the head optimizer steps, fresh each replay."""
    backbone, head, opts = _parts(torch.device("cpu"), "arcface", 0.5)
    head.raise_on_bad_labels = False
    step = CapturedHead(head, emulate=True)
    rows = []
    for i in range(5):
        x, labels = torch.randn(BATCH, 24), torch.randint(0, CLASSES, (BATCH,))
        if i in (3, 4):
            labels[2] = CLASSES + 7
        step(backbone(x), labels).backward()
        rows.append(head.sampled.index().clone())
        opts[1].zero_grad()
    assert head.take_label_errors() == 2
    assert all(r.numel() == max(head.num_sample, BATCH) for r in rows)
    assert not torch.equal(rows[3], rows[4])  # each replay's own draw, not the captured one's


def test_a_batch_of_another_shape_runs_eagerly_with_one_line_per_shape():
    backbone, head, _ = _parts(torch.device("cpu"), "arcface", 1.0)
    step = CapturedHead(head, emulate=True)
    for _ in range(3):  # two eager calls, then the capture
        step(backbone(torch.randn(BATCH, 24)), torch.randint(0, CLASSES, (BATCH,))).backward()
    x, labels = torch.randn(BATCH - 5, 24), torch.randint(0, CLASSES, (BATCH - 5,))
    losses = []
    messages = shardface_messages(lambda: losses.extend(step(backbone(x), labels) for _ in range(2)))
    assert messages == [
        f"head_graph: a batch of {BATCH - 5}x{D} float32 embeddings, {BATCH - 5} labels differs from "
        f"the captured {BATCH}x{D} float32 embeddings, {BATCH} labels: the head runs eagerly for "
        "batches of that shape"
    ]
    for loss in losses:
        torch.testing.assert_close(loss, head(backbone(x), labels), rtol=0, atol=0)
        assert "Replayed" not in type(loss.grad_fn).__name__
    full = step(backbone(torch.randn(BATCH, 24)), torch.randint(0, CLASSES, (BATCH,)))
    assert "Replayed" in type(full.grad_fn).__name__  # the captured shape replays again


def test_a_capture_that_fails_leaves_the_head_eager_with_one_warning():
    """CUDA graphs of CPU tensors cannot be: the capture raises, is logged once, and that call
    and every later one run the head eagerly with its exact loss."""
    backbone, head, _ = _parts(torch.device("cpu"), "arcface", 1.0)
    step = CapturedHead(head)  # not emulated: a real capture, refused on the CPU
    batches = [(torch.randn(BATCH, 24), torch.randint(0, CLASSES, (BATCH,))) for _ in range(5)]
    losses = []
    messages = shardface_messages(lambda: losses.extend(step(backbone(x), y) for x, y in batches))
    assert messages == [
        "head_graph: capturing the head failed (RuntimeError: CUDA graphs need CUDA tensors; these "
        "are on the CPU): it runs eagerly from here"
    ]
    assert step.failed
    for (x, y), loss in zip(batches, losses):
        torch.testing.assert_close(loss, head(backbone(x), y), rtol=0, atol=0)


def _cfg(*overrides):
    return get_config("configs/demo.py", ["--head_graph", "true", *overrides])


def test_head_graph_is_off_by_default_and_validated():
    assert get_config("configs/demo.py").head_graph is False
    assert get_config("configs/ms1mv3_r50").head_graph is False
    with pytest.raises(ConfigError, match="head_graph"):
        get_config("configs/demo.py", ["--head_graph", "7"])


@pytest.mark.parametrize(
    "overrides,device,teacher,reason",
    [
        ((), "cpu", None, "CUDA graphs need a CUDA device; this run is on the CPU"),
        (
            ("--head_fused_optimizer", "true"),
            "cuda",
            None,
            "head_fused_optimizer steps the head inside backward, at a learning rate a graph would freeze",
        ),
        ((), "cuda", "a teacher", "distillation calls the head with a batch of its own"),
    ],
)
def test_where_no_graph_can_be_the_head_runs_eagerly_said_in_one_line(overrides, device, teacher, reason):
    cfg = get_config("configs/demo.py", ["--head_graph", "true", *overrides])
    head = PartialFC(ArcFace(), 8, 10)
    built = []
    messages = shardface_messages(
        lambda: built.append(build_head_step(cfg, head, torch.device(device), teacher))
    )
    assert messages == [f"head_graph true: the head runs eagerly ({reason})"]
    assert built == [head]


def test_head_graph_true_on_a_gpu_wraps_the_head_and_false_leaves_it_alone():
    """Building touches no device, so the CUDA case is decided on any machine."""
    head = PartialFC(ArcFace(), 8, 10)
    cuda = torch.device("cuda")
    assert head_graph_blocker(get_config("configs/demo.py"), cuda) is None
    built = []
    assert (
        shardface_messages(lambda: built.append(build_head_step(get_config("configs/demo.py"), head, cuda)))
        == []
    )
    assert built == [head]
    step = build_head_step(get_config("configs/demo.py", ["--head_graph", "true"]), head, cuda)
    assert isinstance(step, CapturedHead) and step.head is head and not step.emulate


# ----- train.py: 20 steps with the head captured, stopped and resumed, against the eager run -------


def _run(kind: str, out: str, data: str, steps: int, *extra: str) -> str:
    argv = train_argv(data, out, "--max_steps", str(steps), "--checkpoint_interval", str(steps // 2), *extra)
    done = subprocess.run(
        [sys.executable, "train.py", *argv],
        cwd=ROOT,
        env=env_for(kind),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _said(log: str) -> list[str]:
    return re.findall(r"head_graph(?: true)?: .*", log)


def test_train_py_with_head_graph_on_the_cpu_trains_with_the_eager_head_said_once(drawn_faces, tmp_path):
    log = _run("cpu", str(tmp_path / "run"), drawn_faces, 2, "--head_graph", "true")
    assert _said(log) == [
        "head_graph true: the head runs eagerly (CUDA graphs need a CUDA device; this run is on the CPU)"
    ]
    assert len(re.findall(r"loss ([0-9.]+) ", log)) == 2


# the cpu case (the same body, 6 steps) proves the harness only, in three processes: slow
@pytest.mark.parametrize("kind", [CUDA, pytest.param("cpu", marks=pytest.mark.slow)])
def test_a_head_graph_run_stopped_and_resumed_mid_run_ends_where_the_eager_run_ends(
    drawn_faces, tmp_path, kind
):
    """One process trains 20 steps eagerly; another with head_graph true stops after 10 (a
    checkpoint) and a third resumes it to 20 (capturing anew). Losses and the final backbone, EMA
    and head (rows and momentum) agree. On the CPU (6 steps, 3 + 3: the plumbing) the head runs
    eagerly, said once per process."""
    steps = 20 if kind == "cuda" else 6
    eager_out, graph_out = str(tmp_path / "eager"), str(tmp_path / "graph")
    eager_log = _run(kind, eager_out, drawn_faces, steps)
    logs = [
        _run(
            kind, graph_out, drawn_faces, steps, "--head_graph", "true", "--stop_after_steps", str(steps // 2)
        ),
        _run(kind, graph_out, drawn_faces, steps, "--head_graph", "true", "--resume", "true"),
    ]
    for log in logs:
        said = _said(log)
        expected = (
            "head_graph: the head's forward and backward captured in CUDA graphs"
            if kind == "cuda"
            else "head_graph true: the head runs eagerly (CUDA graphs need a CUDA device; this run is on the CPU)"
        )
        assert len(said) == 1 and said[0].startswith(expected), said
    eager_losses = [float(v) for v in re.findall(r"loss ([0-9.]+) ", eager_log)]
    graph_losses = [float(v) for log in logs for v in re.findall(r"loss ([0-9.]+) ", log)]
    assert len(eager_losses) == steps and graph_losses == pytest.approx(eager_losses, rel=1e-4, abs=1e-4)
    eager, graph = checkpoint_tensors(eager_out), checkpoint_tensors(graph_out)
    assert eager.keys() == graph.keys()
    tol = dict(rtol=1e-4, atol=1e-5) if kind == "cuda" else dict(rtol=0, atol=0)
    for name in eager:
        torch.testing.assert_close(graph[name], eager[name], **tol, msg=lambda m: f"{name}: {m}")
