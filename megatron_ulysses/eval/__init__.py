"""Evaluations that run the trained model under Ulysses SP: the passkey-retrieval test.

- `prompt`: the passkey prompt, tokenized to an exact length;
- `greedy`: the greedy answer of prompts by one teacher-forced forward, sharded as in training;
- `passkey`: the checked plan of a run (flags -> prompts) and the distributed evaluation;
- `results`: the accuracy table, passkey.json and the heat map.

`tools/eval_passkey.py` is the command line.
"""
