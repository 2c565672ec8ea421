"""What a speculative round on the graphed torch backend does on the device around its replays, counted (never
timed). On the H200 the embedded model's plain graphed step is host-bound (~0.57 ms), and a round of k drafts
(k MTP calls, one verify step, one read) cost ~3x that: every call re-filled its graph's static inputs field by
field (about 16 device operations), and the drafter sent an index to the device and gathered for what a slice
gives. Each test counts one of those per call, on the CPU with the padded shapes run eagerly (``pad_eagerly``:
the inputs a graph sees), and checks the greedy tokens still equal the plain engine's."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends import cuda_graph
from m3export.runtime.backends.cuda_graph import DecodeInputs, GraphedTorchBackend


@pytest.fixture(scope="module")
def trained():
    """The embedded trained model in float32: its drafts are accepted, so catch-ups cover several positions."""
    import m3export
    from m3export.embedded import default_model

    return m3export.load_model(default_model(), dtype=torch.float32, progress=False)


PROMPTS = [list(range(40 + 7 * i, 72 + 7 * i)) for i in range(3)]
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


class StaticWrites(TorchDispatchMode):
    """Counts in-place operations (``copy_``, ``zero_``, ``fill_``, index writes) whose target lives in one of the
    given storages."""

    def __init__(self, storages):
        super().__init__()
        self.storages, self.writes = storages, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        target = args[0] if args else None
        if (func._schema.name.endswith("_") or func.overloadpacket.__name__.endswith("_")) and \
                isinstance(target, torch.Tensor) and target.untyped_storage().data_ptr() in self.storages:
            self.writes += 1
        return func(*args, **(kwargs or {}))


def _integer_storages(inputs: DecodeInputs) -> set[int]:
    b = inputs.batch
    return {t.untyped_storage().data_ptr()
            for t in (inputs.input_ids, inputs.logits_indices, b.positions, b.seq_lens, b.block_tables, b.slot_mapping)}


@pytest.mark.parametrize("batch", [1, 3])
def test_a_fill_writes_the_static_inputs_in_one_copy(trained, monkeypatch, batch):
    """Every replayed call (verify steps and MTP calls) fills its graph's integer inputs with one copy, whatever
    the padding (it was a copy per field plus one per padded tail, ~16): the fill writes the host image only, and
    the step's upload (a graph's first node) is the copy; an MTP call's hidden states take at most two more (its
    rows, and zeros over rows a longer step left)."""
    per_fill = []
    fill = DecodeInputs.fill

    def counted(self, input_ids, batch_, logits_indices, hidden=None, **kw):
        with StaticWrites(_integer_storages(self)) as ints:
            with StaticWrites({self.hidden.untyped_storage().data_ptr()} if self.hidden is not None else set()) \
                    as hid:
                fill(self, input_ids, batch_, logits_indices, hidden, **kw)
            self.upload()  # what the step does first (again there: the same image, the same values)
        # ids holding drafts that stayed on the device are queued into the host image; on the CPU none is "on the
        # device", so every integer input arrives in the one copy of the host image.
        per_fill.append((ints.writes, hid.writes, self.hidden is not None))

    monkeypatch.setattr(DecodeInputs, "fill", counted)
    plain = Engine(GraphedTorchBackend(trained, use_graphs=False), num_pages=64).generate(PROMPTS[:batch], PARAMS)
    be = GraphedTorchBackend(trained, use_graphs=False, pad_eagerly=True)
    eng = Engine(be, num_pages=64, num_speculative_tokens=3, max_num_seqs=batch)
    outs = eng.generate(PROMPTS[:batch], PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert eng.stats.accepted_tokens > 0 and be.padded_mtp_steps > 0
    assert all(ints == 1 for ints, _, _ in per_fill), collections.Counter(i for i, _, _ in per_fill)
    assert all(hid <= 2 for _, hid, _ in per_fill)
    assert any(mtp for _, _, mtp in per_fill) and not all(mtp for _, _, mtp in per_fill)


def test_padding_rows_of_a_refilled_step_are_the_templates(trained):
    """A fill of fewer sequences after one of more leaves nothing of the longer step in the padding: the integer
    inputs equal a fresh buffer's filled with the shorter step, and the hidden rows past it are zeros again."""
    be = GraphedTorchBackend(trained, use_graphs=False, pad_eagerly=True)
    Engine(be, num_pages=64)
    from m3export.model.batch import Segment, build_batch

    def step(n):
        segs = [Segment([i], 3, [5 + i, 6 + i]) for i in range(n)]
        ids, b = build_batch(segs, 16, torch.device("cpu"))
        return ids, b, torch.arange(ids.shape[0]), torch.ones(ids.shape[0], 8)

    args = (4, 2, be._table_width, be._scratch_page, be._page_size, "cpu", (8, torch.float32))
    reused, fresh = DecodeInputs(*args), DecodeInputs(*args)
    for inputs, n in ((reused, 3), (reused, 1), (fresh, 1)):
        inputs.fill(*step(n))
        inputs.upload()  # the step's first operation
    for name in ("input_ids", "logits_indices"):
        assert torch.equal(getattr(reused, name), getattr(fresh, name)), name
    for name in ("positions", "seq_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(reused.batch, name), getattr(fresh.batch, name)), name
    assert torch.equal(reused.hidden, fresh.hidden)
    assert reused.hidden[2:].abs().sum() == 0 and reused.hidden[:2].abs().sum() > 0


def _count_host_copies(monkeypatch) -> collections.Counter:
    """Host-to-device copies the engine's path asks for (``sampling.to_device`` of a host tensor, wherever it is
    called from), counted by caller function."""
    import inspect

    from m3export.runtime import device_drafts, drafter, sampling

    counts: collections.Counter = collections.Counter()
    original = sampling.to_device

    def counted(t, device):
        if t.device.type == "cpu":
            counts[inspect.stack()[1].function] += 1
        return original(t, device)

    for module in (sampling, cuda_graph, device_drafts, drafter):
        monkeypatch.setattr(module, "to_device", counted)
    return counts


def test_mtp_calls_send_no_index_for_a_slice(trained, monkeypatch):
    """One request, k = 3 on a model of two MTP modules: a round's calls are module 0 over the kept positions,
    module 1 over them plus the first chain position, module 0 over the two chain positions since it ran. Only the
    verify step's ids (the last token beside the drafts), its decision's draft column and sampling parameters,
    and module 1's ids (kept tokens beside a draft) are host values sent to the device: module 0's chain ids are a
    view of the round's drafts, and every call's output rows a slice (before: an index copy and a gather each)."""
    counts = _count_host_copies(monkeypatch)
    plain = Engine(GraphedTorchBackend(trained, use_graphs=False), num_pages=64).generate(PROMPTS[:1], PARAMS)
    be = GraphedTorchBackend(trained, use_graphs=False, pad_eagerly=True)
    eng = Engine(be, num_pages=64, num_speculative_tokens=3)
    eng.add_request("r", PROMPTS[0], PARAMS)
    eng.step()  # the prompt
    per_step, out = [], None
    while eng.has_unfinished():
        counts.clear()
        for o in eng.step():
            out = o.token_ids
        per_step.append(counts.copy())
    assert out == plain[0].token_ids
    assert eng.stats.accepted_tokens > 0
    assert all(sum(c.values()) <= 4 for c in per_step), per_step
    assert all(c["fill_tokens"] <= 3 and c["_rows"] == 0 for c in per_step), per_step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fill_from_pinned_image_and_device_ids_equals_the_cpu_fill():
    """On a GPU the host image travels from a fixed pinned staging image, queued, and ids that are already on the
    device (drafts) are queued into that image first; filled and uploaded back to back (the next fill must wait
    for the previous upload before it rewrites the image), every static input equals the CPU fill of the same
    steps."""
    from m3export.model.batch import Segment, build_batch

    def step(n, dev):
        segs = [Segment([i, 9 + i], 13 + i, [5 + i, 6 + i, 7 + i]) for i in range(n)]
        ids, b = build_batch(segs, 16, torch.device("cpu"))
        return ids.to(dev), b, torch.arange(ids.shape[0]), torch.arange(ids.shape[0] * 8.0).view(-1, 8).to(dev)

    args = (4, 3, 6, 40, 16)
    gpu, cpu = DecodeInputs(*args, "cuda", (8, torch.float32)), DecodeInputs(*args, "cpu", (8, torch.float32))
    for n in (3, 1, 4, 2):
        for inputs, dev in ((gpu, "cuda"), (cpu, "cpu")):
            inputs.fill(*step(n, dev))
            inputs.upload()
    torch.cuda.synchronize()
    for name in ("input_ids", "logits_indices", "hidden"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
    for name in ("positions", "seq_lens", "block_tables", "slot_mapping", "query_start_loc"):
        assert torch.equal(getattr(gpu.batch, name).cpu(), getattr(cpu.batch, name)), name
