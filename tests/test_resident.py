"""The weights held once per process (runtime/resident.py): `--io host` and `--device-resident` give the streamed
prefill's logits bit for bit, read nothing from the disk after the first load, check every region as they load,
and refuse in one line where the memory is not there. On a CPU both places are host memory."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from click.testing import CliRunner

from moepack.cli.main import cli
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container
from moepack.packer.convert import convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from moepack.runtime import resident
from moepack.runtime.engine import PrefillOptions, prefill

IDS = list(range(3, 60))


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    base = tmp_path_factory.mktemp("resident")
    synth_checkpoint(str(base / "src"), preset="tiny", progress=False)
    path = str(base / "model.moepack")
    convert_checkpoint(str(base / "src"), path, policy="fp4", progress=False)
    return path


@pytest.fixture(autouse=True)
def nothing_held():
    resident.release_resident()
    yield
    resident.release_resident()


@pytest.mark.parametrize("where", [dict(io_mode="host"), dict(device_resident=True)])
def test_resident_prefills_equal_the_streamed_one_and_load_once(container, where):
    streamed = prefill(container, IDS, PrefillOptions(io_mode="direct"))
    first = prefill(container, IDS, PrefillOptions(**where))
    again = prefill(container, IDS[:20], PrefillOptions(**where))
    assert torch.equal(first.logits, streamed.logits) and first.next_token == streamed.next_token
    assert first.stats["bytes_read"] == 0 and again.stats["bytes_read"] == 0
    assert first.stats["resident_load_s"] > 0 and again.stats["resident_load_s"] == 0  # held for the process
    assert first.stats["io_mode"].startswith("resident in")
    assert torch.equal(again.logits, prefill(container, IDS[:20], PrefillOptions(io_mode="direct")).logits)


def test_a_changed_file_is_loaded_again(container, tmp_path):
    copy = tmp_path / "copy.moepack"
    copy.write_bytes(open(container, "rb").read())
    prefill(str(copy), IDS, PrefillOptions(io_mode="host"))
    os.utime(copy, ns=(1, 1))
    assert prefill(str(copy), IDS, PrefillOptions(io_mode="host")).stats["resident_load_s"] > 0


def test_a_damaged_region_is_refused_as_it_loads(container, tmp_path):
    damaged = tmp_path / "damaged.moepack"
    data = bytearray(open(container, "rb").read())
    with Container(container) as c:
        region = c.layers[1].experts[1]
    data[region.offset + 3] ^= 0x40
    damaged.write_bytes(data)
    with pytest.raises(MoepackError, match="checksum mismatch while loading"):
        prefill(str(damaged), IDS, PrefillOptions(io_mode="host"))
    # unchecked where the user turned checks off, as streamed reads are; bytes held unchecked serve no checked run
    prefill(str(damaged), IDS, PrefillOptions(io_mode="host", verify_reads=False))
    with pytest.raises(MoepackError, match="checksum mismatch while loading"):
        prefill(str(damaged), IDS, PrefillOptions(io_mode="host"))


def test_no_room_is_one_line(container, monkeypatch):
    monkeypatch.setattr(resident, "available_memory_bytes", lambda: 1 << 20)
    with pytest.raises(MoepackError, match=r"--io host: .* but only 0\.0 GiB of available host memory .* "
                                           r"use --io direct"):
        prefill(container, IDS, PrefillOptions(io_mode="host"))
    with pytest.raises(MoepackError, match="--device-resident: "):
        prefill(container, IDS, PrefillOptions(device_resident=True))


@pytest.mark.parametrize("flags", [["--io", "host"], ["--device-resident"]])
def test_cli_prefill_holds_the_weights(container, tmp_path, flags):
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(map(str, IDS)))
    r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids), *flags, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["bytes_read"] == 0 and out["io_mode"].startswith("resident in")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("where", [dict(io_mode="host"), dict(device_resident=True)])
def test_cuda_resident_prefill_equals_the_streamed_one(container, where):
    options = dict(device="cuda", compute_dtype="bfloat16")
    streamed = prefill(container, IDS, PrefillOptions(io_mode="direct", **options))
    held = prefill(container, IDS, PrefillOptions(**where, **options))
    assert torch.equal(held.logits, streamed.logits)
    assert held.stats["bytes_read"] == 0


def test_a_server_holds_the_weights_where_they_fit(container, monkeypatch):
    """`serve` on a GPU: on the device where the files take at most half its free memory, else pinned in host RAM
    where they fit there, else streamed; a CPU's page cache serves it; what the user asked for stands."""
    from moepack.runtime import engine

    size = os.path.getsize(container)
    device = torch.device("cuda", 0)
    monkeypatch.setattr(engine, "compute_device", lambda name: device)
    free = {"device": 4 * size, "host": 4 * size}
    monkeypatch.setattr(resident, "free_bytes", lambda place, dev: free[place])
    auto = PrefillOptions(device="cuda")
    assert engine.held_for_serving(container, auto).device_resident
    free["device"] = size
    held = engine.held_for_serving(container, auto)
    assert not held.device_resident and held.io_mode == "host"
    free["host"] = size
    assert engine.held_for_serving(container, auto) == auto  # neither fits: streamed
    free["device"] = 4 * size
    assert engine.held_for_serving(container, PrefillOptions(device="cuda", io_mode="direct")).io_mode == "direct"
    monkeypatch.setattr(engine, "compute_device", lambda name: torch.device("cpu"))
    assert engine.held_for_serving(container, PrefillOptions()) == PrefillOptions()


