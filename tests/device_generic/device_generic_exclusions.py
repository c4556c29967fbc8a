"""The one table of PyTorch device-generic tests excluded on ``remote_accelerator``, with reasons.

Keys are ``file::GenericClass::test_name`` with the device removed from the test's name (the same
name on cpu and on the device); a key with ``*`` is an fnmatch pattern. Every entry is a test
that passes on cpu and fails on the device (``tools/device_generic_report.py`` lists them); an
excluded test is skipped on the device with its reason. Families 1-5 are those of issue 29.
"""

EXCLUSIONS: dict[str, str] = {
}
