"""Progress messages (genie/progress.py): quiet by default, sizes and rates when enabled."""

import logging

import genie.progress as progress


def test_quiet_by_default(caplog):
    with caplog.at_level(logging.WARNING, logger="genie.progress"):
        with progress.waiting("compiling"), progress.transfer("upload", 1 << 30, "tcp://x"):
            pass
    assert not caplog.records


def test_waits_and_large_transfers_report_sizes_and_rates(caplog):
    with caplog.at_level(logging.INFO, logger="genie.progress"):
        with progress.waiting("compiling a plan of 12 ops"):
            pass
        with progress.transfer("upload", 100 << 20, "tcp://127.0.0.1:5555"):
            pass
        with progress.transfer("download", 1 << 10, "tcp://127.0.0.1:5555"):  # small: silent
            pass
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "genie: compiling a plan of 12 ops..."
    assert msgs[1].startswith("genie: compiling a plan of 12 ops: done in ")
    assert msgs[2] == "genie: upload of 100.0 MB to tcp://127.0.0.1:5555..."
    assert "MB/s" in msgs[3] and len(msgs) == 4
