"""Downloads without a host copy (issue 14): a large downloaded value is the received frame's
memory; it must behave as eager's tensor (values, strides, writable, independent of the server's
copy). One ``--insecure`` server on 127.0.0.1, killed in ``finally``.
"""

from __future__ import annotations

import pytest
import torch

import genie

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from genie.remote.client import ZERO_COPY_MIN  # noqa: E402
from test_recovery import spawn_servers, stop  # noqa: E402


def test_downloads_are_writable_and_independent() -> None:
    [(srv, addr)] = spawn_servers(1)
    try:
        genie.connect(addr, insecure=True, timeout=20)
        torch.manual_seed(0)
        big = torch.randn(512, 512)  # 1 MiB: zero-copy
        small = torch.randn(3)  # copied
        assert big.numel() * 4 >= ZERO_COPY_MIN > small.numel() * 4
        for x in (big, small, big.t()):
            d = x.to("remote_accelerator") * 2
            got = d.cpu()
            ref = x * 2
            torch.testing.assert_close(got, ref, rtol=0, atol=0)
            assert got.stride() == ref.stride() and got.dtype == ref.dtype
            got.add_(1)  # writable, and only the client's copy changes
            torch.testing.assert_close(d.cpu(), ref, rtol=0, atol=0)
            torch.testing.assert_close(got, ref + 1, rtol=0, atol=0)
    finally:
        genie.disconnect()
        stop([srv])


def test_large_transfers_report_size_and_rate_only_when_asked(monkeypatch, caplog) -> None:
    """Uploads and downloads of at least ``genie.progress.LARGE`` bytes are reported on the
    ``genie.progress`` logger at INFO (size, duration and rate, the duration spanning request to
    reply); silent at the default level. The threshold is lowered here to keep the test small."""
    import logging

    import genie.progress

    monkeypatch.setattr(genie.progress, "LARGE", 1 << 20)
    [(srv, addr)] = spawn_servers(1)
    try:
        genie.connect(addr, insecure=True, timeout=20)
        x = torch.randn(1 << 19)  # 2 MiB
        with caplog.at_level(logging.WARNING, logger="genie.progress"):
            torch.testing.assert_close((x.to("remote_accelerator") + 1).cpu(), x + 1)
        assert not [r for r in caplog.records if r.name == "genie.progress"]
        with caplog.at_level(logging.INFO, logger="genie.progress"):
            torch.testing.assert_close((x.to("remote_accelerator") * 2).cpu(), x * 2)
        msgs = [r.getMessage() for r in caplog.records if r.name == "genie.progress"]
        assert f"genie: upload of 2.0 MB to {addr}..." in msgs, msgs
        done = [m for m in msgs if " done in " in m]
        assert [m.split(" of ")[0] for m in done] == ["genie: upload", "genie: download"], msgs
        assert all("MB/s, request to reply)" in m and "2.0 MB" in m for m in done), msgs
    finally:
        genie.disconnect()
        stop([srv])
