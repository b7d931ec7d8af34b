"""Plain English sentences that benchmark and test prompts are built from: deterministic
text of any length, the same for every peer and run."""

SENTENCES = (
    "The river bends past the old mill and the children race paper boats along it.",
    "Paged attention keeps the keys and values of every token in fixed-size blocks.",
    "A good cup of tea needs water that has only just stopped boiling.",
    "The committee met on Tuesday to discuss the budget for the coming year.",
    "Mountains in the north stay covered in snow until the end of spring.",
    "She repaired the bicycle with a spanner, some oil and a lot of patience.",
    "Compilers turn high-level programs into instructions that a processor runs.",
    "The museum opened a new wing devoted to maps drawn by early explorers.",
    "Bees visit thousands of flowers to make a single jar of honey.",
    "The train to the coast was late again because of leaves on the line.",
    "Her grandfather kept a diary of the weather for more than forty years.",
)
