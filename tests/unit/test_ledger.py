import threading

from pdd_sglang.prefill.ledger import TransferLedger


def test_batches_are_charged_to_the_open_scope_kv_and_aux_apart():
    ledger = TransferLedger()
    ledger.begin(room=7, destination="main:1", pages=3)
    ledger.record_batch("main:1", [100, 200])
    ledger.record_batch("main:1", [50])
    ledger.begin_aux(room=7, destination="main:1")
    ledger.record_batch("main:1", [8, 8])
    snap = ledger.snapshot()
    (row,) = snap["by_request"]
    assert row == {"room": 7, "destination": "main:1", "role": "decode", "bytes": 350, "pages": 3, "batches": 2,
                   "aux_bytes": 16, "wire_bytes": 350}
    assert snap["by_destination"]["main:1"]["bytes"] == 350


def test_a_coded_batch_counts_its_kv_and_its_wire_bytes_apart():
    """Issue 36: a coded record carries ``bytes`` of KV in ``wire_bytes`` on the wire."""
    ledger = TransferLedger()
    ledger.begin(room=8, destination="main:1", pages=4)
    ledger.record_batch("main:1", [4096], wire_bytes=3000)
    ledger.record_batch("main:1", [100])
    (row,) = ledger.snapshot()["by_request"]
    assert (row["bytes"], row["wire_bytes"], row["batches"]) == (4196, 3100, 2)
    assert ledger.snapshot()["by_role"]["decode"]["wire_bytes"] == 3100


def test_two_destinations_of_one_room_are_counted_apart():
    ledger = TransferLedger()
    ledger.begin(room=1, destination="relay", pages=10)
    ledger.record_batch("relay", [1000])
    ledger.begin(room=1, destination="main", pages=2)
    ledger.record_batch("main", [200])
    rows = {r["destination"]: r for r in ledger.snapshot()["by_request"]}
    assert (rows["relay"]["bytes"], rows["relay"]["pages"]) == (1000, 10)
    assert (rows["main"]["bytes"], rows["main"]["pages"]) == (200, 2)


def test_batch_from_another_thread_is_charged_to_the_destination_only():
    ledger = TransferLedger()
    ledger.begin(room=1, destination="main", pages=1)
    worker = threading.Thread(target=ledger.record_batch, args=("main", [64]))
    worker.start()
    worker.join()
    snap = ledger.snapshot()
    assert snap["by_destination"]["main"]["bytes"] == 64
    assert snap["by_request"][0]["bytes"] == 0


def test_old_requests_fall_out_first():
    ledger = TransferLedger(max_tracked_requests=2)
    for room in range(3):
        ledger.begin(room=room, destination="d", pages=1)
    assert [r["room"] for r in ledger.snapshot()["by_request"]] == [1, 2]
