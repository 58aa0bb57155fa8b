"""The cost model: what a shard costs per step and in memory (`estimators`, `cache_stats`),
each sharding group's fixed step cost (`step_model`), the memory held back on every rank
(`reservation`), and the per-rank yardstick of a whole plan (`plan_stats`)."""
