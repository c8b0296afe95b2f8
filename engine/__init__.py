"""Everything that runs models: config, sequences, KV blocks, scheduler, runner, models."""
