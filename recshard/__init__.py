"""recshard: shard the embedding tables of recommender models and train them fast."""

from recshard.types import BoundsCheckMode, ShardingEnv, ShardingPlan, ShardingType  # noqa: F401
