"""Moved to jaxrl_topo.envs.rewards (rewards and environments have their own room); this name stays an alias."""

import sys

from jaxrl_topo.envs import rewards as _moved

sys.modules[__name__] = _moved
