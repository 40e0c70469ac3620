"""The Buffer's size hint covers what the native intranode backend checks at run time, for the worst routing."""
from types import SimpleNamespace

import pytest

from uccl_ep_train.buffer import Buffer
from uccl_ep_train.intranode import NativeIntranodeBackend


@pytest.mark.parametrize("combine_element_size", [2, 4], ids=["bf16-combine", "fp32-combine"])
@pytest.mark.parametrize("tokens,hidden,topk,ranks", [(4096, 7168, 8, 2), (1, 2048, 1, 8), (8192, 2048, 4, 3)])
def test_nvl_bytes_hint_admits_every_token_of_every_rank_on_one_rank(tokens, hidden, topk, ranks,
                                                                      combine_element_size):
    hint = Buffer.get_nvl_bytes_hint(tokens, hidden, topk, ranks, combine_element_size=combine_element_size)
    backend = SimpleNamespace(num_ranks=ranks)
    worst_rows = tokens * ranks
    dispatch_need = NativeIntranodeBackend.dispatch_bytes_needed(backend, worst_rows, 2 * hidden, hidden // 128, topk)
    # the combine area counts in bf16 units: a float32 row (expert-major partials too) is two units per channel
    combine_need = NativeIntranodeBackend.combine_bytes_needed(backend, tokens, hidden * combine_element_size // 2,
                                                               topk)
    assert hint >= dispatch_need and hint >= combine_need
    # and not wildly more: the hint is what users allocate on every GPU
    assert hint < 1.01 * max(dispatch_need, combine_need) + 4096


def test_nvl_bytes_hint_exceeds_deepeps_ring_hint_at_deepseek_v3_shape():
    """Why the Megatron dispatcher asks for this hint: DeepEP's ring-sized hint is too small for direct placement."""
    ring = Buffer.get_dispatch_config(2).get_nvl_buffer_size_hint(7168 * 2, 2)
    assert Buffer.get_nvl_bytes_hint(4096, 7168, 8, 2) > ring


def test_nvl_bytes_hint_admits_a_sync_free_row_count_beyond_tokens_times_ranks():
    """Sync-free expert-major dispatch pads to one row per token and selected local expert (4096 x 2 x 8 rows at
    DeepSeek-V3 shape on 2 ranks): the hint must hold them, or the dispatcher's first call fails (bench dispatcher's
    uccl-sync-free did, needing 946 MB of a 235 MB buffer)."""
    tokens, hidden, topk, ranks = 4096, 7168, 8, 2
    worst = tokens * ranks * topk
    hint = Buffer.get_nvl_bytes_hint(tokens, hidden, topk, ranks, num_worst_tokens=worst)
    backend = SimpleNamespace(num_ranks=ranks)
    assert hint >= NativeIntranodeBackend.dispatch_bytes_needed(backend, worst, 2 * hidden, hidden // 128, topk)
    assert Buffer.get_nvl_bytes_hint(tokens, hidden, topk, ranks, num_worst_tokens=1) == \
        Buffer.get_nvl_bytes_hint(tokens, hidden, topk, ranks)  # a smaller count never shrinks the hint
