"""Chat conversations shared by the regeneration tests (multi-turn, with a system prompt)."""

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is a cat?"},
        {"role": "assistant", "content": "DATASET ANSWER ONE"},
        {"role": "user", "content": "And a dog?"},
        {"role": "assistant", "content": "DATASET ANSWER TWO"},
    ],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "DATASET RED"}],
    [
        {"role": "user", "content": "Count to three, please, slowly and clearly."},
        {"role": "assistant", "content": "DATASET 1 2 3"},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "DATASET 1 2 3 again"},
    ],
]
