"""From messages to token ids and back: chat templates, tool calls (rendered and parsed),
the tokenizer, incremental detokenization and grammars for constrained output."""
