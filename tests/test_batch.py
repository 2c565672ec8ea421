"""The batch interface: one producer (``build_batch``), graph input names and dims derived from ``Batch``'s fields.

``TaggedBatch`` adds a dummy field the way a real one is added (docs/batch.md): everything derived from the
fields (graph input names, symbolic dims, ONNX Runtime feeds, unpacking inside a graph, device moves) follows
without another edit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from m3export.config import preset
from m3export.export.graphs import dynamic_shapes, mtp_signature, step_signature
from m3export.model import M3ForCausalLM
from m3export.model.batch import Batch, Segment, build_batch, dims


def test_build_batch_by_hand():
    # page size 4; A: pages [5, 2], positions 3..5 (crosses into its second page); B: one token on page 7
    ids, b = build_batch([Segment([5, 2], 3, [10, 11, 12]), Segment([7], 0, [20])], 4)
    assert ids.tolist() == [10, 11, 12, 20]
    assert b.positions.tolist() == [3, 4, 5, 0]
    assert b.slot_mapping.tolist() == [5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 7 * 4 + 0]
    assert b.query_start_loc.tolist() == [0, 3, 4] and b.seq_lens.tolist() == [6, 1]
    assert b.block_tables.tolist() == [[5, 2], [7, 0]]  # right-padded with page 0
    assert [t.dtype for t in b.inputs()] == [torch.int64, torch.int32, torch.int32, torch.int32, torch.int64]
    _, wide = build_batch([Segment([7], 0, [20])], 4, min_table_width=3)
    assert wide.block_tables.tolist() == [[7, 0, 0]]
    with pytest.raises(RuntimeError, match="block table of 1 pages cannot hold 5 tokens"):
        build_batch([Segment([1], 0, [1, 2, 3, 4, 5])], 4)


def test_graph_signatures_take_the_batch_fields_in_order():
    with torch.device("meta"):
        model = M3ForCausalLM(preset("tiny"))
    names = Batch.input_names()
    assert names == ("positions", "query_start_loc", "seq_lens", "block_tables", "slot_mapping")
    step, mtp = step_signature(model), mtp_signature()
    assert step.inputs[1:1 + len(names) + 1] == (*names, "logits_indices")
    assert mtp.inputs[2:2 + len(names) + 1] == (*names, "logits_indices")
    part = step_signature(model, range(0, 2))  # a split part without the head takes no logits_indices
    assert part.inputs[1:1 + len(names)] == names and "logits_indices" not in part.inputs
    shapes = dict(zip(step.inputs, dynamic_shapes(step.inputs)))
    assert str(shapes["query_start_loc"][0]) == str(shapes["seq_lens"][0] + 1)  # declared by name: B + 1
    assert set(shapes["block_tables"]) == {0, 1} and set(shapes["k_cache.0"]) == {0}


@dataclasses.dataclass
class TaggedBatch(Batch):
    token_types: torch.Tensor = dataclasses.field(default=None, metadata=dims("T"))


def test_a_new_field_flows_through_every_derived_interface():
    _, b = build_batch([Segment([0, 1], 2, [1, 2, 3])], 4)
    tagged = TaggedBatch(*b.inputs(), token_types=torch.tensor([0, 1, 1]))
    assert TaggedBatch.input_names() == (*Batch.input_names(), "token_types")
    assert TaggedBatch.input_dims()["token_types"] == ("T",)
    feeds = tagged.feeds(logits_indices=torch.tensor([2]))
    assert list(feeds) == [*TaggedBatch.input_names(), "logits_indices"]
    assert all(isinstance(v, np.ndarray) for v in feeds.values())
    assert feeds["token_types"].tolist() == [0, 1, 1]
    back, rest = TaggedBatch.from_inputs((*tagged.inputs(), "after"))
    assert torch.equal(back.token_types, tagged.token_types) and rest == ("after",)
    moved = tagged.to("meta")
    assert type(moved) is TaggedBatch and moved.token_types.device.type == "meta"
