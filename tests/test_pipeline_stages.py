"""The streaming pipeline's stages used on their own, as a decode loop would use them: the read scheduler delivers a
layer's expert bytes in expert-ID order into pooled buffers, the device copier puts them on the compute device (a
no-op on a CPU; on CUDA without a host wait per copy), the expert runner computes an expert from them."""

from __future__ import annotations

import pytest
import torch

from containers import tiny_keep_container
from moepack.backends.device_copier import DeviceCopier
from moepack.format_spec.reader import Container
from moepack.runtime.engine import layer_prefill
from moepack.runtime.read_scheduler import ReadScheduler, expert_reads


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return tiny_keep_container(tmp_path_factory)


def scheduler(c: Container, **kw) -> ReadScheduler:
    options = dict(bundle_experts=2, queue_depth=2, io_mode="buffered", expert_selection="routed",
                   verify_reads=True, device=torch.device("cpu"))
    return ReadScheduler(c, layer_prefill(c, torch.float32).shape, **{**options, **kw})


def routed(experts: list[int]) -> dict:
    """Routing.tokens_by_expert() of a router that sent one token to each of `experts`."""
    from moepack.families.base import ExpertTokens

    return {e: ExpertTokens(torch.tensor([0]), torch.tensor([1.0])) for e in sorted(experts)}


def test_the_scheduler_delivers_the_experts_asked_for_in_expert_order(tiny):
    with Container(tiny) as c:
        reads = scheduler(c)
        try:
            reads.begin(n_tokens=1)
            layer = len(c.layers) - 1  # a learned (not hash) layer
            chosen = [5, 0, 1, 3] if len(c.layers[layer].experts) > 5 else [0, 1]
            got = reads.reads_after_router(layer, routed(chosen))
            block = c.layers[layer]
            assert [(first, count) for first, count, _ in got] == \
                [(f, n) for f, n, _ in expert_reads(block, sorted(chosen), 2)]
            for first, count, future in got:
                buffer, view = future.result()
                span = block.expert_read(first, count)
                with open(c.part_paths[span.part], "rb") as f:  # the file itself: a span covers several regions
                    f.seek(span.offset)
                    assert bytes(view) == f.read(span.length)
                reads.checker.before_use(block.experts[first:first + count], view, span.offset)
                reads.experts_pipe.release(buffer)
            stats = reads.layer_stats(layer, got, routed(chosen))
            assert stats.selection == "routed" and stats.experts_read == len(chosen)
        finally:
            reads.close()


def test_auto_selection_reads_whole_sections_of_long_prompts_ahead(tiny):
    """A prompt long enough that every expert is used queues whole expert sections of the first layers that are
    not hash-routed before any of them runs; a one-token prompt queues nothing ahead."""
    with Container(tiny) as c:
        shape = layer_prefill(c, torch.float32).shape
        for n_tokens, ahead in ((1, False), (100_000, True)):
            reads = scheduler(c, expert_selection="auto")
            try:
                reads.begin(n_tokens)
                learned = [i for i in range(shape.num_layers) if i not in shape.hash_layers]
                queued = set(reads._queued)
                assert bool(queued) == (ahead and learned[0] == 0), (n_tokens, queued)
                for layer_reads in reads._queued.values():  # give the buffers back
                    for _, _, future in layer_reads:
                        reads.experts_pipe.release(future.result()[0])
            finally:
                reads.close()


def test_the_copier_on_a_cpu_uses_the_bytes_where_they_are():
    from moepack.runtime.io import HostBuffer

    copier = DeviceCopier(torch.device("cpu"))
    buf = HostBuffer(4096, pinned=False)
    buf.tensor[:10] = torch.arange(10, dtype=torch.uint8)
    got = copier.to_device(buf, buf.view[:10])
    assert got.data_ptr() == buf.tensor.data_ptr() and got.tolist() == list(range(10))
    given_back = []
    copier.release(buf, given_back.append)
    assert given_back == [buf]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_copier_queues_copies_without_waiting_and_waits_only_to_give_a_buffer_back():
    """A large copy is still in flight when to_device returns (the host did not wait for it); the compute stream
    sees its bytes; the buffer goes back to the pool only once the copy is done."""
    from moepack.runtime.io import HostBuffer

    device = torch.device("cuda", torch.cuda.current_device())
    copier = DeviceCopier(device)
    buf = HostBuffer(256 << 20, pinned=True)
    buf.tensor.fill_(7)
    torch.cuda.synchronize(device)
    dev = copier.to_device(buf, buf.view)
    done = copier._copied[id(buf)]
    in_flight = not done.query()
    total = int(dev[:: 1 << 20].to(torch.int64).sum())  # on the compute stream, ordered after the copy
    given_back = []
    copier.release(buf, lambda b: given_back.append(done.query()))
    assert given_back == [True] and total == 7 * 256
    print(f"the copy was {'still' if in_flight else 'already no longer'} in flight when to_device returned")
