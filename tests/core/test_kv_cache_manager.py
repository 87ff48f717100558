"""KVCacheManager with the disk tier (a dict standing in for worker/kv_disk.py's store): evicted registered blocks are
queued for saving, a RAM miss reads on from disk, disk hits get fresh blocks with their payloads queued, the stable
key chain separates fingerprints and LoRA adapters."""

from __future__ import annotations

from lmserve.core.block_pool import DISK_BLOCK_ID, disk_hash_blocks, disk_root
from lmserve.core.kv_cache_manager import KVCacheManager
from lmserve.lora.request import LoRARequest
from lmserve.request import Request
from lmserve.sampling_params import SamplingParams

BS = 4


class DictDisk:
    def __init__(self) -> None:
        self.files: dict[bytes, bytes] = {}
        self.reads = 0

    def read(self, key: bytes) -> bytes | None:
        self.reads += 1
        return self.files.get(key)


def _request(rid: str, tokens: list[int], lora: LoRARequest | None = None) -> Request:
    r = Request(rid, list(tokens), SamplingParams(max_tokens=4), max_tokens=4)
    r.lora_request = lora
    return r


def _run(kv: KVCacheManager, req: Request) -> tuple[list, int]:
    """Admit the request's whole prompt, mark it computed, finish it; returns its hits and hit tokens."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    kv.free(req)
    return hits, num_hit


def _move(kv: KVCacheManager, disk: DictDisk, contents: dict[int, bytes]) -> list[tuple[int, bytes]]:
    """What the engine does before a step: save evicted blocks (their contents by block id), return the loads."""
    loads, saves = kv.take_transfers()
    for block_id, key in saves:
        disk.files[key] = contents[block_id]
    return loads


def test_evicted_blocks_are_saved_and_found_on_disk() -> None:
    disk = DictDisk()
    kv = KVCacheManager(6, BS, disk=disk, disk_fingerprint=b"x" * 16)
    a = list(range(100, 113))  # 3 full blocks + 1 token
    _run(kv, _request("a", a))
    contents = {b.block_id: bytes([b.block_id]) for b in kv.pool.blocks}
    assert _move(kv, disk, contents) == [] and not disk.files
    _run(kv, _request("b", list(range(200, 221))))  # 6 blocks: evicts every block of a
    assert _move(kv, disk, contents) == [] and len(disk.files) == 3, "a's three registered blocks were saved"
    req = _request("a2", a)
    hits, num_hit = kv.get_computed_blocks(req)
    assert num_hit == 12 and [h.block_id for h in hits] == [DISK_BLOCK_ID] * 3
    assert kv.can_allocate(req.num_tokens, hits)
    table = kv.allocate_slots(req, 1, hits)
    assert table is not None and len(table) == 4
    loads = kv.take_transfers()[0]
    assert [b for b, _ in loads] == [b.block_id for b in table[:3]]
    assert [p for _, p in loads] == [disk.files[k] for k in req.disk_block_keys[:3]]
    assert not req.disk_payloads, "payloads handed over with the loads"
    again = _request("a3", a)  # the loaded blocks are registered at once: a request of the same step hits them
    hits3, _ = kv.get_computed_blocks(again)
    assert [h.block_id for h in hits3] == [b.block_id for b in table[:3]]
    kv.pool.check_invariants(kv.live_tables())


def test_a_waiting_request_reads_its_disk_blocks_once() -> None:
    disk = DictDisk()
    kv = KVCacheManager(8, BS, disk=disk, disk_fingerprint=b"x" * 16)
    req = _request("a", list(range(9)))
    root = disk_root(b"x" * 16)
    for key in disk_hash_blocks(req.all_token_ids, BS, [], root):
        disk.files[key] = b"p"
    for _ in range(3):
        assert kv.get_computed_blocks(req)[1] == 8
    assert disk.reads == 2, "read once, kept with the request until it is admitted"


def test_the_chain_separates_fingerprints_and_adapters() -> None:
    tokens = list(range(16))
    lora = LoRARequest("ad", 1, "/adapters/ad")
    base = disk_hash_blocks(tokens, BS, [], disk_root(b"x" * 16))
    assert base == disk_hash_blocks(tokens, BS, base[:2], disk_root(b"x" * 16)), "the chain extends"
    assert not set(base) & set(disk_hash_blocks(tokens, BS, [], disk_root(b"y" * 16)))
    assert not set(base) & set(disk_hash_blocks(tokens, BS, [], disk_root(b"x" * 16, lora.lora_name, lora.path)))
    disk = DictDisk()
    kv = KVCacheManager(8, BS, disk=disk, disk_fingerprint=b"x" * 16)
    req = _request("r", tokens + [1], lora)
    kv.get_computed_blocks(req)
    assert req.disk_block_keys[0] not in base


def test_without_the_disk_tier_nothing_is_queued() -> None:
    kv = KVCacheManager(4, BS)
    _run(kv, _request("a", list(range(9))))
    _run(kv, _request("b", list(range(50, 66))))
    assert kv.take_transfers() == ([], []) and all(b.disk_key is None for b in kv.pool.blocks)
