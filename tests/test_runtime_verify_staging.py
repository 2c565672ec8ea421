"""A verify step's token ids on the graphed torch backend (``Backend.stages_draft_tokens``): the host ids and the
drafts still on the device (``runtime/device_drafts.py``) go straight into the step's staging image
(``DecodeInputs.fill(..., drafts=)``), one queued copy per run of drafts. Before, the engine sent the host ids to
the device, scattered the drafts there (``fill_tokens``), and ``fill`` copied the whole row back into the staging
image for the step's upload to send again: host -> device -> staging -> device.

On the CPU "the device" is the CPU, so what is checked is the route (which path the ids take, counted) and the
values (the staged inputs equal ``fill_tokens``' ids, greedy tokens equal plain decode's); the GPU test fills from
a CUDA round into the pinned image."""

import collections

import pytest
import torch

from m3export.model.batch import Segment, build_batch
from m3export.runtime import Engine, SamplingParams
from m3export.runtime import engine as engine_module
from m3export.runtime.backends import cuda_graph
from m3export.runtime.backends.cuda_graph import DecodeInputs, GraphedTorchBackend
from m3export.runtime.device_drafts import MAX_COPIED_RUNS, RoundDrafts, fill_tokens


@pytest.fixture(scope="module")
def trained():
    """The embedded trained model in float32: its drafts are accepted, so verify steps carry several drafts."""
    import m3export
    from m3export.embedded import default_model

    return m3export.load_model(default_model(), dtype=torch.float32, progress=False)


PROMPTS = [list(range(40 + 7 * i, 72 + 7 * i)) for i in range(2)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _counting(monkeypatch, module, counts, name):
    """``module.fill_tokens`` counted (under ``name``) when it has drafts to place."""
    original = module.fill_tokens

    def counted(ids, places):
        if places:
            counts[name] += 1
        return original(ids, places)

    monkeypatch.setattr(module, "fill_tokens", counted)


@pytest.mark.parametrize("batch", [1, 2])
def test_verify_ids_go_straight_into_the_staging_image(trained, monkeypatch, batch):
    """Every verify step of a greedy speculative run hands its host ids and draft places to the backend, which
    stages them itself: ``fill_tokens`` (ids to the device, drafts scattered there) never runs for the target step,
    in the engine or in the backend; the tokens equal plain decode's. A backend without the property (plain
    ``TorchBackend`` semantics) still gets ``fill_tokens``' ids: the same tokens."""
    plain = Engine(GraphedTorchBackend(trained, use_graphs=False), num_pages=64).generate(PROMPTS[:batch], GREEDY)
    counts: collections.Counter = collections.Counter()
    _counting(monkeypatch, engine_module, counts, "engine")
    _counting(monkeypatch, cuda_graph, counts, "backend")
    staged = []
    fill = DecodeInputs.fill

    def recorded(self, *args, drafts=(), **kw):
        staged.append(len(drafts))
        return fill(self, *args, drafts=drafts, **kw)

    monkeypatch.setattr(DecodeInputs, "fill", recorded)
    be = GraphedTorchBackend(trained, use_graphs=False, pad_eagerly=True)
    eng = Engine(be, num_pages=64, num_speculative_tokens=3, max_num_seqs=batch)
    outs = eng.generate(PROMPTS[:batch], GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert eng.stats.verify_steps > 0 and eng.stats.accepted_tokens > 0
    assert any(staged)  # verify steps of equal draft counts staged their drafts
    assert counts["engine"] == 0 and counts["backend"] == be.ragged_verify_steps, counts

    monkeypatch.setattr(GraphedTorchBackend, "stages_draft_tokens", property(lambda self: False))
    counts.clear()
    be = GraphedTorchBackend(trained, use_graphs=False, pad_eagerly=True)
    eng = Engine(be, num_pages=64, num_speculative_tokens=3, max_num_seqs=batch)
    assert [o.token_ids for o in eng.generate(PROMPTS[:batch], GREEDY)] == [o.token_ids for o in plain]
    assert counts["engine"] > 0  # the route before: the engine placed the drafts on the device


def _step(n_seqs: int, q: int, device: str):
    """A verify-shaped step of ``n_seqs`` sequences of q tokens (one kept token, q - 1 drafts), host ids with
    placeholders where the drafts go, and the places of a round whose drafts are distinct values on ``device``."""
    segs = [Segment([2 * i, 2 * i + 1], 9 + i, [100 + i] + [0] * (q - 1)) for i in range(n_seqs)]
    ids, batch = build_batch(segs, 16, torch.device("cpu"))
    rnd = RoundDrafts(n_seqs, q - 1, torch.device(device))
    rnd.tokens.copy_(torch.arange(n_seqs * (q - 1)).view(n_seqs, q - 1) + 200)
    places = [(i * q + 1 + j, rnd, rnd.flat(i, j)) for i in range(n_seqs) for j in range(q - 1)]
    return ids, batch, torch.arange(ids.shape[0]), places


@pytest.mark.parametrize("n_seqs", [1, MAX_COPIED_RUNS, MAX_COPIED_RUNS + 2],
                         ids=["one-run", "copied-runs", "scattered"])
def test_staged_drafts_equal_fill_tokens_ids(n_seqs):
    """The image filled with host ids + draft places (one copy per run; past ``MAX_COPIED_RUNS`` runs the
    ``fill_tokens`` route) holds what the ids of ``fill_tokens`` give, after a fill of other drafts (nothing of
    the earlier step is left); the caller's host ids keep their placeholders."""
    q, bucket = 4, 8
    staged = DecodeInputs(bucket, q, 6, 40, 16, "cpu")
    reference = DecodeInputs(bucket, q, 6, 40, 16, "cpu")
    for n in (n_seqs, max(1, n_seqs - 1)):
        ids, batch, rows, places = _step(n, q, "cpu")
        host = ids.clone()
        staged.fill(ids, batch, rows, drafts=places)
        reference.fill(fill_tokens(ids, places), batch, rows)
        staged.upload()
        reference.upload()
        assert torch.equal(ids, host)
        assert torch.equal(staged.input_ids, reference.input_ids)
        assert (staged.input_ids.view(bucket, q)[:n, 1:] >= 200).all()  # the drafts did land


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n_seqs", [1, MAX_COPIED_RUNS + 2], ids=["copied-runs", "scattered"])
def test_gpu_drafts_from_a_cuda_round_land_in_the_pinned_image(n_seqs):
    """On a GPU the drafts are queued copies from the round's device tensor into the pinned staging image, ahead
    of the upload on the same stream: filled and uploaded back to back (the next fill waits for the previous
    upload), the device inputs equal the CPU fill of the same steps."""
    q, bucket = 4, 8
    gpu, cpu = DecodeInputs(bucket, q, 6, 40, 16, "cuda"), DecodeInputs(bucket, q, 6, 40, 16, "cpu")
    for n in (n_seqs, 1, n_seqs):
        for inputs, dev in ((gpu, "cuda"), (cpu, "cpu")):
            ids, batch, rows, places = _step(n, q, dev)
            inputs.fill(ids, batch, rows, drafts=places)
            inputs.upload()
        torch.cuda.synchronize()
        assert torch.equal(gpu.input_ids.cpu(), cpu.input_ids)
