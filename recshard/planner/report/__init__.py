"""For people: the `recshard-plan` command line (`cli`), the tables file it reads
(`tables_file`), and why a table got its option (`explain`)."""
