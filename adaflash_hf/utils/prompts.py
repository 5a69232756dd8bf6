# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""How a user prompt becomes token ids (library code and the offline testbed encode prompts the same way)."""


def encode_prompt(tokenizer, prompt: str, chat_template: bool = True) -> list[int]:
    """Token ids of a user prompt, wrapped in the chat template (with the assistant turn opened) by default."""
    if chat_template and tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    return tokenizer(prompt)["input_ids"]


__all__ = ["encode_prompt"]
