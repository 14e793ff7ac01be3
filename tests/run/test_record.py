"""RUN_DIR/producer.json: a resumed producer binds the address its workers know."""

from __future__ import annotations

from pathlib import Path

from dflash_pipe.run.record import bind_address, read_record, write_record


def test_resume_binds_the_recorded_port_and_keeps_worker_records(tmp_path: Path):
    assert bind_address(tmp_path, "tcp://127.0.0.1:0") == "tcp://127.0.0.1:0"
    write_record(tmp_path, address="tcp://127.0.0.1:41234", workers=[{"name": "worker0", "pid": 5}])
    write_record(tmp_path, address="tcp://127.0.0.1:41234")
    assert read_record(tmp_path)["workers"] == [{"name": "worker0", "pid": 5}]
    assert bind_address(tmp_path, "tcp://127.0.0.1:0") == "tcp://127.0.0.1:41234"
    # An explicit port, or another host, wins over the record.
    assert bind_address(tmp_path, "tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    assert bind_address(tmp_path, "tcp://0.0.0.0:0") == "tcp://0.0.0.0:0"
