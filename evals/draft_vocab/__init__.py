"""The vocabulary-pruned draft head: build its frequency table and measure what N costs.

`build_table` generates the target's greedy outputs on the built-in prompts (the corpus) and ranks
token ids by frequency; `measure` replays those outputs to get, for each kept-vocabulary size N and
each ranking (frequency or id order), the greedy acceptance the draft would reach and the draft's
forward time. See docs/draft_vocab.md.
"""
