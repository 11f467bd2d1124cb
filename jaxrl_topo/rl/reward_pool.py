"""Moved to jaxrl_topo.envs.reward_pool (rewards and environments have their own room); this name stays an alias."""

import sys

from jaxrl_topo.envs import reward_pool as _moved

sys.modules[__name__] = _moved
