"""Images and video through the engine (torch backend) against the cache-free VL model recomputed every token:
chunked prefill across the media, batching, prefix caching keyed by the media's content, encode-once, and clear
refusals."""

from __future__ import annotations

import pytest
import torch

from m3export.config import preset
from m3export.errors import MediaError
from m3export.model import M3ForCausalLM
from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.torch_backend import TorchBackend
from m3export.runtime.media import MediaItem

from .vl_config import IMAGE, VIDEO, VISION

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def media_weights(m: M3ForCausalLM) -> M3ForCausalLM:
    """Random weights under which the media decide the greedy tokens (a strong tower and projector)."""
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0 if "layer_norm" in name and name.endswith("weight") else 0.0, 0.05 if "norm" in name
                      else 0.3 if name.startswith(("vision_tower", "multi_modal_projector")) else 0.05)
    return m


@pytest.fixture(scope="module")
def model():
    """float64 (as the other runtime tests): argmax comparisons must not hinge on fp32 rounding."""
    torch.manual_seed(0)
    return media_weights(M3ForCausalLM(preset("tiny").replace(num_mtp_modules=0, vision=VISION)).eval()).double()


def _item(kind, grid, seed):
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor(grid)
    return MediaItem(kind, torch.randn(int(grid.prod(-1).sum()), VISION.patch_dim, generator=g), grid)


def _reference(model, ids, items, n):
    """Greedy continuation, recomputing the whole sequence with its media at every token."""
    kw = {}
    for kind, pv, grid in (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos",
                                                                        "video_grid_thw")):
        mine = [it for it in items if it.kind == kind]
        if mine:
            kw[pv] = torch.cat([it.pixel_values for it in mine])
            kw[grid] = torch.cat([it.grid_thw for it in mine])
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]), **kw)[0, -1].argmax()))
    return ids[-n:]


def _prompt(*parts):
    g = torch.Generator().manual_seed(len(parts))
    out = []
    for p in parts:
        out += [p[0]] * p[1] if isinstance(p, tuple) else torch.randint(0, 256, (p,), generator=g).tolist()
    return out


IMG = _item("image", [[1, 4, 6]], 1)  # 6 tokens
IMG2 = _item("image", [[1, 4, 6]], 2)  # same size and placeholders, other pixels
VID = _item("video", [[2, 2, 4], [1, 2, 4]], 3)  # a 3-temporal-patch video in two chunks: 4 + 2 tokens


def test_chunked_prefill_with_image_and_video_equals_the_model(model):
    ids = _prompt(5, (IMAGE, 6), 3, (VIDEO, 6), 4)
    eng = Engine(TorchBackend(model), page_size=4, num_pages=64, max_num_batched_tokens=7)  # 24 tokens: 4 chunks
    out = None
    eng.add_request("a", ids, GREEDY, media=[IMG, VID])
    while eng.has_unfinished():
        for o in eng.step():
            out = o
    assert out.token_ids == _reference(model, ids, [IMG, VID], GREEDY.max_tokens)
    assert eng.stats.prefill_tokens >= len(ids)  # the prompt went through prefill in chunks


def test_prefix_cache_is_keyed_by_media_content(model):
    """Same placeholders, other pixels: only the text-only pages are shared, and each request equals its own
    reference; the same image again (a new object): encoded once, all its full pages reused."""
    ids = _prompt(9, (IMAGE, 6), 5)  # 20 tokens, pages of 4: [0, 8) text only, the image from position 9
    eng = Engine(TorchBackend(model), page_size=4, num_pages=64)
    calls = []
    encode = eng.backend.encode_media
    eng.backend.encode_media = lambda *a: calls.append(1) or encode(*a)

    def run(request_id, item):
        before = eng.stats.prefill_tokens
        eng.add_request(request_id, ids, GREEDY, media=[item])
        out = None
        while eng.has_unfinished():
            for o in eng.step():
                out = o
        return out.token_ids, eng.stats.prefill_tokens - before

    a, computed_a = run("a", IMG)
    b, computed_b = run("b", IMG2)
    assert a == _reference(model, ids, [IMG], GREEDY.max_tokens)
    assert b == _reference(model, ids, [IMG2], GREEDY.max_tokens)
    assert a != b  # the media matter for these weights
    assert computed_a == len(ids) and computed_b == len(ids) - 8  # b reused the two text-only pages, no more
    assert len(calls) == 2

    c, computed_c = run("c", _item("image", [[1, 4, 6]], 1))  # IMG's content
    assert c == a and computed_c == len(ids) - 16  # four full pages from the cache
    assert len(calls) == 2 and eng.media_cache.hits == 1  # not encoded again


