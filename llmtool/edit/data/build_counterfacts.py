"""Builds ``counterfact_smollm2.jsonl``: counterfactual edit requests in CounterFact layout, written
for this project (no third-party data). Each fact is kept only if the model prefers the
true object over the counterfactual one (mean-token NLL), so edits change something it knows.

Run: ``python -m llmtool.edit.data.build_counterfacts`` (needs the default model materialized);
``--model gemma3-270m`` writes ``counterfact_gemma3.jsonl`` (the same candidates, filtered by what
Gemma 3 270M knows; prompts scored with its BOS, ``edit.prompts.encode_prompt``).
Neighbourhood prompts are other subjects of the same relation with their own true answers,
written in this project's extension ``"neighborhood": [{"prompt": ..., "target": ...}]``.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

RELATIONS = {
    "capital": {
        "prompt": "The capital of {} is",
        "paraphrases": ["The capital city of {} is", "{} has its capital in the city of"],
        "generation": "{} is a country whose capital",
        "facts": [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
                  ("Japan", "Tokyo"), ("Russia", "Moscow"), ("China", "Beijing"), ("Egypt", "Cairo"),
                  ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Poland", "Warsaw"),
                  ("Hungary", "Budapest"), ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
                  ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Belgium", "Brussels"),
                  ("the Netherlands", "Amsterdam"), ("Canada", "Ottawa"), ("Australia", "Canberra"),
                  ("Argentina", "Buenos Aires"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Thailand", "Bangkok"),
                  ("South Korea", "Seoul"), ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Cuba", "Havana"),
                  ("Mexico", "Mexico City"), ("India", "New Delhi"), ("the United Kingdom", "London"),
                  ("Turkey", "Ankara"), ("Chile", "Santiago"), ("Colombia", "Bogota"), ("Vietnam", "Hanoi"),
                  ("Ukraine", "Kyiv"), ("the Czech Republic", "Prague"), ("Romania", "Bucharest"),
                  ("Indonesia", "Jakarta"), ("the Philippines", "Manila"), ("Venezuela", "Caracas"),
                  ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"), ("Afghanistan", "Kabul"), ("Syria", "Damascus"),
                  ("Lebanon", "Beirut"), ("Nepal", "Kathmandu"), ("Bangladesh", "Dhaka"),
                  ("Malaysia", "Kuala Lumpur"), ("Saudi Arabia", "Riyadh"), ("Pakistan", "Islamabad"),
                  ("Ethiopia", "Addis Ababa")],
    },
    "language": {
        "prompt": "The official language of {} is",
        "paraphrases": ["In {}, the official language is", "Most people in {} speak"],
        "generation": "People who grew up in {} usually speak",
        "facts": [("France", "French"), ("Germany", "German"), ("Italy", "Italian"), ("Spain", "Spanish"),
                  ("Japan", "Japanese"), ("Russia", "Russian"), ("Brazil", "Portuguese"), ("Greece", "Greek"),
                  ("the Netherlands", "Dutch"), ("Poland", "Polish"), ("Turkey", "Turkish"), ("Sweden", "Swedish"),
                  ("Finland", "Finnish"), ("Hungary", "Hungarian"), ("Israel", "Hebrew"), ("Thailand", "Thai"),
                  ("Vietnam", "Vietnamese"), ("Norway", "Norwegian"), ("Denmark", "Danish"), ("Mexico", "Spanish"),
                  ("Egypt", "Arabic"), ("China", "Chinese"), ("South Korea", "Korean"), ("Iran", "Persian")],
    },
    "landmark": {
        "prompt": "{} is located in the city of",
        "paraphrases": ["You can visit {} in the city of", "The famous {} stands in"],
        "generation": "Tourists who travel to see {} also",
        "facts": [("The Eiffel Tower", "Paris"), ("The Colosseum", "Rome"), ("Big Ben", "London"),
                  ("The Statue of Liberty", "New York"), ("The Brandenburg Gate", "Berlin"),
                  ("The Kremlin", "Moscow"), ("The Sagrada Familia", "Barcelona"),
                  ("The Golden Gate Bridge", "San Francisco"), ("The Sydney Opera House", "Sydney"),
                  ("The Acropolis", "Athens"), ("The Taj Mahal", "Agra"), ("The Forbidden City", "Beijing"),
                  ("The Space Needle", "Seattle"), ("The Louvre", "Paris"), ("Hagia Sophia", "Istanbul"),
                  ("The Leaning Tower", "Pisa"), ("Buckingham Palace", "London"), ("The Vatican", "Rome")],
    },
    "author": {
        "prompt": "The novel {} was written by",
        "paraphrases": ["The author of the book {} is", "{} is a famous book by"],
        "generation": "Readers who loved {} often",
        "facts": [("Pride and Prejudice", "Jane Austen"), ("Hamlet", "William Shakespeare"),
                  ("Nineteen Eighty-Four", "George Orwell"), ("War and Peace", "Leo Tolstoy"),
                  ("Oliver Twist", "Charles Dickens"), ("Don Quixote", "Miguel de Cervantes"),
                  ("Moby-Dick", "Herman Melville"), ("The Odyssey", "Homer"), ("Frankenstein", "Mary Shelley"),
                  ("Les Miserables", "Victor Hugo"), ("The Great Gatsby", "F. Scott Fitzgerald"),
                  ("Harry Potter", "J.K. Rowling"), ("The Hobbit", "J.R.R. Tolkien"), ("Ulysses", "James Joyce")],
    },
    "founder": {
        "prompt": "{} was founded by",
        "paraphrases": ["The founder of {} is", "{} was started by its founder"],
        "generation": "The company {} is known for",
        "facts": [("Microsoft", "Bill Gates"), ("Apple", "Steve Jobs"), ("Amazon", "Jeff Bezos"),
                  ("Facebook", "Mark Zuckerberg"), ("Ford", "Henry Ford"), ("Google", "Larry Page"),
                  ("Tesla", "Elon Musk"), ("Disney", "Walt Disney"), ("Oracle", "Larry Ellison")],
    },
}


def candidates(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for rel, spec in RELATIONS.items():
        facts = spec["facts"]
        objects = sorted({o for _, o in facts})
        for subj, true in facts:
            new = rng.choice([o for o in objects if o != true])
            others = [(s, o) for s, o in facts if s != subj and o not in (true, new)]
            neigh = rng.sample(others, k=min(3, len(others)))
            rows.append({
                "case_id": len(rows), "relation": rel,
                "requested_rewrite": {"prompt": spec["prompt"], "subject": subj,
                                      "target_new": {"str": new}, "target_true": {"str": true}},
                "paraphrase_prompts": [p.format(subj) for p in spec["paraphrases"]],
                "neighborhood": [{"prompt": spec["prompt"].format(s), "target": o} for s, o in neigh],
                "generation_prompts": [spec["generation"].format(subj)],
            })
    return rows


OUTPUTS = {"smollm2-135m": "counterfact_smollm2.jsonl", "gemma3-270m": "counterfact_gemma3.jsonl"}


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(OUTPUTS))
    args = ap.parse_args(argv)
    from llmtool.core.job import apply_threads
    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.edit.metrics import target_nll

    apply_threads()  # the one thread policy: $LLMTOOL_THREADS
    tok, model = load_tokenizer(args.model), load_model(args.model)
    kept = []
    for row in candidates():
        rw = row["requested_rewrite"]
        prompt = rw["prompt"].replace("{}", rw["subject"])
        nll_true = target_nll(model, tok, [prompt], rw["target_true"]["str"])[0]
        nll_new = target_nll(model, tok, [prompt], rw["target_new"]["str"])[0]
        print(rw["subject"], rw["target_true"]["str"], round(nll_true, 2), rw["target_new"]["str"], round(nll_new, 2),
              flush=True)
        if nll_true < nll_new:
            row["case_id"] = len(kept)
            kept.append(row)
    out = Path(__file__).with_name(OUTPUTS[args.model])
    out.write_text("".join(json.dumps(r) + "\n" for r in kept))
    print(f"kept {len(kept)} of {len(candidates())} candidate requests")


if __name__ == "__main__":
    main()
