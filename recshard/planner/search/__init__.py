"""The search: sharding options per table (`enumerator`), proposals of one option per table
(`proposers`), placing a proposal's shards on ranks (`partitioners`, `refine`), the planner
that runs them (`planner`), and the statistics of the placement it chose (`stats`)."""