def test_a_release_waits_for_the_prefill_using_the_bytes_and_a_later_pass_loads_them_again(container):
    """release_resident during a prefill (a server's request, or another thread's): it returns only once the
    pass is over, which finishes with the streamed logits; the engine's next pass holds the bytes again, having
    let go of the released copy before loading the new one (the two need not fit at once)."""
    import gc
    import weakref

    from moepack.runtime import engine as engine_module
    from moepack.runtime.engine import StreamingPrefill

    streamed = prefill(container, IDS, PrefillOptions(io_mode="direct"))
    releasing: list[threading.Thread] = []
    blocked_while_running = []

    def should_stop():  # asked before each layer
        if not releasing:
            releasing.append(threading.Thread(target=resident.release_resident))
            releasing[0].start()
        else:
            releasing[0].join(0.05)
            blocked_while_running.append(releasing[0].is_alive())
        return False

    with Container(container) as c:
        engine = StreamingPrefill(c, PrefillOptions(io_mode="host"))
        first = engine.resident
        try:
            during = engine.run(torch.tensor(IDS), should_stop=should_stop)
            releasing[0].join(10)
            assert blocked_while_running and all(blocked_while_running) and not releasing[0].is_alive()
            assert first.released and first.unpinned.is_set()
            assert torch.equal(during.logits, streamed.logits)
            old, first, alive_at_load = weakref.ref(first), None, []

            def load(*args):
                gc.collect()
                alive_at_load.append(old() is not None)
                return resident.resident_bytes(*args)

            engine_module.resident_bytes, real = load, engine_module.resident_bytes
            try:
                again = engine.run(torch.tensor(IDS))
            finally:
                engine_module.resident_bytes = real
            assert alive_at_load == [False]
            assert again.stats["resident_load_s"] > 0
            assert torch.equal(again.logits, streamed.logits) and again.stats["bytes_read"] == 0
        finally:
            engine.close()


class FakeCudart:
    """torch.cuda.cudart()'s page registration, recorded."""

    def __init__(self, log: list):
        self.log, self.registered = log, set()

    def cudaHostRegister(self, pointer, size, flags):
        self.registered.add(pointer)
        return 0

    def cudaHostUnregister(self, pointer):
        self.log.append("unregistered")
        self.registered.discard(pointer)
        return 0


class FakeCopyEvent:
    """A CUDA event of a copy still in flight until synchronized."""

    def __init__(self, log: list):
        self.log, self.done = log, False

    def query(self):
        return self.done

    def synchronize(self):
        self.log.append("copy done")
        self.done = True


def test_pinned_bytes_are_unregistered_only_after_the_passes_and_their_copies(container, monkeypatch):
    """`--io host` on a GPU: the pages stay registered while a pass uses them and until each copy out of them is
    done (an asynchronous copy out of unregistered pages is undefined); a release from another thread waits."""
    log: list = []
    cudart = FakeCudart(log)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    with Container(container) as c:
        held = resident.ResidentBytes(c, "host", torch.device("cuda", 0))
    assert cudart.registered and held.acquire()  # a pass on this thread
    held.slice(0, 0, 64).copy_queued(FakeCopyEvent(log))  # the device copier's copy, still in flight
    releaser = threading.Thread(target=held.release)
    releaser.start()
    releaser.join(0.2)
    assert releaser.is_alive() and log == [] and cudart.registered  # waits for the pass
    assert not held.acquire()  # no new pass takes released bytes
    held.done_using()
    releaser.join(10)
    assert not releaser.is_alive() and held.unpinned.is_set()
    assert log == ["copy done", "unregistered"] and not cudart.registered
    held.release()  # again: nothing more to do
    assert log == ["copy done", "unregistered"]


def test_a_release_from_the_pass_own_thread_leaves_the_unpinning_to_its_end(container, monkeypatch):
    log: list = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(log))
    with Container(container) as c:
        held = resident.ResidentBytes(c, "host", torch.device("cuda", 0))
    held.acquire()
    held.release()  # would wait for itself: returns, the pass unpins as it ends
    assert log == [] and not held.unpinned.is_set()
    held.done_using()
    assert log == ["unregistered"] and held.unpinned.is_set()