@pytest.mark.parametrize("ids, items, message", [
    (_prompt(3, (IMAGE, 5), 2), [IMG], r"prompt has 5 placeholder token\(s\) \(id 300\) but the 1 image\(s\) encode to 6"),
    (_prompt(3, (IMAGE, 6), 2), [IMG, VID], r"the prompt has 0 placeholder token\(s\) \(id 301\)"),
    (_prompt(3, (IMAGE, 6), 2), [], None),
])
def test_placeholder_mismatch_is_one_clear_error(model, ids, items, message):
    eng = Engine(TorchBackend(model), page_size=4, num_pages=64)
    if message is None:  # placeholders without media are plain tokens, as in transformers
        eng.add_request("plain", ids, GREEDY)
        return
    with pytest.raises(MediaError, match=message):
        eng.add_request("x", ids, GREEDY, media=items)


def test_media_that_cannot_fit_the_context_is_refused(model):
    eng = Engine(TorchBackend(model), page_size=4, num_pages=64, max_model_len=16)
    with pytest.raises(MediaError, match=r"prompt has 18 tokens, 6 of them for 1 image/video item\(s\): more than "
                                         r"this engine's context allows \(15 prompt tokens"):
        eng.add_request("x", _prompt(7, (IMAGE, 6), 5), GREEDY, media=[IMG])


def test_text_only_model_refuses_media():
    from .runtime_fixtures import tiny_model

    eng = Engine(TorchBackend(tiny_model()), page_size=4, num_pages=64)
    with pytest.raises(MediaError, match="cannot take images or video .the model has no vision tower."):
        eng.add_request("x", _prompt(3, (IMAGE, 6)), GREEDY, media=[IMG])


def test_backends_without_an_embeddings_input_refuse_media(model):
    """A backend whose forward takes no ``media`` (the exported step graphs read input_ids only) refuses media
    requests at add_request, before anything is scheduled."""

    class IdsOnly(TorchBackend):
        name = "ids-only"

        def forward(self, input_ids, batch, logits_indices):
            return super().forward(input_ids, batch, logits_indices)

    assert TorchBackend(model).supports_media and not IdsOnly(model).supports_media
    eng = Engine(IdsOnly(model), page_size=4, num_pages=64)
    with pytest.raises(MediaError, match="the ids-only backend cannot take images or video$"):
        eng.add_request("x", _prompt(3, (IMAGE, 6)), GREEDY, media=[IMG])
    assert not eng.has_unfinished()


def test_the_cuda_graph_backend_runs_media_steps_eagerly(model):
    """The torch backend on CUDA is the graphed one by default: a step carrying media must reach the eager path
    (it raised TypeError on the media keyword); padded decode shapes run eagerly here, as graphs would replay them."""
    from m3export.runtime.backends.cuda_graph import GraphedTorchBackend

    ids = _prompt(5, (IMAGE, 6), 3)
    eng = Engine(GraphedTorchBackend(model, pad_eagerly=True), page_size=4, num_pages=64)
    assert eng.generate([ids], GREEDY, media=[[IMG]])[0].token_ids == _reference(model, ids, [IMG], GREEDY.max_tokens)


class _CountingTokenizer:
    """Text prompts for the tokenizer-less test model: ``"t3 i6"`` is 3 random text tokens then 6 image
    placeholders (``_prompt``); counts how often the engine tokenizes."""

    def __init__(self):
        self.encodes = 0

    def encode(self, text):
        self.encodes += 1
        return _prompt(*[int(w[1:]) if w[0] == "t" else (IMAGE, int(w[1:])) for w in text.split()])

    def decode(self, ids, skip_special_tokens=True):
        return ""


def test_a_text_prompt_with_media_is_tokenized_once(model):
    """A text prompt with images can be thousands of tokens: add_request encodes it once, also when it is refused
    for its length (the refusal still names the media)."""
    tok = _CountingTokenizer()
    eng = Engine(TorchBackend(model), tok, page_size=4, num_pages=64, max_model_len=16)
    eng.add_request("fits", "t3 i6 t2", GREEDY, media=[IMG])
    assert tok.encodes == 1
    with pytest.raises(MediaError, match=r"prompt has 18 tokens, 6 of them for 1 image/video item\(s\)"):
        eng.add_request("long", "t7 i6 t5", GREEDY, media=[IMG])
    assert tok.encodes == 2


@pytest.mark.parametrize("params, message", [
    (SamplingParams(max_tokens=2, stop=["x"]), "SamplingParams.stop needs a tokenizer"),
    (SamplingParams(max_tokens=2, logprobs=10**6), r"SamplingParams.logprobs=1000000 exceeds the vocabulary"),
])
def test_a_request_refused_for_its_parameters_never_runs_the_vision_tower(model, params, message):
    """Parameter checks come before media encoding: a refused request costs no vision forward and leaves nothing
    in the media cache."""
    eng = Engine(TorchBackend(model), page_size=4, num_pages=64)
    calls = []
    encode = eng.backend.encode_media
    eng.backend.encode_media = lambda *a: calls.append(1) or encode(*a)
    with pytest.raises(ValueError, match=message):
        eng.add_request("x", _prompt(3, (IMAGE, 6), 2), params, media=[IMG])
    assert calls == [] and eng.media_cache.misses == 0 and not eng.has_unfinished()
