"""Megatron-LM compatibility, fenced off from the sections: `compat` (its flags accepted with no
effect here), `refused` (its flags and values refused, each with why and what to use)."""
