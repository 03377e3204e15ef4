"""The host-side half of the CUDA-graph runner, on CPU: which graph a decode batch
lands in, and how a padded batch is laid out in the static input buffer.

(Replay itself needs a GPU: tests/kernels/test_cuda_graph_replay.py. That the
padded static-buffer forward equals the eager runner is checked on CPU through
the Triton interpreter in tests/kernels/test_cuda_graph_padding.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine.cuda_graph import (
    CudaGraphRunner,
    DecodeInputLayout,
    batch_ladder,
    bucket,
    width_ladder,
)
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import ScheduledRequest


@pytest.mark.parametrize("max_batch", [1, 3, 8, 24, 100, 128, 256, 512])
def test_every_batch_size_has_a_graph_that_at_most_doubles_it(max_batch):
    ladder = batch_ladder(max_batch)
    small = [s for s in (1, 2, 4, 8) if s < max_batch] + ([max_batch] if max_batch <= 8 else [])
    assert [s for s in ladder if s <= 8] == small
    assert ladder == sorted(set(ladder)) and ladder[-1] == max_batch
    for n in range(1, max_batch + 1):
        b = bucket(n, ladder)
        assert b is not None and n <= b < 2 * n, (n, b)
    assert bucket(max_batch + 1, ladder) is None


def test_ladder_rejects_a_non_positive_batch():
    with pytest.raises(ValueError):
        batch_ladder(0)
    with pytest.raises(ValueError):
        width_ladder(0, 16)


@pytest.mark.parametrize("max_blocks,min_blocks", [(8192, 16), (513, 16), (10, 16), (64, 1), (100, 20)])
def test_every_context_fills_more_than_half_of_its_width(max_blocks, min_blocks):
    widths = width_ladder(max_blocks, min_blocks)
    assert widths == sorted(set(widths)) and widths[-1] == max_blocks
    assert all(w & (w - 1) == 0 for w in widths[:-1])  # powers of two below the top
    for need in range(1, max_blocks + 1):
        w = bucket(need, widths)
        assert w is not None and need <= w
        assert w == widths[0] or 2 * need > w, (need, w)
    assert bucket(max_blocks + 1, widths) is None


def test_pack_pads_rows_to_the_batch_and_columns_to_the_width():
    layout = DecodeInputLayout(max_batch=8, max_width=6)
    out = np.full(layout.size, 99, dtype=np.int32)
    used = layout.pack(out, batch=4, width=4, tokens=[11, 12, 13], positions=[5, 0, 8], slots=[21, 32, 40],
                       block_rows=[[3, 5], [8], [6, 2, 10]], sample_rows=[0, 2])
    assert used == layout.used(4, 4) == 6 * 8 + 4 * 4
    assert (out[used:] == 99).all(), "pack wrote past what a (4, 4) step reads"
    v = layout.views(torch.from_numpy(out), 4, 4)
    assert v.input_ids.tolist() == [11, 12, 13, 0]
    assert v.positions.tolist() == [5, 0, 8, 0]
    # the padding row writes nothing (negative slot) and attends to one token of the null block
    assert v.slot_mapping.tolist() == [21, 32, 40, -1]
    assert v.context_lens.tolist() == [6, 1, 9, 1]
    assert v.sample_rows[:2].tolist() == [0, 2]
    assert v.lora_rows.tolist() == [-1, -1, -1, -1], "no adapters given: every row on the base model"
    assert v.block_table.tolist() == [[3, 5, 0, 0], [8, 0, 0, 0], [6, 2, 10, 0], [0, 0, 0, 0]]
    assert v.block_table.is_contiguous()


def test_pack_gives_each_row_its_adapter_slot_and_the_padding_none():
    layout = DecodeInputLayout(max_batch=8, max_width=4)
    out = np.zeros(layout.size, dtype=np.int32)
    layout.pack(out, 4, 2, [1, 2, 3], [0, 0, 0], [4, 8, 12], [[1], [2], [3]], [0, 1, 2], lora_rows=[2, -1, 0])
    assert layout.views(torch.from_numpy(out), 4, 2).lora_rows.tolist() == [2, -1, 0, -1]


def test_pack_refuses_what_does_not_fit():
    layout = DecodeInputLayout(max_batch=4, max_width=4)
    out = np.zeros(layout.size, dtype=np.int32)
    with pytest.raises(ValueError, match="more than width"):
        layout.pack(out, 2, 2, [1, 2], [0, 0], [0, 0], [[1, 2, 3], [4]], [0, 1])
    with pytest.raises(ValueError, match="cannot pack"):
        layout.pack(out, 2, 2, [1, 2, 3], [0, 0, 0], [0, 0, 0], [[1], [2], [3]], [])
    with pytest.raises(ValueError, match="cannot pack"):
        layout.pack(out, 8, 2, [1], [0], [0], [[1]], [])


class _Model:
    """plan() never touches the model; the runner only needs its cache's device and size."""


def _runner(max_batch=16, max_model_len=2048, block_size=16) -> CudaGraphRunner:
    kv = torch.zeros(64, 1, 2, block_size, 1, 8)
    return CudaGraphRunner(_Model(), kv, block_size, max_batch, max_model_len)


def _scheduled(num_computed: int, num_new: int = 1, block_size: int = 16) -> ScheduledRequest:
    req = Request("r", list(range(num_computed + num_new)), SamplingParams())
    req.num_computed_tokens = num_computed
    req.block_ids = list(range(1, -(-(num_computed + num_new) // block_size) + 1))
    return ScheduledRequest(req, num_new)


def test_plan_picks_the_next_batch_and_width_and_refuses_the_rest():
    runner = _runner()
    assert runner.batch_sizes == [1, 2, 4, 8, 16] and runner.widths == [16, 32, 64, 128]
    assert runner.plan([_scheduled(10)]) == (1, 16)
    # 3 decodes -> batch 4; the longest context (300 tokens, 19 blocks) -> width 32
    assert runner.plan([_scheduled(10), _scheduled(299), _scheduled(40)]) == (4, 32)
    # a one-token step that does not sample (a prompt's last-but-n token) is still a decode row
    assert runner.plan([_scheduled(5, 1), _scheduled(16, 1)]) == (2, 16)
    assert runner.plan([_scheduled(10), _scheduled(10, num_new=5)]) is None, "a prefill chunk runs eagerly"
    assert runner.plan([_scheduled(1)] * 17) is None, "above the largest captured batch runs eagerly"
    assert runner.plan([]) is None


def test_graphs_stop_at_the_capture_cap_and_capture_needs_cuda():
    runner = _runner(max_batch=4096)
    assert runner.batch_sizes[-1] == 512
    assert runner.plan([_scheduled(3)] * 513) is None
    with pytest.raises(ValueError, match="CUDA"):
        runner.capture()
