"""The suite's own set-up (conftest.py) does what it says."""

import pytest


def test_xdist_keeps_each_files_tests_on_one_worker(request):
  """conftest.py marks every test with an xdist_group, so that `make test` (--dist loadgroup) builds each file's
  module fixtures once. pytest 9.2 with pytest-xdist 3.8 ignored the marks silently (no '@group' suffix on the
  test ids): every file was split over both workers and its fixtures built twice. This fails if that comes back."""
  if not getattr(request.config.option, "loadgroup", False):
    pytest.skip("not run under xdist --dist loadgroup")
  assert "@" in request.node.nodeid, (f"{request.node.nodeid}: xdist ignored the xdist_group marks; "
                                      "pyproject.toml pins a pytest that it does not")
