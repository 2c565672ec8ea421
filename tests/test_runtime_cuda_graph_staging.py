"""How a replayed decode step gets its inputs (``runtime/backends/cuda_graph.py``, ``DecodeInputs``): a host batch
is written into a fixed staging image without any torch operation, and the copy to the device is the step's own
first operation (on a GPU the graph's first node), so nothing is launched in front of the replay; the host waits
for the previous replay's copy before it rewrites the image. Counted on the CPU (the padded shapes run eagerly:
the inputs a graph sees); replay and the wait need CUDA (``gpu`` tests)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from m3export.runtime.backends.cuda_graph import GraphedTorchBackend
from tests.runtime_fixtures import model, tiny_model  # noqa: F401  (fixtures)
from tests.test_runtime_cuda_graph import PAGE, _batch as host_batch


def _batch(tables, starts, counts, device="cpu"):
    """``tests/test_runtime_cuda_graph.py``'s flattened batch, on ``device``."""
    b = host_batch(tables, starts, counts)
    return b if device == "cpu" else b.to(device)


class OpsBeforeTheStep(TorchDispatchMode):
    """The torch operations a ``forward`` dispatches before the padded step starts (``DecodeInputs.upload``, the
    step's first operation): what a replay has launched in front of it. Views (``.numpy()``'s detach) move no
    data and launch nothing: not counted."""

    def __init__(self, inputs_cls):
        super().__init__()
        self.ops, self.started = [], False
        upload = inputs_cls.upload

        def marked(inputs):
            self.started = True
            return upload(inputs)

        self._restore = (inputs_cls, upload)
        inputs_cls.upload = marked

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.started and not func.is_view:
            self.ops.append(func)
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        cls, upload = self._restore
        cls.upload = upload
        return super().__exit__(*exc)


def _prefilled(be, tables, lens, device="cpu"):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (sum(lens),), generator=g)
    ends = torch.tensor(lens).cumsum(0) - 1
    be.forward(ids.to(device), _batch(tables, [0] * len(lens), lens, device), ends.to(device))  # prefill: eager


def test_a_host_batch_reaches_the_step_with_no_torch_operation_in_front(model):
    """Before, ``fill`` copied a host image to the device itself (from a pinned block made per step on a GPU): one
    launch and its host work in front of every replay, the device idle meanwhile. Now the copy is the step's first
    operation; the outputs still equal the unpadded step's."""
    from m3export.runtime.backends.cuda_graph import DecodeInputs

    be = GraphedTorchBackend(model, use_graphs=False, pad_eagerly=True, buckets=(4,))
    be.allocate(num_pages=6, page_size=PAGE)
    tables = [[0, 1], [2]]
    _prefilled(be, tables, [5, 3])
    saved = [[c.clone() for c in layer] for layer in be._caches]
    ids, step, rows = torch.tensor([11, 12]), _batch(tables, [5, 3], [1, 1]), torch.tensor([0, 1])
    be.forward(ids, step, rows)  # the shape's static inputs exist from here on (made once, not per step)
    for layer, keep in zip(be._caches, saved):
        for c, k in zip(layer, keep):
            c.copy_(k)
    with OpsBeforeTheStep(DecodeInputs) as mode:
        logits, hidden = be.forward(ids, step, rows)
    assert mode.started and mode.ops == [], mode.ops
    for layer, keep in zip(be._caches, saved):
        for c, k in zip(layer, keep):
            c.copy_(k)
    be.pad_eagerly = False
    want_logits, want_hidden = be.forward(ids, step, rows)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-10)  # float64 model: same sums, any blocking
    torch.testing.assert_close(hidden, want_hidden, rtol=0, atol=1e-10)


def _graphed_backend():
    from m3export.plugins.kernels import kernels, register

    missing = {"m3::paged_attention", "m3::sparse_paged_attention", "m3::lightning_indexer", "m3::moe"} - set(kernels())
    if missing:
        pytest.skip(f"no Triton kernel yet for {sorted(missing)}: the reference ops cannot be captured")
    register()
    be = GraphedTorchBackend(tiny_model().float().cuda(), use_graphs=True, buckets=(4,))
    be.allocate(num_pages=8, page_size=PAGE)
    return be


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("where", ["host", "device"])
def test_gpu_back_to_back_replays_read_their_own_inputs(where):
    """Two decode steps replayed without a synchronisation between them, the first held back behind a long kernel
    (``torch.cuda._sleep``) so that its graph's upload has not run when the second step fills the staging image:
    the fill must wait for it (the event after the upload), or the first replay reads the second step's inputs.
    Each replay's logits and hidden states equal the same padded step run eagerly on the same kernels. Inputs from the host (the engine's), and from the device
    (``bench/decode.py``'s; block tables narrower than the captured width, so they are widened on the way)."""
    be = _graphed_backend()
    tables = [[0, 1, 2], [3, 4]]
    _prefilled(be, tables, [9, 6], "cuda")
    start = [[c.clone() for c in layer] for layer in be._caches]

    def restore():
        for layer, keep in zip(be._caches, start):
            for c, k in zip(layer, keep):
                c.copy_(k)

    steps = [(torch.tensor([11, 12]), _batch(tables, [9, 6], [1, 1])),
             (torch.tensor([13, 14]), _batch(tables, [10, 7], [1, 1]))]
    if where == "device":
        steps = [(ids.cuda(), b.to("cuda")) for ids, b in steps]
    rows = torch.tensor([0, 1], device="cpu" if where == "host" else "cuda")
    be.pad_eagerly = True
    want = [tuple(t.clone() for t in be.forward(ids, b, rows)) for ids, b in steps]
    restore()
    be.pad_eagerly = False
    be.forward(*steps[0], rows)  # captures the (4, 1) graph
    assert be.replays == 1
    restore()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time in front of the first replay
    got = [be.forward(ids, b, rows) for ids, b in steps]
    torch.cuda.synchronize()
    assert be.replays == 3
    for (gl, gh), (wl, wh) in zip(got, want):
        # fp32: the graph replays the eager kernels on the same inputs (a cuBLAS algorithm chosen differently
        # under capture moves sums by ~1e-6 relative); a replay that read the other step's token and position
        # differs by O(1).
        torch.testing.assert_close(gl, wl, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gh, wh, rtol=1e-4, atol=1e-4)
