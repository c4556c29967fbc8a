"""torch.profiler shows Genie's phases as record_function ranges, and only under a profiler."""

import torch

import genie
import genie.profiling

DEV = "remote_accelerator:0"


def _names(prof):
    return {e.name for e in prof.events()}


def test_profile_contains_record_plan_execute_transfer():
    x = torch.randn(16, 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = (x.to(DEV) @ x.to(DEV)).relu().sum(0)
        got = y.cpu()
    torch.testing.assert_close(got, (x @ x).relu().sum(0))
    names = _names(prof)
    for phase in ("genie.record", "genie.plan", "genie.execute", "genie.transfer"):
        assert phase in names, f"{phase} missing from {sorted(n for n in names if 'genie' in n)}"
    # the real kernels run inside genie.execute
    assert "aten::mm" in names


def test_no_ranges_without_a_profiler():
    assert not genie.profiling.enabled()
    assert genie.profiling.phase("plan") is genie.profiling.phase("execute")  # the shared no-op
    with torch.autograd.profiler.profile() as prof:
        assert genie.profiling.enabled()
        (torch.ones(2, device=DEV) * 2).tolist()
    assert "genie.execute" in {e.name for e in prof.function_events}
    assert not genie.profiling.enabled()
