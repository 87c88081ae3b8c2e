"""Every daemon the tests start keeps its start-up profile of step costs in one directory for the session
(speculative.profile_cache): a daemon started like an earlier one plans with that one's profile instead of
spending 13-20 s on its own, and no test writes to the user's cache."""

import os

import pytest

PROFILE_CACHE_VAR = "MTPSERVE_SPECULATIVE_PROFILE_CACHE"


@pytest.fixture(scope="session", autouse=True)
def kept_step_profiles(tmp_path_factory: pytest.TempPathFactory):
    before = os.environ.get(PROFILE_CACHE_VAR)
    os.environ[PROFILE_CACHE_VAR] = str(tmp_path_factory.mktemp("step-profiles"))
    yield
    if before is None:
        os.environ.pop(PROFILE_CACHE_VAR, None)
    else:
        os.environ[PROFILE_CACHE_VAR] = before
